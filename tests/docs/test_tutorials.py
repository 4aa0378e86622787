"""The tutorials in ``docs/tutorials/`` run: each jupytext percent script ``NN_name.py`` is paired with
``NN_name.ipynb`` (same cells, kept in step: ``jupytext --sync docs/tutorials/*.py``), and each executes from
top to bottom in a fresh ipykernel at tiny sizes (``ATTNLAB_TUTORIAL_QUICK=1``), leaving at least one figure
or view among its outputs. A tutorial that stops running is a failing test.

Execution is marked ``tutorial`` (deselected by the default run to keep it within its time budget; ``make
test-tutorials`` and CI run it); the pairing check is cheap and always runs.
"""
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext", reason="jupytext is a dev dependency (pip install -e .[dev])")
nbformat = pytest.importorskip("nbformat", reason="nbformat is a dev dependency (pip install -e .[dev])")
nbclient = pytest.importorskip("nbclient", reason="nbclient is a dev dependency (pip install -e .[dev])")

HERE = Path(__file__).resolve().parents[2] / "docs" / "tutorials"
TUTORIALS = sorted(HERE.glob("[0-9][0-9]_*.py"))
FIGURES = ("image/png", "image/svg+xml", "text/html")


def _cells(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def test_there_are_tutorials():
    assert len(TUTORIALS) >= 7, [p.name for p in TUTORIALS]
    index = (HERE / "README.md").read_text(encoding="utf-8")
    for path in TUTORIALS:
        assert f"({path.stem}.ipynb)" in index, f"docs/tutorials/README.md does not link {path.stem}.ipynb"


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.stem)
def test_notebook_is_paired_and_in_step(path):
    ipynb = path.with_suffix(".ipynb")
    assert ipynb.exists(), f"{ipynb.name} is missing: run `jupytext --sync {path}`"
    script, notebook = jupytext.read(path), nbformat.read(ipynb, as_version=4)
    assert _cells(script) == _cells(notebook), f"{ipynb.name} is out of step with {path.name}: jupytext --sync"
    assert not [c for c in notebook.cells if c.cell_type == "code" and c.outputs], "commit notebooks without outputs"
    assert script.cells[0].cell_type == "markdown" and script.cells[0].source.startswith("# ")


@pytest.mark.tutorial
@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.stem)
def test_tutorial_executes(path, tmp_path, monkeypatch):
    pytest.importorskip("ipykernel", reason="ipykernel is a dev dependency (pip install -e .[dev])")
    monkeypatch.setenv("ATTNLAB_TUTORIAL_QUICK", "1")  # the kernel inherits this process's environment
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = jupytext.read(path)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError with the failing cell's traceback
    nbformat.write(nb, tmp_path / path.with_suffix(".ipynb").name)
    shown = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
             if o.output_type in ("display_data", "execute_result") and any(k in o.data for k in FIGURES)]
    assert shown, f"{path.name} shows no plot or view"
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
