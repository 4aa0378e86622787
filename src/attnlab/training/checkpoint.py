"""Training checkpoints: atomic writes, safe loads, RNG capture, the last K kept.

A checkpoint is one file ``ckpt-<step:08d>.pt`` holding a dict of tensors, dicts, lists, ints,
floats, strings and None only, so :func:`load_checkpoint` can use ``torch.load(weights_only=True)``.
It is written to a temporary file in the same folder (name starting with ``.``), flushed and
fsynced, then renamed over the final name (``os.replace`` is atomic on POSIX): a process killed at
any moment leaves either the previous checkpoints or the new complete one, plus at worst a
temporary file that :func:`latest_checkpoint` ignores.
"""
from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Optional, Union

import torch

from attnlab._checks import int_at_least
from attnlab._io import check_input_file
from attnlab.data.datasets import atomic_write

__all__ = ["checkpoint_path", "list_checkpoints", "latest_checkpoint", "latest_intact_checkpoint", "save_checkpoint",
           "load_checkpoint", "remove_stale_temporaries", "rng_state", "set_rng_state", "atomic_write_bytes"]

PathLike = Union[str, os.PathLike]
_NAME = re.compile(r"ckpt-(\d{8,})\.pt")


def atomic_write_bytes(path: PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically and durably (temp file in the same folder, fsync, rename)."""
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    atomic_write(Path(path), write)


def checkpoint_path(directory: PathLike, step: int) -> Path:
    """``directory / f"ckpt-{step:08d}.pt"``."""
    int_at_least("step", step, 0)
    return Path(directory) / f"ckpt-{step:08d}.pt"


def list_checkpoints(directory: PathLike) -> list[Path]:
    """The complete checkpoints in ``directory``, oldest step first (temporary files are not listed)."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.fullmatch(p.name)) and p.is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(directory: PathLike) -> Optional[Path]:
    """The checkpoint with the highest step in ``directory``, or None if there is none."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


def save_checkpoint(state: dict, directory: PathLike, step: int, *, keep: Optional[int] = None) -> Path:
    """Write ``state`` atomically to ``checkpoint_path(directory, step)``; then delete all but the newest ``keep``.

    Raises:
        ValueError: ``keep`` < 1.
    """
    int_at_least("keep", keep, 1, optional=True)
    path = checkpoint_path(directory, step)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    atomic_write(path, write)
    _fsync_dir(path.parent)
    if keep is not None:
        for old in list_checkpoints(directory)[:-keep]:
            old.unlink(missing_ok=True)
    return path


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_checkpoint(path: PathLike, *, map_location: Union[str, torch.device] = "cpu") -> dict:
    """Read a checkpoint with ``torch.load(weights_only=True)`` (no arbitrary code runs).

    A file that cannot be read that way is reported as unreadable: torch's advice to retry with
    ``weights_only=False`` is never relayed, since running the pickle of an unreadable file is the
    unsafe thing to do.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file is empty, torn or not a checkpoint dict.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    check_input_file("", path, "weights")  # a regular file: torch.load never reads a FIFO or a device
    if path.stat().st_size == 0:
        raise ValueError(f"{path} is not a readable checkpoint: the file is empty")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 — unpickling arbitrary bytes raises anything (IndexError, KeyError, ...)
        raise ValueError(f"{path} is not a readable checkpoint: {_first_safe_line(e)}") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path} is not a checkpoint (expected a dict, got {type(state).__name__})")
    return state


def _first_safe_line(e: BaseException) -> str:
    """The first line of ``e``'s message, unless it is torch's advice to unpickle without ``weights_only``."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    first = lines[0] if lines else type(e).__name__
    if "weights_only" in first or "unsafe" in first.lower():
        return "it holds objects that a safe load (weights_only=True) refuses, or it is torn"
    return first


def latest_intact_checkpoint(directory: PathLike, *, map_location: Union[str, torch.device] = "cpu",
                             warn=None) -> tuple[Optional[Path], Optional[dict]]:
    """The newest checkpoint of ``directory`` that reads, and its state; ``(None, None)`` when there is none.

    Newer files that do not read (empty, torn, not a checkpoint) are skipped with one ``warn(line)``
    each (default: print to stderr), naming the file and the checkpoint used instead.

    Raises:
        ValueError: there are checkpoints but none reads (the message names them).
    """
    import sys

    found = list_checkpoints(directory)
    skipped: list[tuple[Path, str]] = []
    for path in reversed(found):
        try:
            state = load_checkpoint(path, map_location=map_location)
        except ValueError as e:
            skipped.append((path, str(e)))
            continue
        for bad, why in skipped:
            line = f"warning: skipped {bad.name} ({why.split(': ', 1)[-1]}); using {path.name}"
            (warn or (lambda m: print(m, file=sys.stderr)))(line)
        return path, state
    if skipped:
        names = ", ".join(p.name for p, _ in skipped)
        raise ValueError(f"no intact checkpoint in {directory}: {names} cannot be read ({skipped[0][1]})")
    return None, None


def remove_stale_temporaries(directory: PathLike) -> list[Path]:
    """Delete the ``.*.tmp`` files an interrupted atomic write left in ``directory``; return them.

    Only safe while the caller holds the folder's lock (no other writer can be mid-write).
    """
    d = Path(directory)
    if not d.is_dir():
        return []
    stale = [p for p in d.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp") and p.is_file()]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def rng_state() -> dict:
    """Every RNG the training loop draws from: torch CPU, each CUDA device (if initialised), ``random``."""
    version, internal, gauss = random.getstate()
    state = {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore :func:`rng_state`. Raises ValueError if ``state`` lacks the torch or python entry.

    The generator states are byte tensors that must live on the CPU whatever device a checkpoint was loaded onto
    (``map_location="cuda"`` moves them too), so each is brought back with ``.cpu()``.
    """
    if not isinstance(state, dict) or not {"torch", "python"} <= state.keys():
        raise ValueError("rng state must be a dict with 'torch' and 'python' entries (from rng_state())")
    torch.set_rng_state(state["torch"].cpu())
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
