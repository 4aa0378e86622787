"""Run the tutorials and write their notebooks with outputs: ``make notebooks``.

Each ``NN_name.py`` beside this file (a jupytext percent script, the source) is executed from top to bottom in a
fresh ipykernel (nbclient) inside a scratch folder, so the files a tutorial writes stay out of the repository, and
the executed notebook — every cell's outputs and figures (less the progress bars, which are for a running cell), a
``python3`` kernelspec, the repository's and the home folder written ``.`` and ``~`` — is written to
``NN_name.ipynb`` beside it. By default at the sizes the tests use (``ATTNLAB_TUTORIAL_QUICK=1``: minutes for all
seven); ``--full`` at the tutorials' real sizes (much longer). The tests execute the tutorials with the same
:func:`execute`.

    python docs/tutorials/execute.py [--full] [docs/tutorials/NN_name.py ...]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TUTORIALS = sorted(HERE.glob("[0-9][0-9]_*.py"))
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


def execute(path: Path, workdir: Path, *, quick: bool = True, timeout: int = 600):
    """The tutorial ``path`` executed in ``workdir`` in a fresh python3 kernel: an nbformat notebook with every
    cell's outputs and a kernelspec. ``quick``: at the tests' tiny sizes (``ATTNLAB_TUTORIAL_QUICK=1``).

    Raises:
        nbclient.exceptions.CellExecutionError: a cell failed (its traceback in the message).
    """
    import jupytext
    import nbclient

    env = {"ATTNLAB_TUTORIAL_QUICK": "1" if quick else "0",
           "MPLBACKEND": "module://matplotlib_inline.backend_inline"}  # figures inline, as in Jupyter
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        nb = jupytext.read(path)
        nb.metadata["kernelspec"] = dict(KERNELSPEC)
        nb.metadata["language_info"] = {"name": "python"}
        nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                                resources={"metadata": {"path": str(workdir)}}).execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    _drop_progress_bars(nb)
    _portable_paths(nb)
    return nb


def _portable_paths(nb) -> None:
    """The repository's folder written ``.`` and the home folder ``~`` in ``nb``'s text outputs (``attnlab from
    ./src/attnlab``): a committed notebook names no folder of the machine that ran it."""
    places = ((str(HERE.parents[1]), "."), (str(Path.home()), "~"))

    def portable(text: str) -> str:
        for path, name in places:
            text = text.replace(path + "/", name + "/")
        return text

    for cell in nb.cells:
        for o in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if o.output_type == "stream":
                o.text = portable(o.text)
            elif "text/plain" in o.get("data", {}):
                o.data["text/plain"] = portable(o.data["text/plain"])


def _drop_progress_bars(nb) -> None:
    """Remove the progress bars' widgets from ``nb``'s outputs: they show progress while a cell runs; saved, they
    would be frozen at their first frame (0 %)."""
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs
                            if "application/vnd.jupyter.widget-view+json" not in o.get("data", {})]


def main(argv=None) -> int:
    import nbformat

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="*", type=Path, help="tutorials to run (default: all)")
    p.add_argument("--full", action="store_true", help="the tutorials' real sizes, not the tests' tiny ones")
    args = p.parse_args(argv)
    for path in args.paths or TUTORIALS:
        path = path.resolve()
        if path not in TUTORIALS:
            p.error(f"{path} is not one of the tutorials: {', '.join(t.name for t in TUTORIALS)}")
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"attnlab-{path.stem}-") as work:
            nb = execute(path, Path(work), quick=not args.full)
        nbformat.write(nb, path.with_suffix(".ipynb"))
        print(f"{path.with_suffix('.ipynb').name}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
