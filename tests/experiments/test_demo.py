"""`attnlab demo`: the reversal task, the files it writes, and (slow) the accuracy it promises."""
import json
import subprocess
import sys
import time

import pytest
import torch

from attnlab.data.synthetic import BOS, EOS, PAD, ReverseTask
from attnlab.cli import main
from attnlab.experiments.demo import demo_config, exact_match, run, teacher_forced_exact
from attnlab.models.transformer import Seq2SeqTransformer


def test_reverse_task_targets_and_held_out_split():
    task = ReverseTask(held_out=200, seed=3)
    src, tgt = task.train_batch(64, torch.Generator().manual_seed(0))
    for s, t in zip(src.tolist(), tgt.tolist()):
        s = [x for x in s if x != PAD]
        assert t[0] == BOS and t[len(s) + 1] == EOS
        assert t[1:len(s) + 1] == s[::-1]
        assert tuple(s) not in task._test_keys
        assert task.min_len <= len(s) <= task.max_len
    assert task.to_text([3, 4, 12, EOS, 5]) == "019"
    with pytest.raises(ValueError, match="min_len"):
        ReverseTask(min_len=5, max_len=4)


def test_short_run_writes_metrics_and_heatmap(tmp_path):
    m = run(out=str(tmp_path), max_steps=30, eval_every=10, progress=False)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert 0.0 <= metrics["accuracy"] <= 1.0 and metrics["steps"] == 30
    assert metrics["held_out"] == 1000 and len(metrics["examples"]) == 5
    png = (tmp_path / metrics["cross_attention_png"]).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert m["out"] == str(tmp_path)
    with pytest.raises(ValueError, match="max_steps"):
        run(out=str(tmp_path), max_steps=0)


def test_teacher_forced_exact_match_equals_greedy_exact_match(tmp_path):
    """The loop's cheap check (one forward pass) counts exactly the strings greedy decoding gets right."""
    task = ReverseTask(held_out=300, seed=1)
    for steps in (60, 200):  # a poor model and a better one: both checks must agree string by string
        torch.manual_seed(0)
        model = Seq2SeqTransformer(demo_config(task.vocab_size))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(0)
        for _ in range(steps):
            src, tgt = task.train_batch(64, g)
            logits = model(src, tgt[:, :-1], src_key_padding_mask=src == PAD, tgt_key_padding_mask=tgt[:, :-1] == PAD)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt[:, 1:].reshape(-1),
                                                     ignore_index=PAD)
            opt.zero_grad()
            loss.backward()
            opt.step()
        greedy, _ = exact_match(model, task, task.test_src)
        assert teacher_forced_exact(model, task, task.test_src) == greedy


def test_the_step_budget_not_the_clock_decides_the_model(tmp_path, monkeypatch):
    """A machine whose clock runs 1,000x faster (as if every step took minutes) trains the same model."""
    a = run(out=str(tmp_path / "a"), max_steps=40, eval_every=20, progress=False)
    real = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: real() * 1000.0)
    b = run(out=str(tmp_path / "b"), max_steps=40, eval_every=20, progress=False)
    assert (a["steps"], a["accuracy"], a["final_loss"], a["history"]) == (b["steps"], b["accuracy"], b["final_loss"],
                                                                           b["history"])


def test_out_is_checked_before_training(tmp_path, capsys):
    f = tmp_path / "file.txt"
    f.write_text("keep me")
    other = tmp_path / "model"
    other.mkdir()
    (other / "config.json").write_text("{}")
    for out, words in ((f, "is a file"), (f / "sub", "is a file"), (other, "not a demo output")):
        assert main(["demo", "--out", str(out), "--max-steps", "1"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--out" in err and words in err and "Traceback" not in err
    assert f.read_text() == "keep me" and sorted(p.name for p in other.iterdir()) == ["config.json"]
    # a previous demo output may be written again
    assert main(["demo", "--out", str(tmp_path / "d"), "--max-steps", "2", "--quiet"]) == 0
    assert main(["demo", "--out", str(tmp_path / "d"), "--max-steps", "2", "--quiet"]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_demo_reaches_99_percent(tmp_path, seed):
    proc = subprocess.run([sys.executable, "-m", "attnlab", "demo", "--out", str(tmp_path), "--quiet",
                           "--seed", str(seed)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["accuracy"] >= 0.99, metrics["history"]
    assert metrics["steps"] <= metrics["max_steps"] == 800
    assert "held-out exact match" in proc.stdout
