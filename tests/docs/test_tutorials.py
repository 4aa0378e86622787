"""The tutorials in ``docs/tutorials/`` run: each jupytext percent script ``NN_name.py`` is paired with
``NN_name.ipynb`` (same cells, written with their outputs and a kernelspec by ``make notebooks``, so a notebook
opens ready), and each executes from top to bottom in a fresh ipykernel at tiny sizes (``ATTNLAB_TUTORIAL_QUICK=1``,
``docs/tutorials/execute.py``, the same code as ``make notebooks``), leaving at least one figure or view among its
outputs and no warning or stray repr. A tutorial that stops running is a failing test.

Execution is marked ``tutorial`` (deselected by the default run to keep it within its time budget; ``make
test-tutorials`` and CI run it); the pairing check is cheap and always runs.
"""
import importlib.util
import re
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext", reason="jupytext is a dev dependency (pip install -e .[dev])")
nbformat = pytest.importorskip("nbformat", reason="nbformat is a dev dependency (pip install -e .[dev])")
nbclient = pytest.importorskip("nbclient", reason="nbclient is a dev dependency (pip install -e .[dev])")

HERE = Path(__file__).resolve().parents[2] / "docs" / "tutorials"
TUTORIALS = sorted(HERE.glob("[0-9][0-9]_*.py"))
FIGURES = ("image/png", "image/svg+xml", "text/html")
# what a reader must not meet in an output: tqdm's warning without ipywidgets, a repr such as torch.manual_seed's
# <torch._C.Generator object at 0x...>
NOISE = re.compile(r"TqdmWarning|IProgress not found|<[\w.]+ object at 0x[0-9a-f]+>")


def _execute_module():
    spec = importlib.util.spec_from_file_location("tutorials_execute", HERE / "execute.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _texts(cell) -> list[str]:
    """Every text a code cell shows: its streams and its results' text/plain."""
    out = []
    for o in cell.get("outputs", []):
        if o.output_type == "stream":
            out.append(o.text)
        elif o.output_type in ("execute_result", "display_data"):
            out.append(o.data.get("text/plain", ""))
    return out


def _check_outputs(nb, name: str) -> None:
    """At least one figure or view among ``nb``'s outputs; no error, warning or stray repr."""
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert [o for o in outputs if o.output_type in ("display_data", "execute_result")
            and any(k in o.data for k in FIGURES)], f"{name} shows no plot or view"
    assert not [o for o in outputs if o.output_type == "error"]
    assert not [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]  # a frozen bar
    noise = [t for c in nb.cells if c.cell_type == "code" for t in _texts(c) if NOISE.search(t)]
    assert not noise, noise


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
    assert ipynb.exists(), f"{ipynb.name} is missing: run `make notebooks`"
    script, notebook = jupytext.read(path), nbformat.read(ipynb, as_version=4)
    assert _cells(script) == _cells(notebook), f"{ipynb.name} is out of step with {path.name}: make notebooks"
    assert script.cells[0].cell_type == "markdown" and script.cells[0].source.startswith("# ")


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.stem)
def test_committed_notebook_opens_ready(path):
    """Outputs (written by `make notebooks`) and a kernelspec; no error, warning or stray repr in them."""
    notebook = nbformat.read(path.with_suffix(".ipynb"), as_version=4)
    assert notebook.metadata.get("kernelspec", {}).get("name") == "python3", f"{path.stem}.ipynb: no kernelspec"
    _check_outputs(notebook, f"{path.stem}.ipynb (committed without outputs? make notebooks)")


@pytest.mark.tutorial
@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.stem)
def test_tutorial_executes(path, tmp_path):
    pytest.importorskip("ipykernel", reason="ipykernel is a dev dependency (pip install -e .[dev])")
    nb = _execute_module().execute(path, tmp_path)  # raises CellExecutionError with the failing cell's traceback
    nbformat.write(nb, tmp_path / path.with_suffix(".ipynb").name)
    _check_outputs(nb, path.name)
