"""Real datasets: a registry of public files, downloaded on first use, verified by sha256, cached.

Files live under :func:`data_dir` (``$ATTNLAB_DATA_DIR``, else ``~/.cache/attnlab``) with the same
relative paths as in the registry (``tinyshakespeare/input.txt``, ``multi30k/train.de.gz``, ...).
:func:`fetch` makes sure every file of a dataset is present and has the registered sha256:

- a present file is hashed once; the verdict is cached in a ``.sha256-ok`` stamp beside it, keyed on
  the file's size, mtime, ctime and inode, so later calls are instant and a file changed in any of them (an
  edit, even one that restores size and mtime, or another file renamed into place) is hashed again;
- a missing file is downloaded with ``urllib`` to a temporary file, verified, then renamed into place;
- no network -> :class:`DataUnavailableError` (a ``FileNotFoundError``) whose one-line message names
  the file, ``ATTNLAB_DATA_DIR`` and the URL;
- a wrong sha256 -> :class:`ChecksumError` (a ``ValueError``): the file is refused. A bad download is
  deleted; a file that was already there is left alone (it is the user's).

Datasets:

- ``tinyshakespeare`` — Karpathy's char-rnn corpus (1,115,394 characters of Shakespeare, public
  domain text).
- ``multi30k`` — Multi30k task 1, German–English image descriptions (Elliott et al., 2016,
  https://github.com/multi30k/dataset): 29,000 train / 1,014 val / 1,000 test_2016_flickr sentence
  pairs. Its terms allow **non-commercial research and educational use only**.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import stat
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from attnlab._io import atomic_write, read_input_text

__all__ = ["RemoteFile", "DatasetSpec", "DATASETS", "DataUnavailableError", "ChecksumError", "data_dir",
           "fetch", "load_text", "load_parallel", "load_sentences", "MULTI30K_SPLITS", "MULTI30K_LANGS",
           "atomic_write", "dataset_files"]

ENV_VAR = "ATTNLAB_DATA_DIR"
STAMP_NAME = ".sha256-ok"
_CHUNK = 1 << 20


class DataUnavailableError(FileNotFoundError):
    """A dataset file is not on disk and could not be downloaded."""


class ChecksumError(ValueError):
    """A dataset file's sha256 is not the registered one; the file is refused."""


@dataclass(frozen=True)
class RemoteFile:
    """One file of a dataset: ``path`` relative to :func:`data_dir`, its public ``url`` and ``sha256``."""

    path: str
    url: str
    sha256: str


@dataclass(frozen=True)
class DatasetSpec:
    """A named dataset: its files (all in the folder ``data_dir()/name``), licence and notes."""

    name: str
    files: tuple[RemoteFile, ...]
    license: str = ""
    notes: str = ""

    def __post_init__(self):
        for f in self.files:
            if Path(f.path).parent != Path(self.name):
                raise ValueError(f"file {f.path!r} of dataset {self.name!r} must lie in folder {self.name!r}/")


_M30K = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/"
_M30K_SHA = {
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
}
MULTI30K_SPLITS = {"train": 29000, "val": 1014, "test_2016_flickr": 1000}  # split -> sentence pairs
MULTI30K_LANGS = ("de", "en")

DATASETS: dict[str, DatasetSpec] = {
    "tinyshakespeare": DatasetSpec(
        name="tinyshakespeare",
        files=(RemoteFile(
            "tinyshakespeare/input.txt",
            "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
            "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"),),
        license="public-domain text (Shakespeare), collected by Andrej Karpathy for char-rnn",
        notes="1,115,394 characters; 65 distinct characters",
    ),
    "multi30k": DatasetSpec(
        name="multi30k",
        files=tuple(RemoteFile(f"multi30k/{fn}", _M30K + fn, sha) for fn, sha in _M30K_SHA.items()),
        license="Multi30k (Elliott et al., 2016): non-commercial research and educational use only",
        notes="task 1 raw de/en: 29,000 train / 1,014 val / 1,000 test_2016_flickr sentence pairs",
    ),
}


def data_dir() -> Path:
    """Where datasets live: ``$ATTNLAB_DATA_DIR`` if set (and non-empty), else ``~/.cache/attnlab``."""
    env = os.environ.get(ENV_VAR, "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "attnlab"


def dataset_files() -> list[tuple[str, Path]]:
    """``("dataset NAME", path)`` of every dataset file under :func:`data_dir`: what a recipe may read, so that
    no command writes over one (:func:`attnlab._io.refuse_overlap`)."""
    return [(f"dataset {spec.name}", data_dir() / f.path) for spec in DATASETS.values() for f in spec.files]


def _spec(name: str) -> DatasetSpec:
    if not isinstance(name, str) or name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(sorted(DATASETS))}")
    return DATASETS[name]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


# In-process memo of verified files, {(abs path, size, mtime_ns, ctime_ns, inode): sha256}: instant even where no
# stamp can be written (a read-only data folder).
_VERIFIED: dict[tuple[str, int, int, int, int], str] = {}
_STAT_FIELDS = ("size", "mtime_ns", "ctime_ns", "inode")  # what the stamp keeps of a file: any change, a new hash


def _key(path: Path) -> tuple[str, int, int, int, int]:
    st = path.stat()
    return str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def _read_stamp(folder: Path) -> dict:
    try:
        data = json.loads((folder / STAMP_NAME).read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_stamp(folder: Path, filename: str, key: tuple, sha: str) -> None:
    """Record a verified file; silently skipped where the folder is read-only (mode or permissions)."""
    try:
        if not folder.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
            return
        stamp = _read_stamp(folder)
        stamp[filename] = {**dict(zip(_STAT_FIELDS, key[1:])), "sha256": sha}
        text = json.dumps(stamp, indent=1, sort_keys=True) + "\n"
        atomic_write(folder / STAMP_NAME, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    except OSError:
        pass


def _verify_present(path: Path, rf: RemoteFile) -> None:
    key = _key(path)
    if _VERIFIED.get(key) == rf.sha256:
        return
    entry = _read_stamp(path.parent).get(path.name)
    if entry == {**dict(zip(_STAT_FIELDS, key[1:])), "sha256": rf.sha256}:
        _VERIFIED[key] = rf.sha256
        return
    got = _sha256(path)
    if got != rf.sha256:
        raise ChecksumError(f"{path} has sha256 {got}, expected {rf.sha256}: refusing it (it is not the file "
                            f"published at {rf.url}; move it away to download a fresh copy, or point "
                            f"{ENV_VAR} elsewhere)")
    _VERIFIED[key] = rf.sha256
    _write_stamp(path.parent, path.name, key, rf.sha256)


def _unavailable(path: Path, rf: RemoteFile, reason) -> DataUnavailableError:
    return DataUnavailableError(f"{rf.path} is not in {path.parent.parent} and could not be downloaded from {rf.url} "
                                f"({reason}); set {ENV_VAR} to a folder that holds {rf.path}")


def _download(path: Path, rf: RemoteFile, timeout: float = 60.0) -> None:
    """Stream ``rf.url`` into a temp file beside ``path`` while hashing it; rename it into place if the sha256 matches.

    Nothing is created on disk unless the server answers.
    """
    from attnlab._runtime import progress_bar as tqdm

    try:
        resp = urllib.request.urlopen(rf.url, timeout=timeout)
    except urllib.error.HTTPError as e:
        raise _unavailable(path, rf, f"HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise _unavailable(path, rf, getattr(e, "reason", None) or e) from None
    with resp:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
        except OSError as e:
            raise DataUnavailableError(f"cannot write {rf.path} into {path.parent.parent} ({e.strerror}); set "
                                       f"{ENV_VAR} to a writable folder") from None
        h = hashlib.sha256()
        total = int(resp.headers.get("Content-Length") or 0) or None
        try:
            with os.fdopen(fd, "wb") as out, tqdm(total=total, unit="B", unit_scale=True, desc=f"download {rf.path}",
                                                  disable=None, leave=False) as bar:
                while True:
                    try:
                        chunk = resp.read(_CHUNK)
                    except OSError as e:  # connection lost mid-way
                        raise _unavailable(path, rf, e) from None
                    if not chunk:
                        break
                    out.write(chunk)
                    h.update(chunk)
                    bar.update(len(chunk))
            got = h.hexdigest()
            if got != rf.sha256:
                raise ChecksumError(f"download of {rf.url} has sha256 {got}, expected {rf.sha256}: refused and "
                                    f"deleted")
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    key = _key(path)
    _VERIFIED[key] = rf.sha256
    _write_stamp(path.parent, path.name, key, rf.sha256)


def fetch(name: str) -> Path:
    """Make sure every file of dataset ``name`` is present and verified; return its folder.

    Args:
        name: a key of :data:`DATASETS` (``"tinyshakespeare"``, ``"multi30k"``).

    Returns:
        ``data_dir() / name``, holding the dataset's files.

    Raises:
        ValueError: ``name`` is not a registered dataset (the message lists the known ones).
        DataUnavailableError: a file is missing and could not be downloaded (one line: file, URL,
            ``ATTNLAB_DATA_DIR``).
        ChecksumError: a file's sha256 differs from the registered one.
    """
    spec = _spec(name)
    root = data_dir()
    for rf in spec.files:
        path = root / rf.path
        if path.is_file():
            _verify_present(path, rf)
        else:
            _download(path, rf)
    return root / spec.name


def load_text(name: str = "tinyshakespeare") -> str:
    """The whole text of a single-file text dataset (UTF-8), fetched and verified first.

    Raises:
        ValueError: unknown dataset, or one that is not a single text file (use :func:`load_parallel`).
    """
    spec = _spec(name)
    if len(spec.files) != 1 or spec.files[0].path.endswith(".gz"):
        raise ValueError(f"dataset {name!r} is not a single text file; use load_parallel/load_sentences for it")
    fetch(name)
    return read_input_text("", data_dir() / spec.files[0].path, "text")


def _check_split_lang(split: str, langs: dict[str, str]) -> None:
    if split not in MULTI30K_SPLITS:
        raise ValueError(f"split must be one of {', '.join(MULTI30K_SPLITS)}, got {split!r}")
    for arg, lang in langs.items():
        if lang not in MULTI30K_LANGS:
            raise ValueError(f"{arg} must be one of {', '.join(MULTI30K_LANGS)}, got {lang!r}")


def _read_lines(split: str, lang: str) -> list[str]:
    folder = fetch("multi30k")
    with gzip.open(folder / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
        lines = [line.strip() for line in f]
    if len(lines) != MULTI30K_SPLITS[split]:
        raise ValueError(f"multi30k {split}.{lang} has {len(lines)} lines, expected {MULTI30K_SPLITS[split]}")
    return lines


def load_sentences(split: str, *, lang: str = "en") -> list[str]:
    """One side of a Multi30k split (``"train"``, ``"val"``, ``"test_2016_flickr"``), lines stripped.

    Raises:
        ValueError: unknown split or language (the message lists the valid ones).
    """
    _check_split_lang(split, {"lang": lang})
    return _read_lines(split, lang)


def load_parallel(split: str, *, src: str = "de", tgt: str = "en") -> list[tuple[str, str]]:
    """Multi30k sentence pairs ``[(src_sentence, tgt_sentence), ...]`` of one split, lines stripped.

    Splits: ``"train"`` (29,000 pairs), ``"val"`` (1,014), ``"test_2016_flickr"`` (1,000).
    Languages: ``"de"``, ``"en"``. Multi30k is for non-commercial research and educational use.

    Raises:
        ValueError: unknown split or language (listing the valid ones), or ``src == tgt``.
        DataUnavailableError, ChecksumError: as :func:`fetch`.
    """
    _check_split_lang(split, {"src": src, "tgt": tgt})
    if src == tgt:
        raise ValueError(f"src and tgt must differ, both are {src!r}")
    return list(zip(_read_lines(split, src), _read_lines(split, tgt)))
