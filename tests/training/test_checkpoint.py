"""Atomic checkpoints: safe loading, latest-of, keep-K, leftover temp files ignored, RNG round trip."""
import random

import pytest
import torch

from attnlab.training.checkpoint import (checkpoint_path, latest_checkpoint, list_checkpoints, load_checkpoint,
                                         rng_state, save_checkpoint, set_rng_state)


def test_round_trip_is_weights_only_loadable(tmp_path):
    state = {"step": 3, "w": torch.arange(4.0), "nested": {"lst": [1, 2.5, "x", None], "t": (1, 2)}}
    path = save_checkpoint(state, tmp_path, 3)
    assert path == tmp_path / "ckpt-00000003.pt" == checkpoint_path(tmp_path, 3)
    back = torch.load(path, weights_only=True)  # what load_checkpoint does: no arbitrary code
    assert torch.equal(back["w"], state["w"]) and back["nested"] == state["nested"]
    assert load_checkpoint(path)["step"] == 3


def test_latest_ignores_leftover_temp_files_and_strangers(tmp_path):
    save_checkpoint({"step": 5}, tmp_path, 5)
    save_checkpoint({"step": 20}, tmp_path, 20)
    # a writer killed mid-write leaves only its temp file (".<name>.<random>.tmp"), never a partial ckpt-*.pt
    (tmp_path / ".ckpt-00000030.pt.abc123.tmp").write_bytes(b"\x80\x02trunc")
    (tmp_path / "ckpt-00000040.pt.bak").write_bytes(b"junk")
    (tmp_path / "notes.txt").write_text("hi")
    assert latest_checkpoint(tmp_path) == tmp_path / "ckpt-00000020.pt"
    assert load_checkpoint(latest_checkpoint(tmp_path))["step"] == 20
    assert latest_checkpoint(tmp_path / "missing") is None


def test_failed_write_leaves_previous_checkpoints_intact(tmp_path):
    save_checkpoint({"step": 1, "w": torch.ones(3)}, tmp_path, 1)

    class Boom:
        def __reduce__(self):
            raise RuntimeError("disk full")  # fails half-way through torch.save

    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint({"step": 2, "w": torch.ones(1000), "bad": Boom()}, tmp_path, 2)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-00000001.pt"]  # no partial file, no temp file
    assert latest_checkpoint(tmp_path).name == "ckpt-00000001.pt"


def test_keep_last_k(tmp_path):
    for step in (1, 2, 3, 10, 11):
        save_checkpoint({"step": step}, tmp_path, step, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000010.pt", "ckpt-00000011.pt"]
    with pytest.raises(ValueError, match="keep"):
        save_checkpoint({}, tmp_path, 12, keep=0)


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint(tmp_path / "ckpt-00000001.pt")
    bad = tmp_path / "ckpt-00000001.pt"
    bad.write_bytes(b"not a zip file")
    with pytest.raises(ValueError, match="not a readable checkpoint"):
        load_checkpoint(bad)
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="expected a dict"):
        load_checkpoint(tmp_path / "list.pt")


def test_unsafe_pickle_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    path = tmp_path / "ckpt-00000001.pt"
    torch.save({"x": Evil()}, path)
    with pytest.raises(ValueError, match="not a readable checkpoint"):
        load_checkpoint(path)


def test_rng_round_trip_survives_weights_only(tmp_path):
    torch.manual_seed(1)
    random.seed(2)
    save_checkpoint({"rng": rng_state()}, tmp_path, 0)
    a = (torch.rand(3), random.random())
    set_rng_state(load_checkpoint(checkpoint_path(tmp_path, 0))["rng"])
    b = (torch.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and a[1] == b[1]
    with pytest.raises(ValueError, match="rng state"):
        set_rng_state({"torch": torch.get_rng_state()})
