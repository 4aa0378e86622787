"""Never lose a run: validate first and write last, run folders marked as ours and locked, corrupt checkpoints
skipped with a warning, resume refusing what would change the run, and a log that a resume leaves unchanged."""
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from attnlab import cli
from attnlab.training.checkpoint import latest_checkpoint, latest_intact_checkpoint, list_checkpoints, load_checkpoint
from attnlab.training.run_dir import LOCK, MANIFEST

TINY = ["train", "shakespeare-char", "--preset", "tiny", "--quiet", "--threads", "1"]
TRAIN = [sys.executable, "-m", "attnlab", *TINY]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _tree(root: Path) -> dict:
    """Every file under ``root`` -> sha256 of its bytes (what a mistaken command must not change)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _one_line(capsys, *words):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)
    return err


def _train_log(out: Path) -> list[dict]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in ("step", "loss", "lr")} for r in recs if r["kind"] == "train"]


@pytest.fixture
def run(tmp_path, shakespeare):
    out = tmp_path / "run"
    assert cli.main([*TINY, "--out", str(out), "--set", "max_steps=12", "--set", "checkpoint_every=6",
                     "--set", "eval_every=0"]) == 0
    return out


def test_a_refused_run_writes_nothing_and_resume_still_works(run, capsys):
    capsys.readouterr()
    before = _tree(run)
    assert cli.main([*TINY, "--out", str(run), "--set", "n_embd=64"]) == 2  # a new run over an old one
    _one_line(capsys, "already holds checkpoints")
    assert cli.main([*TINY[:2], "--out", str(run), "--resume", "--set", "n_layer=3"]) == 2
    _one_line(capsys, "n_layer=3", "its checkpoint has n_layer=2", "settings a resume may change")
    assert cli.main([*TINY[:2], "--out", str(run), "--resume", "--set", "lr=0.5"]) == 2
    _one_line(capsys, "lr=0.5", "lr=0.01")
    assert _tree(run) == before  # config.json included
    assert cli.main([*TINY[:2], "--out", str(run), "--resume", "--set", "max_steps=18", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "resume: max_steps 12 -> 18" in err
    assert json.loads((run / "metrics.json").read_text())["steps"] == 18


def test_resume_reads_the_settings_from_the_checkpoint_not_config_json(run, capsys):
    (run / "config.json").write_text(json.dumps({"recipe": "shakespeare-char", "preset": "tiny",
                                                 "settings": {"n_embd": 64}}))  # a clobbered file
    assert cli.main([*TINY[:2], "--out", str(run), "--resume", "--set", "max_steps=14", "--quiet"]) == 0
    assert json.loads((run / "config.json").read_text())["settings"]["n_embd"] == 32  # rewritten from the checkpoint


def test_out_that_is_not_ours_is_refused(tmp_path, shakespeare, capsys):
    hf = tmp_path / "hf-model"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "bert"}')
    (hf / "tokenizer.json").write_text("{}")
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    before = _tree(tmp_path)
    for out, words in ((hf, ("not an attnlab run", "config.json, tokenizer.json")), (f, ("is a file",)),
                       (f / "sub", ("lies under",))):
        assert cli.main([*TINY, "--out", str(out)]) == 2
        _one_line(capsys, "--out", *words)
    assert _tree(tmp_path) == before


def test_out_may_not_be_an_input(run, capsys):
    assert cli.main([*TINY, "--out", os.environ["ATTNLAB_DATA_DIR"]]) == 2  # the data folder holds the dataset read
    _one_line(capsys, "--out", "holding dataset tinyshakespeare", "would write over its own input")
    assert cli.main([*TINY, "--out", str(run), "--init", str(run)]) == 2
    _one_line(capsys, "--set init", "would write over its own input")
    assert cli.main([*TINY, "--out", str(run.parent), "--set", f"teacher={run}"]) == 2
    _one_line(capsys, "--set teacher", "would write over its own input")


def test_refused_fresh_run_leaves_no_folder(tmp_path, capsys):
    out = tmp_path / "new"
    assert cli.main([*TINY, "--out", str(out), "--set", "dtype=fp8"]) == 2
    _one_line(capsys, "dtype", "fp8")
    assert cli.main([*TINY, "--out", str(out), "--set", "device=banana"]) == 2
    _one_line(capsys, "device", "banana")
    assert not out.exists()


def test_a_folder_left_with_only_our_lock_is_ours(tmp_path, shakespeare, capsys):
    out = tmp_path / "killed-at-start"  # killed after taking the lock, before writing the manifest
    out.mkdir()
    (out / LOCK).write_text("999999\n")
    assert cli.main([*TINY, "--out", str(out), "--set", "max_steps=2", "--set", "eval_every=0"]) == 0
    assert (out / MANIFEST).is_file() and latest_checkpoint(out).name == "ckpt-00000002.pt"


def test_a_run_from_before_the_manifest_still_resumes(run, capsys):
    (run / MANIFEST).unlink()
    assert cli.main([*TINY[:2], "--out", str(run), "--resume", "--set", "max_steps=14", "--quiet"]) == 0
    assert (run / MANIFEST).is_file()


def test_corrupt_latest_checkpoint_falls_back_with_a_warning(run, capsys):
    ckpts = list_checkpoints(run)
    assert [p.name for p in ckpts] == ["ckpt-00000006.pt", "ckpt-00000012.pt"]
    ckpts[-1].write_bytes(b"")  # empty: used to crash with IndexError inside the error path
    capsys.readouterr()
    assert cli.main(["eval", "--checkpoint", str(run)]) == 0
    err = capsys.readouterr().err
    assert "skipped ckpt-00000012.pt (the file is empty); using ckpt-00000006.pt" in err
    ckpts[-1].write_bytes(b"PK\x03\x04 torn zip")  # torn
    assert cli.main([*TINY[:2], "--out", str(run), "--resume", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "using ckpt-00000006.pt" in err and "weights_only=False" not in err
    assert load_checkpoint(latest_checkpoint(run))["step"] == 12  # trained again from 6


def test_no_intact_checkpoint_is_refused_naming_the_files(run, capsys):
    for p in list_checkpoints(run):
        p.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="no intact checkpoint.*ckpt-00000012.pt, ckpt-00000006.pt"):
        latest_intact_checkpoint(run)
    assert cli.main(["eval", "--checkpoint", str(run)]) == 2
    err = _one_line(capsys, "no intact checkpoint")
    assert "weights_only=False" not in err


def test_eval_of_weights_that_do_not_fit_the_config_is_one_line(run, capsys):
    path = latest_checkpoint(run)
    state = load_checkpoint(path)
    state["model"] = {k: torch.zeros(3) if k.endswith("wte.weight") else v for k, v in state["model"].items()}
    torch.save(state, path)
    assert cli.main(["eval", "--checkpoint", str(run)]) == 2
    _one_line(capsys, "does not fit the model", "wte.weight (3,) vs (")


def test_eval_and_generate_of_integer_weights_for_float_parameters_name_them(run, capsys):
    from attnlab.training.recipes.char_runs import load_run_model

    path = latest_checkpoint(run)
    state = load_checkpoint(path)
    state["model"] = {k: (v * 1e3).to(torch.int32) if k.endswith("wte.weight") else v
                      for k, v in state["model"].items()}
    torch.save(state, path)
    assert cli.main(["eval", "--checkpoint", str(run)]) == 2
    _one_line(capsys, "wte.weight", "stored as torch.int32", "torch.float32")
    with pytest.raises(ValueError, match=r"wte.weight of .* is stored as torch.int32"):
        load_run_model(run)


def test_integer_weights_for_float_parameters_are_refused_by_name():
    from attnlab.training.recipes import load_weights_checked

    model = torch.nn.Linear(3, 2)
    weights = {"weight": model.weight.detach().view(torch.int32), "bias": model.bias.detach()}  # same bytes, I32
    with pytest.raises(ValueError, match=r"weight of ckpt.pt is stored as torch.int32.*torch.float32"):
        load_weights_checked(model, weights, source="ckpt.pt")


def test_stale_temporary_files_are_removed_on_the_next_open(run):
    stale = run / ".ckpt-00000018.pt.abc123.tmp"
    stale.write_bytes(b"\0" * 4096)  # what a kill during a checkpoint write leaves
    assert cli.main([*TINY[:2], "--out", str(run), "--resume", "--set", "max_steps=13", "--quiet"]) == 0
    assert not stale.exists()


def test_the_log_after_a_resume_equals_the_uninterrupted_log(tmp_path, shakespeare):
    """checkpoint_every=7 is not a multiple of log_every=5: a resume from step 7 must still log the mean
    over steps 6-10 at step 10, as the uninterrupted run does."""
    import shutil

    common = ["--set", "log_every=5", "--set", "eval_every=0", "--set", "checkpoint_every=7",
              "--set", "keep_checkpoints=5", "--set", "max_steps=20"]
    ref, res = tmp_path / "ref", tmp_path / "res"
    assert cli.main([*TINY, "--out", str(ref), *common]) == 0
    shutil.copytree(ref, res)
    for p in list_checkpoints(res)[1:]:
        p.unlink()  # as if killed after step 7's checkpoint: the log still runs to step 20
    assert [p.name for p in list_checkpoints(res)] == ["ckpt-00000007.pt"]
    assert cli.main([*TINY[:2], "--out", str(res), "--resume", "--quiet"]) == 0
    assert _train_log(res) == _train_log(ref)
    assert [r["step"] for r in _train_log(res)] == [5, 10, 15, 20]


def _spawn(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([*TRAIN, "--out", str(out), *extra], env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def test_two_processes_on_one_out(tmp_path, shakespeare):
    out = tmp_path / "shared"
    # the first runs until it is killed below: the second must find it alive however fast either starts
    first = _spawn(out, "--set", "max_steps=1000000", "--set", "eval_every=0", "--set", "checkpoint_every=100")
    deadline = time.monotonic() + 60
    while not (out / LOCK).is_file() or not (out / LOCK).read_text().strip():
        assert time.monotonic() < deadline and first.poll() is None
        time.sleep(0.05)
    second = subprocess.run([*TRAIN, "--out", str(out), "--resume"], env=_env(), capture_output=True, text=True,
                            timeout=120)
    assert second.returncode == 2
    assert second.stderr.count("\n") == 1 and f"pid {first.pid}" in second.stderr and str(out) in second.stderr
    first.send_signal(signal.SIGKILL)  # a dead holder: the kernel drops its lock
    first.wait(timeout=30)
    third = subprocess.run([*TRAIN, "--out", str(out), "--resume", "--set", "max_steps=5"], env=_env(),
                           capture_output=True, text=True, timeout=120)
    assert third.returncode == 0, third.stderr


def _newest_step(out: Path) -> int:
    steps = [int(p.stem.split("-")[1]) for p in list_checkpoints(out)]
    return max(steps, default=0)


def _kill_and_resume(tmp_path, *, kills: int, max_steps: int):
    """An uninterrupted run, and the same run killed ``kills`` times at random moments (checkpoints every 3
    steps, so many kills land in a checkpoint write) and resumed: the same weights, bit for bit, and the same log.
    Each kill is placed by the run's progress, not the clock (a faster machine or build would otherwise finish
    before it): once the newest checkpoint reaches a random step past the last kill's, a random few ms later."""
    settings = ["--set", f"max_steps={max_steps}", "--set", "checkpoint_every=3", "--set", "eval_every=20",
                "--set", "log_every=5", "--set", "keep_checkpoints=2"]
    ref, out = tmp_path / "ref", tmp_path / "killed"
    subprocess.run([*TRAIN, "--out", str(ref), *settings], check=True, env=_env(), timeout=300, capture_output=True)
    rng = random.Random(0)
    killed, target = 0, 0
    for attempt in range(kills):
        proc = _spawn(out, *settings, *(["--resume"] if attempt or out.exists() else []))
        target = max(target, _newest_step(out)) + rng.randrange(3, max(4, max_steps // (2 * kills)))
        deadline = time.monotonic() + 120
        while proc.poll() is None and _newest_step(out) < target and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.03))  # into the next steps, or the next checkpoint's write
        if proc.poll() is None:
            proc.kill()
            killed += 1
        proc.wait(timeout=60)
        for path in list_checkpoints(out):  # never a torn ckpt-*.pt, whatever the moment
            assert load_checkpoint(path)["step"] == int(path.stem.split("-")[1])
    subprocess.run([*TRAIN, "--out", str(out), "--resume", *settings], check=True, env=_env(), timeout=300,
                   capture_output=True)
    assert killed >= 1
    w_ref, w_res = (load_checkpoint(latest_checkpoint(d))["model"] for d in (ref, out))
    assert all(torch.equal(w_ref[k], w_res[k]) for k in w_ref)
    assert _train_log(out) == _train_log(ref)
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_killed_and_resumed_equals_uninterrupted_quick(tmp_path, shakespeare):
    _kill_and_resume(tmp_path, kills=2, max_steps=300)


@pytest.mark.slow
def test_killed_many_times_and_resumed_equals_uninterrupted(tmp_path, shakespeare):
    _kill_and_resume(tmp_path, kills=10, max_steps=1500)


def test_help_lists_every_setting_a_resume_may_change():
    from attnlab.training.cli import EPILOG as TRAIN_HELP
    from attnlab.training.recipes import RESUME_SETTINGS

    assert all(k in TRAIN_HELP for k in RESUME_SETTINGS)


def test_a_locked_out_refuses_every_torchrun_rank_at_once(tmp_path, shakespeare):
    """Under torchrun only rank 0 takes the lock; when it is refused, the other rank is told so (a broadcast)
    instead of waiting for rank 0 in the first collective: the launch ends with the holder's pid, no hang."""
    import fcntl

    out = tmp_path / "held"
    out.mkdir()
    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                              *TRAIN[1:], "--out", str(out), "--set", "max_steps=5"], env=_env(), capture_output=True,
                             text=True, timeout=240)  # a deadlock would end here with TimeoutExpired
    finally:
        os.close(fd)
    assert run.returncode != 0
    refusals = [ln for ln in run.stderr.splitlines() if f"is in use by another attnlab process (pid {os.getpid()})" in ln]
    # rank 0's line, and rank 1's unless torchrun stopped rank 1 first (it stops the others when one fails)
    assert 1 <= len(refusals) <= 2, run.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == [LOCK]  # nothing written


def test_eval_of_one_checkpoint_file_uses_its_run(run, capsys):
    capsys.readouterr()
    assert cli.main(["eval", "--checkpoint", str(run / "ckpt-00000006.pt")]) == 0
    assert "ckpt-00000006.pt" in capsys.readouterr().out
    assert cli.main(["eval", "--checkpoint", str(run / "config.json")]) == 2
    _one_line(capsys, "is a file: give a run's output folder or one of its ckpt-*.pt")
