"""How a command reads its inputs and writes its outputs.

- **Writes are atomic** (:func:`atomic_write`): a crash never leaves a file half-written under its final name.
- **Outputs never touch inputs** (:func:`refuse_overlap`, used by :func:`check_output_file` and
  :func:`check_output_dir`): an output may not be an input file (by name, symlink or hard link), lie inside an
  input folder, or be a folder that holds an input. Checked before any work starts, so a refused command
  writes nothing.
- **Reads are bounded** (:func:`read_input`, :func:`check_input_file`): an input must be a regular file (never a
  FIFO that blocks or a device that never ends) no larger than its kind's cap in :data:`READ_LIMITS`.
"""
from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Optional, Union

__all__ = ["atomic_write", "atomic_write_text", "read_text_arg", "check_output_file", "check_output_dir",
           "refuse_overlap", "READ_LIMITS", "check_input_file", "read_input", "read_input_text", "read_input_json",
           "text_lines"]

PathLike = Union[str, os.PathLike]

# The largest file of each kind a command reads, in bytes: generous for every real file of the kind (a config.json
# of 21k labels is ~1 MB; the largest tokenizer.json of a released model ~35 MB), small enough that a mistaken
# path (a disk image, a log) is refused at once instead of filling memory.
READ_LIMITS = {
    "config": 16 << 20,      # config.json, tokenizer_config.json, preprocessor_config.json, a run's manifest
    "tokenizer": 256 << 20,  # tokenizer.json, vocab files
    "text": 1 << 30,         # --hyp, --ref, --file, --corpus, a recipe's data, a run's metrics log
    "image": 256 << 20,      # --image
    "weights": 1 << 40,      # model.safetensors, pytorch_model.bin, ckpt-*.pt (memory-mapped or loaded by torch)
}


def atomic_write(target: Union[str, os.PathLike], write: Callable[[str], None]) -> None:
    """``write(tmp)`` to a temporary file beside ``target``, fsync it, then ``os.replace`` it over ``target``.

    ``os.replace`` is atomic on POSIX: readers see the old file or the new one, never a torn one;
    a process killed mid-write leaves only a ``.<name>.*.tmp`` file that nothing reads. When ``write`` fails,
    the temporary file and the folders made for ``target`` are removed again: a failed write leaves nothing, and
    its OSError (a full disk, a file-size limit) names ``target``.
    """
    target = Path(target)
    made = [p for p in [target.parent, *target.parent.parents] if not p.exists()]  # deepest first
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
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        for folder in made:
            try:
                folder.rmdir()
            except OSError:  # something else was written into it meanwhile: leave it
                break
        if isinstance(e, OSError) and e.errno is not None and e.filename in (None, tmp):
            # a full disk, a file-size limit: name the file the user asked for, not the temporary one
            raise OSError(e.errno, f"{e.strerror} (nothing was written)", str(target)) from None
        raise


def atomic_write_text(target: Union[str, os.PathLike], text: str) -> None:
    """:func:`atomic_write` of a UTF-8 string."""
    atomic_write(target, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def _named(flag: str, path) -> str:
    """How a message names the file: ``--hyp out.txt``, or the path alone when no argument names it."""
    return f"{flag} {path}" if flag else str(path)


def _check_stat(flag: str, p: Path, st: os.stat_result, kind: str) -> None:
    """Refuse what :data:`READ_LIMITS` and a plain read cannot take: a folder, a FIFO/device/socket, a file too big."""
    if stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{_named(flag, p)} is a folder: give a file")
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{_named(flag, p)} is not a regular file (a FIFO, device or socket): give a file")
    cap = READ_LIMITS[kind]
    if st.st_size > cap:
        raise ValueError(f"{_named(flag, p)} holds {st.st_size:,} bytes; a {kind} file may hold at most {cap:,}")


def check_input_file(flag: str, path: PathLike, kind: str) -> Path:
    """``path`` as a file of ``kind`` (a key of :data:`READ_LIMITS`) that a library may open and read: it exists,
    is a regular file (symlinks followed) and is no larger than the kind's cap.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a folder, a FIFO, device or socket, or a file over the cap (naming ``flag`` and the cap).
    """
    if str(path) == "":
        raise ValueError(f"{flag or 'the path'} must name a file, got an empty path")
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise FileNotFoundError(f"{flag + ': ' if flag else ''}no such file {str(p)!r}") from None
    except OSError as e:
        raise ValueError(f"{_named(flag, p)} cannot be read: {e.strerror}") from None
    _check_stat(flag, p, st, kind)
    return p


def read_input(flag: str, path: PathLike, kind: str) -> bytes:
    """The bytes of the file ``flag`` names, read only when it is a regular file within ``kind``'s cap.

    The file is opened without blocking (a FIFO cannot hang the open) and checked on the open descriptor, so a
    path swapped for a device after a check is still refused; at most the cap is read.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a folder, a FIFO, device or socket, a file over the cap, or unreadable.
    """
    if str(path) == "":
        raise ValueError(f"{flag or 'the path'} must name a file, got an empty path")
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FileNotFoundError(f"{flag + ': ' if flag else ''}no such file {str(p)!r}") from None
    except IsADirectoryError:
        raise ValueError(f"{_named(flag, p)} is a folder: give a file") from None
    except OSError as e:
        raise ValueError(f"{_named(flag, p)} cannot be read: {e.strerror}") from None
    try:
        _check_stat(flag, p, os.fstat(fd), kind)
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(READ_LIMITS[kind] + 1)
    except OSError as e:
        raise ValueError(f"{_named(flag, p)} cannot be read: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > READ_LIMITS[kind]:  # grew while it was read
        raise ValueError(f"{_named(flag, p)} holds more than {READ_LIMITS[kind]:,} bytes, the cap of a {kind} file")
    return data


def read_input_text(flag: str, path: PathLike, kind: str = "text") -> str:
    """:func:`read_input` decoded as UTF-8, without the byte-order mark an editor may put first (it is no text).
    Raises ValueError naming ``flag`` and where decoding failed."""
    data = read_input(flag, path, kind)
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise ValueError(f"{_named(flag, path)} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def text_lines(text: str) -> list[str]:
    """The lines of ``text`` as sacreBLEU and a file read line by line see them: split at ``"\n"`` only (a
    ``"\r"`` before it stays on its line), no empty last line after a final ``"\n"``. Unlike ``str.splitlines``,
    a form feed, ``\x85``, ``\u2028`` or a lone ``"\r"`` inside a segment does not split it."""
    lines = text.split("\n")
    return lines[:-1] if lines[-1] == "" else lines


def _unique_keys(pairs: list) -> dict:
    """A JSON object's pairs as a dict, refusing a key given twice (``json`` would keep the last one silently)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {twice!r} in one object: which value is meant is ambiguous")
    return out


def read_input_json(flag: str, path: PathLike, kind: str = "config"):
    """:func:`read_input_text` parsed as JSON: no key twice in one object, nesting no deeper than Python's recursion
    limit. Raises ValueError naming ``flag`` and the parse error."""
    text = read_input_text(flag, path, kind)
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except ValueError as e:
        raise ValueError(f"{_named(flag, path)} is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"{_named(flag, path)} is not valid JSON: nested too deeply") from None


def read_text_arg(flag: str, path: PathLike) -> str:
    """The UTF-8 text of the file a command-line ``flag`` names (:func:`read_input_text`, kind ``text``).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a folder, a FIFO or device, over the cap, not readable, or not UTF-8 text (the message names
            ``flag``, the file, and where decoding failed).
    """
    return read_input_text(flag, path, "text")


def _inode(path: Path) -> Optional[tuple[int, int]]:
    """``(device, inode)`` of an existing file (symlinks followed), else None."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None


def _inodes(path: Path, limit: int = 100_000) -> set[tuple[int, int]]:
    """The ``(device, inode)`` of a file, or of the files in a folder (the first ``limit`` of them): what a hard
    link to an input would share."""
    if not path.is_dir():
        node = _inode(path)
        return set() if node is None else {node}
    found = set()
    for root, _, files in os.walk(path):
        for name in files:
            node = _inode(Path(root) / name)
            if node is not None:
                found.add(node)
            if len(found) >= limit:
                return found
    return found


def refuse_overlap(outputs: Iterable[tuple[str, Optional[PathLike]]],
                   inputs: Iterable[tuple[str, Optional[PathLike]]]) -> None:
    """The one rule for every command that writes: no output may be, or lie inside, or hold, an input.

    ``outputs`` and ``inputs`` are ``(argument, path)`` pairs (None paths skipped; inputs that do not exist are
    skipped). An output is refused when it is an input file (the same name after symlinks, or a hard link to it),
    lies inside an input folder, or is a folder holding an input.

    Raises:
        ValueError: one line naming both arguments.
    """
    ins = []
    for in_flag, in_path in inputs:
        if in_path is None or str(in_path) == "" or not Path(in_path).exists():
            continue
        ins.append((in_flag, Path(in_path), Path(in_path).resolve()))
    for out_flag, out_path in outputs:
        if out_path is None:
            continue
        o = Path(out_path)
        ro = o.resolve()
        node = _inode(o)
        for in_flag, i, ri in ins:
            if ro == ri:
                how = "is"
            elif ri in ro.parents:
                how = "lies inside"
            elif ro in ri.parents:
                how = "is a folder holding"
            elif node is not None and node in _inodes(i):
                how = "is a hard link to " + ("a file of" if i.is_dir() else "")
            else:
                continue
            raise ValueError(f"{out_flag} {o} {how.strip()} {in_flag} {i}: the command would write over its own input; "
                             "choose another path")


def _check_writable(flag: str, p: Path, folder: Path) -> None:
    """Refuse ``p`` when ``folder`` (its nearest existing folder) takes no new file: a file is made there and
    removed again, so a read-only mount, a pseudo file system or a folder without write permission is refused
    however privileged the process is (``os.access`` says yes to root on a read-only folder)."""
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".attnlab-write-test.")
    except OSError as e:
        raise ValueError(f"{flag} {p}: cannot write in {str(folder)!r} ({e.strerror or type(e).__name__})") from None
    os.close(fd)
    os.unlink(probe)


def check_output_file(flag: str, path: PathLike, *, inputs=(), parents: bool = False) -> Path:
    """``path`` as a file a command may write: not a folder, a FIFO or a device (nor a link to one), inside an
    existing writable folder (``parents``: or one the command will make under a writable folder), and clear of
    the command's ``inputs`` (``(flag, path)`` pairs, files or folders: :func:`refuse_overlap`). Raises
    ValueError naming both flags."""
    p = Path(path)
    if str(path) == "":
        raise ValueError(f"{flag} must name a file, got an empty path")
    refuse_overlap([(flag, p)], inputs)
    if p.is_dir():
        raise ValueError(f"{flag} {p} is a folder: give a file name")
    if p.exists() and not p.is_file():
        raise ValueError(f"{flag} {p} is not a regular file (a FIFO, device or socket): give a file name")
    parent = next(q for q in [*p.parents, Path("/")] if q.exists())
    if not parent.is_dir():
        raise ValueError(f"{flag} {p} lies under {parent}, which is a file")
    if parent != p.parent and not parents:
        raise ValueError(f"{flag} {p}: no such folder {str(p.parent)!r}")
    _check_writable(flag, p, parent)
    return p


def check_output_dir(flag: str, path: PathLike, *, inputs=()) -> Path:
    """``path`` as a folder a command may create or write into: not a file, not under a file, clear of the
    command's ``inputs`` (:func:`refuse_overlap`). Raises ValueError."""
    p = Path(path)
    if str(path) == "":
        raise ValueError(f"{flag} must name a folder, got an empty path")
    refuse_overlap([(flag, p)], inputs)
    for q in [p, *p.parents]:
        if q.exists():
            if not q.is_dir():
                raise ValueError(f"{flag} {p} " + ("is a file" if q == p else f"lies under {q}, which is a file")
                                 + ": give a folder")
            _check_writable(flag, p, q)
            break
    return p
