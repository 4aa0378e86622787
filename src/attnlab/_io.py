"""One way to write a file so that a crash never leaves it half-written."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable, Union

__all__ = ["atomic_write", "atomic_write_text"]


def atomic_write(target: Union[str, os.PathLike], write: Callable[[str], None]) -> None:
    """``write(tmp)`` to a temporary file beside ``target``, fsync it, then ``os.replace`` it over ``target``.

    ``os.replace`` is atomic on POSIX: readers see the old file or the new one, never a torn one;
    a process killed mid-write leaves only a ``.<name>.*.tmp`` file that nothing reads.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # the mode a plain open() would give, not mkstemp's 0600
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(target: Union[str, os.PathLike], text: str) -> None:
    """:func:`atomic_write` of a UTF-8 string."""
    atomic_write(target, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
