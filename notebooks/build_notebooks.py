"""Build the research notebooks from their Python sources, and run them.

Each notebook is written as a plain Python file in ``notebooks/src/`` in the
"percent" format that jupytext and most editors understand:

    # %% [markdown]
    # # A title
    # Some prose.

    # %%
    x = 1 + 1

A ``# %% [markdown]`` cell's lines lose their leading ``# ``; a ``# %%`` cell
is code. Inside code, a commented IPython magic such as ``# %matplotlib inline``
is uncommented (jupytext's convention), so the source stays valid Python.

This script turns every source into ``notebooks/<name>.ipynb``, executes it
with nbclient in a kernel that runs *this* interpreter (``sys.executable``, no
kernelspec needs installing first) from the repository root, and saves the
notebook with its outputs, plots included. The test suite
(``tests/test_notebooks.py``) uses the same helpers to execute the saved
notebooks.

Usage::

    python notebooks/build_notebooks.py                 # all notebooks
    python notebooks/build_notebooks.py hessian_newton  # just one
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parent
SOURCE_DIR = NOTEBOOK_DIR / "src"
REPO_ROOT = NOTEBOOK_DIR.parent

# The kernelspec recorded in the saved notebooks: what a reader's Jupyter
# opens them with. Execution here never looks it up (see _kernel_manager).
DEFAULT_KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
_KERNEL_NAME = "t2j-ad-current-python"

_CELL_MARKER = re.compile(r"^# %%(?P<markdown> \[markdown\])?\s*$")
_COMMENTED_MAGIC = re.compile(r"^# (%[a-zA-Z]\w*.*)$")


def source_paths() -> list[Path]:
    """Every notebook source, sorted by name."""
    return sorted(SOURCE_DIR.glob("*.py"))


def notebook_path(source: Path) -> Path:
    """Where the notebook built from ``source`` is saved."""
    return NOTEBOOK_DIR / f"{source.stem}.ipynb"


def parse_cells(text: str) -> list[tuple[str, str]]:
    """Split percent-format text into ``(kind, source)`` with kind "markdown"/"code"."""
    cells: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        marker = _CELL_MARKER.match(line)
        if marker:
            cells.append(("markdown" if marker["markdown"] else "code", []))
        elif cells:
            cells[-1][1].append(line)
        elif line.strip() and not line.startswith("#"):
            raise ValueError(f"code before the first '# %%' marker: {line!r}")
    return [(kind, _cell_source(kind, lines)) for kind, lines in cells]


def _cell_source(kind: str, lines: list[str]) -> str:
    if kind == "markdown":
        lines = [line[2:] if line.startswith("# ") else line.lstrip("#") for line in lines]
    else:
        lines = [_uncomment_magic(line) for line in lines]
    return "\n".join(lines).strip("\n")


def _uncomment_magic(line: str) -> str:
    magic = _COMMENTED_MAGIC.match(line)
    return magic[1] if magic else line


def build_notebook(source: Path) -> nbformat.NotebookNode:
    """The (unexecuted) notebook described by ``source``."""
    make_cell = {"markdown": nbformat.v4.new_markdown_cell, "code": nbformat.v4.new_code_cell}
    cells = [make_cell[kind](text) for kind, text in parse_cells(source.read_text())]
    notebook = nbformat.v4.new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = dict(DEFAULT_KERNELSPEC)
    notebook.metadata["language_info"] = {"name": "python"}
    return notebook


@contextlib.contextmanager
def _kernel_manager(env: Mapping[str, str]) -> Iterator[KernelManager]:
    """A kernel manager whose kernel is ``sys.executable -m ipykernel_launcher``.

    The kernelspec lives in a temporary directory, so nothing has to be
    installed (``ipykernel install``) and the kernel is always the interpreter
    running this code, whatever kernels the machine has registered.
    """
    with tempfile.TemporaryDirectory(prefix="t2j_ad_kernel_") as kernels:
        spec_dir = Path(kernels) / _KERNEL_NAME
        spec_dir.mkdir()
        spec = {
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "t2j_ad (current interpreter)",
            "language": "python",
            "env": dict(env),
        }
        (spec_dir / "kernel.json").write_text(json.dumps(spec))
        specs = KernelSpecManager(kernel_dirs=[kernels], ensure_native_kernel=False)
        yield KernelManager(kernel_name=_KERNEL_NAME, kernel_spec_manager=specs)


def execute_notebook(
    notebook: nbformat.NotebookNode,
    *,
    cell_timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
) -> float:
    """Run every cell of ``notebook`` in place; return the wall time in seconds.

    The kernel starts in the repository root with the root on ``PYTHONPATH``,
    so ``import t2j_ad`` finds the source tree. ``env`` adds environment
    variables for the kernel. A cell that raises makes nbclient raise
    ``CellExecutionError`` with the cell's traceback.
    """
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    kernel_env = {"PYTHONPATH": python_path, **(env or {})}
    with _kernel_manager(kernel_env) as manager:
        client = NotebookClient(
            notebook,
            km=manager,
            timeout=cell_timeout,
            resources={"metadata": {"path": str(REPO_ROOT)}},
        )
        start = time.perf_counter()
        client.execute(cleanup_kc=True)  # shut the kernel down: nbclient does not own it
        return time.perf_counter() - start


def main(names: list[str]) -> None:
    sources = source_paths()
    if names:
        sources = [s for s in sources if s.stem in names]
        missing = set(names) - {s.stem for s in sources}
        if missing:
            raise SystemExit(f"no notebook source for {sorted(missing)} in {SOURCE_DIR}")
    for source in sources:
        notebook = build_notebook(source)
        seconds = execute_notebook(notebook)
        nbformat.write(notebook, notebook_path(source))
        print(f"{notebook_path(source).relative_to(REPO_ROOT)}: executed in {seconds:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
