"""Execute every research notebook in notebooks/ and check what it saved.

Each notebook asserts its own numbers against a reference (torch.func, SciPy,
dense linear algebra), so running it is the test: any cell error fails. The
kernel is this interpreter (a kernelspec written to a temporary directory by
notebooks/build_notebooks.py), so nothing has to be installed first.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat is needed to read the notebooks")
pytest.importorskip("nbclient", reason="nbclient is needed to execute the notebooks")
pytest.importorskip("ipykernel", reason="ipykernel is needed to execute the notebooks")
pytest.importorskip("matplotlib", reason="the notebooks plot with matplotlib")
pytest.importorskip("scipy", reason="the notebooks use SciPy references")

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOK_NAMES = ["hessian_newton", "per_example_gradients", "numerical_methods"]
# A hang guard, not a speed check: each notebook runs in well under 2 minutes
# on 2 cores (timings are printed with -s and listed in notebooks/README.md).
TIME_LIMIT_S = 600.0


def _load_builder():
    spec = importlib.util.spec_from_file_location("build_notebooks", NOTEBOOK_DIR / "build_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


builder = _load_builder()


def _saved(name: str) -> nbformat.NotebookNode:
    return nbformat.read(NOTEBOOK_DIR / f"{name}.ipynb", as_version=4)


def _output_types(notebook: nbformat.NotebookNode) -> set[str]:
    kinds = set()
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            kinds.add(output.output_type)
            kinds.update(output.get("data", {}))
    return kinds


def test_every_source_has_a_notebook():
    assert sorted(s.stem for s in builder.source_paths()) == sorted(NOTEBOOK_NAMES)


@pytest.mark.parametrize("name", NOTEBOOK_NAMES)
def test_saved_notebook_matches_its_source(name):
    """The committed .ipynb was built from the current source (rebuild: notebooks/build_notebooks.py)."""
    built = builder.build_notebook(builder.SOURCE_DIR / f"{name}.py")
    saved = _saved(name)
    assert [(c.cell_type, c.source) for c in saved.cells] == [(c.cell_type, c.source) for c in built.cells], (
        f"notebooks/{name}.ipynb is out of date: run notebooks/build_notebooks.py {name}"
    )


@pytest.mark.parametrize("name", NOTEBOOK_NAMES)
def test_saved_notebook_keeps_its_plots(name):
    saved = _saved(name)
    kinds = _output_types(saved)
    assert "image/png" in kinds, f"notebooks/{name}.ipynb has no saved plot"
    assert "error" not in kinds, f"notebooks/{name}.ipynb was saved with an error output"
    code_cells = [c for c in saved.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code_cells), f"notebooks/{name}.ipynb was saved unexecuted"


def test_commented_magics_become_magics():
    cells = builder.parse_cells("# %% [markdown]\n# # Title\n# text\n\n# %%\n# %matplotlib inline\nx = 1  # %not\n")
    assert cells == [("markdown", "# Title\ntext"), ("code", "%matplotlib inline\nx = 1  # %not")]


def test_a_failing_cell_fails_execution():
    from nbclient.exceptions import CellExecutionError

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import t2j_ad\nassert False, 'boom'")])
    with pytest.raises(CellExecutionError, match="boom"):
        builder.execute_notebook(notebook, cell_timeout=60, env={"JAX_PLATFORMS": "cpu"})


@pytest.mark.parametrize("name", NOTEBOOK_NAMES)
def test_notebook_runs(name):
    notebook = _saved(name)
    for cell in notebook.cells:  # run from a clean slate, not the saved outputs
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    seconds = builder.execute_notebook(
        notebook,
        cell_timeout=TIME_LIMIT_S,
        env={"JAX_PLATFORMS": "cpu", "T2J_AD_TORCH_THREADS": "1"},
    )
    assert "image/png" in _output_types(notebook), f"{name} produced no plot"
    print(f"{name}: {seconds:.0f} s")
