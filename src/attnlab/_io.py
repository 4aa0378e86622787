"""One way to write a file so that a crash never leaves it half-written."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable, Union

__all__ = ["atomic_write", "atomic_write_text", "read_text_arg", "check_output_file", "check_output_dir"]


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


def read_text_arg(flag: str, path: Union[str, os.PathLike]) -> str:
    """The UTF-8 text of the file a command-line ``flag`` names, with one clear error for each mistake.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a folder, not readable, or not UTF-8 text (the message names ``flag``, the file, and
            where decoding failed).
    """
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {p} is a folder: give a text file")
    if not p.is_file():
        raise FileNotFoundError(f"{flag}: no such file {str(p)!r}")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {p} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ValueError(f"{flag} {p} cannot be read: {e.strerror}") from None


def check_output_file(flag: str, path: Union[str, os.PathLike], *, inputs=()) -> Path:
    """``path`` as a file a command may write: not a folder, inside an existing folder, and not one of the
    command's ``inputs`` (``(flag, path)`` pairs; None paths skipped). Raises ValueError naming both flags."""
    p = Path(path)
    for in_flag, in_path in inputs:
        if in_path is not None and Path(in_path).exists() and Path(in_path).resolve() == p.resolve():
            raise ValueError(f"{flag} {p} is also {in_flag}: the command would write over its own input")
    if p.is_dir():
        raise ValueError(f"{flag} {p} is a folder: give a file name")
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{flag} {p} lies under {parent}, which is a file")
            break
    if not p.parent.is_dir():
        raise ValueError(f"{flag} {p}: no such folder {str(p.parent)!r}")
    if not os.access(p.parent, os.W_OK):
        raise ValueError(f"{flag} {p}: the folder {str(p.parent)!r} is not writable")
    return p


def check_output_dir(flag: str, path: Union[str, os.PathLike]) -> Path:
    """``path`` as a folder a command may create or write into: not a file, not under a file. Raises ValueError."""
    p = Path(path)
    for q in [p, *p.parents]:
        if q.exists():
            if not q.is_dir():
                raise ValueError(f"{flag} {p} " + ("is a file" if q == p else f"lies under {q}, which is a file")
                                 + ": give a folder")
            if not os.access(q, os.W_OK):
                raise ValueError(f"{flag} {p}: {str(q)!r} is not writable")
            break
    return p
