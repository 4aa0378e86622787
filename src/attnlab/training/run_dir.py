"""A training run's folder: ours only when we made it, one writer at a time, nothing written before it is checked.

- **Marked as ours.** A run folder holds ``attnlab-run.json`` (the manifest: recipe, attnlab version, when it
  was created). ``attnlab train`` writes only into a folder that does not exist, is empty, or is one of its
  runs (a folder from before the manifest — ``config.json`` naming a recipe, beside ``ckpt-*.pt`` or
  ``metrics.jsonl`` — counts as a run and gets the manifest); anything else is refused, naming what is there.
- **Not over an input.** ``--out`` may not be, lie inside or hold what the command reads (``--init``, a teacher,
  a base model, a data file).
- **One writer.** :func:`open_run` takes an exclusive ``fcntl.flock`` on ``.attnlab-run.lock`` inside the folder
  and writes the holder's process id into it. A second process is refused at once with that pid; when the
  holder dies the kernel drops the lock, so a stale lock is simply taken over. Under the lock, temporary files
  that a killed write left behind (``.*.tmp``) are removed.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Union

from attnlab._io import atomic_write_text, check_output_dir, read_input_json

__all__ = ["MANIFEST", "LOCK", "check_not_file", "check_out", "is_run", "open_run", "RunLockedError"]

MANIFEST = "attnlab-run.json"
LOCK = ".attnlab-run.lock"
PathLike = Union[str, os.PathLike]


class RunLockedError(ValueError):
    """Another live process is writing into the run folder."""


def is_run(path: Path) -> bool:
    """True when ``path`` holds our manifest or our lock file (a run whose first process was killed, or is still
    starting, before it wrote the manifest), or is a run from before the manifest existed."""
    if (path / MANIFEST).is_file() or (path / LOCK).is_file():
        return True
    try:
        saved = read_input_json("", path / "config.json", "config")
    except (OSError, ValueError):
        return False
    has_run_files = any(path.glob("ckpt-*.pt")) or (path / "metrics.jsonl").is_file()
    return isinstance(saved, dict) and isinstance(saved.get("recipe"), str) and has_run_files


def check_not_file(out: PathLike) -> Path:
    """``out`` as a Path. Raises ValueError when it is a file or lies under one (:func:`attnlab._io.check_output_dir`)."""
    return check_output_dir("--out", out)


def check_out(out: PathLike, *, inputs: Iterable[tuple[str, Optional[PathLike]]] = ()) -> Path:
    """``out`` checked as a run folder to write into; nothing is created.

    Args:
        out: the ``--out`` folder.
        inputs: ``(name, path)`` pairs the command reads (e.g. ``("--set init", "runs/a")``); None paths are
            skipped (:func:`attnlab._io.refuse_overlap`: ``out`` may not be, lie inside or hold any of them).

    Raises:
        ValueError: ``out`` is a file or lies under one; is a non-empty folder that is not a run; is, lies inside
            or holds one of ``inputs``.
    """
    out = check_output_dir("--out", out, inputs=inputs)
    if out.is_dir() and any(out.iterdir()) and not is_run(out):
        names = sorted(p.name for p in out.iterdir())
        shown = ", ".join(names[:6]) + (f", ... ({len(names) - 6} more)" if len(names) > 6 else "")
        raise ValueError(f"--out {out} is a non-empty folder that is not an attnlab run (it holds {shown}; no "
                         f"{MANIFEST}): choose a new or empty folder")
    return out


@contextlib.contextmanager
def open_run(out: Path, *, recipe: str, write: bool = True,
             share: Callable[[Optional[str]], Optional[str]] = lambda refusal: refusal) -> Iterator[Path]:
    """Lock ``out`` for this process (creating it), mark it as ours, clean stale temporaries; yields ``out``.

    With ``write=False`` (ranks other than 0 under torchrun) nothing is created or locked. Under torchrun
    pass ``share=broadcast_object``: every rank calls it once, rank 0 with its refusal (None when it holds
    the lock), so that when rank 0 is refused every rank is refused at once instead of waiting for rank 0
    in the first collective. If this call
    created the folder and the body is refused (ValueError, FileNotFoundError: bad settings, missing data)
    before any checkpoint exists, the files it made are removed again, so a refused run leaves nothing behind.

    Raises:
        RunLockedError: another live process holds the lock (the message names it and its pid).
    """
    if not write:
        refusal = share(None)
        if refusal is not None:
            raise RunLockedError(refusal)
        yield out
        return
    import fcntl

    from attnlab.training.checkpoint import list_checkpoints, remove_stale_temporaries

    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        share(f"--out {out}: cannot create the run folder or its lock ({e.strerror or e})")
        raise
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            refusal = (f"--out {out} is in use by another attnlab process (pid {holder}); wait for it to finish or "
                       "choose another folder")
            share(refusal)
            raise RunLockedError(refusal) from None
        share(None)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        remove_stale_temporaries(out)
        if not (out / MANIFEST).is_file():
            import attnlab

            atomic_write_text(out / MANIFEST, json.dumps({"kind": "attnlab-run", "recipe": recipe,
                                                          "attnlab": attnlab.__version__,
                                                          "created": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
        try:
            yield out
        except (ValueError, FileNotFoundError):  # refused (bad settings, missing data): as if never started
            if created and not list_checkpoints(out):
                _remove_fresh(out)
            raise
    finally:
        os.close(fd)  # releases the flock


def _remove_fresh(out: Path) -> None:
    """Undo a fresh run that failed before its first checkpoint: the files a run writes, then the folder."""
    for name in (MANIFEST, LOCK, "config.json", "tokenizer.json", "metrics.jsonl", "metrics.json", "loss.png"):
        (out / name).unlink(missing_ok=True)
    try:
        out.rmdir()
    except OSError:
        pass  # something else is in there: leave it
