"""Dataset registry: download (from a local HTTP server), sha256 verification and its cache, clear errors,
and the real corpora when the offline copies in $ATTNLAB_DATA_DIR are present."""
import functools
import hashlib
import http.server
import os
import threading
from pathlib import Path

import pytest

from attnlab.data import datasets as ds
from attnlab.data.datasets import (DATASETS, ChecksumError, DatasetSpec, DataUnavailableError, RemoteFile, data_dir,
                                   fetch, load_parallel, load_sentences, load_text)

SHARED = str(data_dir())  # $ATTNLAB_DATA_DIR, else the user cache: where the recipes look
needs_real_data = pytest.mark.skipif(not (Path(SHARED) / "tinyshakespeare" / "input.txt").is_file(),
                                     reason=f"offline copies of the datasets not found in {SHARED}")

GOOD = b"hello attention\n" * 100
BAD = b"not the published file\n"


class _Quiet(http.server.SimpleHTTPRequestHandler):
    requests: list = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        type(self).requests.append(self.path)
        super().do_GET()


@pytest.fixture
def server(tmp_path):
    """A local HTTP server over tmp_path/www holding good.txt and bad.txt; yields its base URL."""
    www = tmp_path / "www"
    www.mkdir()
    (www / "good.txt").write_bytes(GOOD)
    (www / "bad.txt").write_bytes(BAD)
    _Quiet.requests = []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(www)))
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """Point ATTNLAB_DATA_DIR at an empty folder and register dataset 'toy' with the given URL."""
    monkeypatch.setenv("ATTNLAB_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setattr(ds, "_VERIFIED", {})

    def register(url, sha=hashlib.sha256(GOOD).hexdigest()):
        monkeypatch.setitem(DATASETS, "toy", DatasetSpec("toy", (RemoteFile("toy/file.txt", url, sha),)))
        return tmp_path / "data" / "toy" / "file.txt"
    return register


def test_data_dir_env_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNLAB_DATA_DIR", str(tmp_path))
    assert data_dir() == tmp_path
    monkeypatch.delenv("ATTNLAB_DATA_DIR")
    assert data_dir() == Path.home() / ".cache" / "attnlab"


def test_download_verifies_and_caches(server, toy, tmp_path, monkeypatch):
    path = toy(server + "good.txt")
    assert fetch("toy") == tmp_path / "data" / "toy"
    assert path.read_bytes() == GOOD and _Quiet.requests == ["/good.txt"]
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".part")]
    # second call: no request, no hashing (stamp + memo)
    monkeypatch.setattr(ds, "_sha256", lambda p: pytest.fail("hashed a verified file again"))
    fetch("toy")
    monkeypatch.setattr(ds, "_VERIFIED", {})  # a fresh process: the .sha256-ok stamp alone suffices
    fetch("toy")
    assert _Quiet.requests == ["/good.txt"]
    assert (path.parent / ".sha256-ok").is_file()


def test_edited_file_is_rehashed_and_refused(server, toy):
    path = toy(server + "good.txt")
    fetch("toy")
    path.write_bytes(BAD)  # new size and mtime: the stamp no longer applies
    with pytest.raises(ChecksumError, match="expected"):
        fetch("toy")
    assert path.read_bytes() == BAD  # the user's file is left alone


@pytest.mark.parametrize("how", ["in place", "renamed into place"])
@pytest.mark.parametrize("fresh_process", [False, True])
def test_same_size_and_mtime_is_still_rehashed_and_refused(server, toy, monkeypatch, how, fresh_process):
    path = toy(server + "good.txt")
    fetch("toy")
    st = path.stat()
    forged = bytes(GOOD[:-1]) + b"!"  # the same size
    if how == "in place":
        with open(path, "r+b") as f:
            f.write(forged)
    else:
        other = path.with_name("other.txt")
        other.write_bytes(forged)
        os.replace(other, path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the old mtime restored
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    if fresh_process:
        monkeypatch.setattr(ds, "_VERIFIED", {})  # the stamp alone
    with pytest.raises(ChecksumError, match="expected"):
        fetch("toy")


def test_bad_download_is_refused_and_deleted(server, toy):
    path = toy(server + "bad.txt")
    with pytest.raises(ChecksumError, match="refused") as e:
        fetch("toy")
    assert isinstance(e.value, ValueError)
    assert not path.exists() and list(path.parent.iterdir()) == []


def test_offline_is_one_clear_line(toy, tmp_path):
    url = "http://127.0.0.1:9/file.txt"
    toy(url)
    with pytest.raises(DataUnavailableError) as e:
        fetch("toy")
    msg = str(e.value)
    assert isinstance(e.value, FileNotFoundError) and "\n" not in msg
    assert "toy/file.txt" in msg and "ATTNLAB_DATA_DIR" in msg and url in msg
    assert not (tmp_path / "data").exists()  # nothing created when the server does not answer


def test_http_error_is_unavailable(server, toy):
    toy(server + "missing.txt")
    with pytest.raises(DataUnavailableError, match="HTTP 404"):
        fetch("toy")


def test_unknown_dataset_lists_known():
    with pytest.raises(ValueError, match="multi30k.*tinyshakespeare"):
        fetch("wikitext")
    with pytest.raises(ValueError, match="not a single text file"):
        load_text("multi30k")


def test_spec_files_must_sit_in_the_dataset_folder():
    with pytest.raises(ValueError, match="folder"):
        DatasetSpec("a", (RemoteFile("b/x.txt", "http://x", "0" * 64),))


def test_registry_urls_and_licence():
    urls = {f.path: f.url for spec in DATASETS.values() for f in spec.files}
    assert urls["tinyshakespeare/input.txt"].startswith("https://raw.githubusercontent.com/karpathy/char-rnn/")
    assert len([p for p in urls if p.startswith("multi30k/")]) == 6
    assert "non-commercial" in DATASETS["multi30k"].license
    assert all(len(f.sha256) == 64 for spec in DATASETS.values() for f in spec.files)


@needs_real_data
def test_real_tinyshakespeare(monkeypatch):
    monkeypatch.setenv("ATTNLAB_DATA_DIR", SHARED)
    text = load_text()
    assert len(text) == 1_115_394 and text.startswith("First Citizen:")
    assert len(set(text)) == 65


@needs_real_data
def test_real_multi30k(monkeypatch):
    monkeypatch.setenv("ATTNLAB_DATA_DIR", SHARED)
    for split, n in {"train": 29000, "val": 1014, "test_2016_flickr": 1000}.items():
        pairs = load_parallel(split)
        assert len(pairs) == n and all(s == s.strip() and t == t.strip() and s and t for s, t in pairs)
    de_en = load_parallel("val")
    en_de = load_parallel("val", src="en", tgt="de")
    assert [(b, a) for a, b in de_en] == en_de
    assert load_sentences("val", lang="en") == [t for _, t in de_en]
    assert de_en[0][1].startswith("A group of men")


def test_split_and_language_errors():
    with pytest.raises(ValueError, match="train, val, test_2016_flickr"):
        load_parallel("test")
    with pytest.raises(ValueError, match="tgt must be one of de, en"):
        load_parallel("val", tgt="fr")
    with pytest.raises(ValueError, match="differ"):
        load_parallel("val", src="en", tgt="en")


def test_read_only_folder_gets_no_stamp_but_is_verified_once(tmp_path, monkeypatch):
    folder = tmp_path / "ro" / "toy"
    folder.mkdir(parents=True)
    (folder / "file.txt").write_bytes(GOOD)
    folder.chmod(0o555)
    monkeypatch.setenv("ATTNLAB_DATA_DIR", str(tmp_path / "ro"))
    monkeypatch.setattr(ds, "_VERIFIED", {})
    monkeypatch.setitem(DATASETS, "toy", DatasetSpec("toy", (RemoteFile("toy/file.txt", "http://127.0.0.1:9/",
                                                                        hashlib.sha256(GOOD).hexdigest()),)))
    try:
        assert fetch("toy") == folder
        assert sorted(p.name for p in folder.iterdir()) == ["file.txt"]  # the shared copy is left untouched
        monkeypatch.setattr(ds, "_sha256", lambda p: pytest.fail("hashed a verified file again"))
        fetch("toy")  # the in-process memo
    finally:
        folder.chmod(0o755)
