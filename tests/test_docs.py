"""The documentation: links resolve inside the repository, the site builds
with warnings as errors, and the API reference covers every public name."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

# [text](target) and [text](target "title"), and reference definitions [id]: target.
_INLINE = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def markdown_files() -> list[Path]:
    """README.md and every Markdown file of the repository outside .venv and build outputs."""
    skip = {".venv", "site", "build", ".git", "node_modules"}
    return sorted(p for p in ROOT.rglob("*.md") if not skip & set(p.relative_to(ROOT).parts))


def relative_links(text: str) -> list[str]:
    """Link targets in Markdown ``text`` that are paths, not URLs or bare anchors."""
    text = _CODE_SPAN.sub("", _FENCE.sub("", text))
    targets = _INLINE.findall(text) + _REFERENCE.findall(text)
    return [t for t in targets if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", t) and not t.startswith("#")]


def broken_links(text: str, base: Path) -> list[str]:
    """The relative links in ``text`` (a file in ``base``) that do not resolve inside the repository."""
    broken = []
    for target in relative_links(text):
        file_part = unquote(target.split("#", 1)[0].split("?", 1)[0])
        resolved = (base / file_part).resolve()
        if not resolved.is_relative_to(ROOT):
            broken.append(f"{target} (outside the repository)")
        elif not resolved.exists():
            broken.append(f"{target} (no such file)")
    return broken


def test_link_extraction_sees_links_and_skips_urls_and_code():
    text = (
        "[a](docs/x.md) [b](../out.md#part) [c](https://example.com) [d](#here)\n"
        "`[e](in_code.md)`\n```\n[f](in_fence.md)\n```\n[g]: ref/target.md\n"
    )
    assert relative_links(text) == ["docs/x.md", "../out.md#part", "ref/target.md"]


def test_links_out_of_the_repository_or_to_no_file_are_reported():
    assert broken_links("[design](../shared/DESIGN.md)", ROOT) == ["../shared/DESIGN.md (outside the repository)"]
    assert broken_links("[x](docs/nope.md#a)", ROOT) == ["docs/nope.md#a (no such file)"]
    assert broken_links("[ok](index.md#quick-start) [up](../README.md)", DOCS) == []


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(path):
    assert broken_links(path.read_text(), path.parent) == []


def test_docs_site_builds_with_warnings_as_errors(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs not installed (pinned in requirements.txt)")
    pytest.importorskip("mkdocstrings_handlers.python", reason="mkdocstrings-python not installed (requirements.txt)")
    result = subprocess.run(
        # Not --quiet: it stops the warnings being logged, so strict mode
        # never counted them and a broken site passed.
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert "WARNING" not in result.stderr, result.stderr
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "Wrap a PyTorch function as a JAX function" in api  # the docstrings were rendered


def _public_names() -> set[str]:
    import t2j_ad
    import t2j_ad.compat

    top = {n for n in vars(t2j_ad) if not n.startswith("_") and not isinstance(getattr(t2j_ad, n), type(sys))}
    assert top == set(t2j_ad.__all__), "t2j_ad.__all__ must list the public names __init__.py imports"
    return {f"t2j_ad.{n}" for n in top} | {f"t2j_ad.compat.{n}" for n in t2j_ad.compat.__all__}


def test_api_reference_covers_every_public_name():
    text = (DOCS / "api.md").read_text()
    documented = set(re.findall(r"^::: (\S+)", text, re.MULTILINE))
    compat_headings = {f"t2j_ad.compat.{n}" for n in re.findall(r"^### `(\w+)`", text, re.MULTILINE)}
    missing = _public_names() - documented - compat_headings
    assert not missing, f"docs/api.md lacks {sorted(missing)}"
