"""`attnlab demo`: the reversal task, the files it writes, and (slow) the accuracy it promises."""
import json
import subprocess
import sys

import pytest
import torch

from attnlab.data.synthetic import BOS, EOS, PAD, ReverseTask
from attnlab.experiments.demo import run


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
    m = run(out=str(tmp_path), max_steps=30, max_seconds=60, eval_every=10, progress=False)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert 0.0 <= metrics["accuracy"] <= 1.0 and metrics["steps"] == 30
    assert metrics["held_out"] == 1000 and len(metrics["examples"]) == 5
    png = (tmp_path / metrics["cross_attention_png"]).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert m["out"] == str(tmp_path)
    with pytest.raises(ValueError, match="max_steps"):
        run(out=str(tmp_path), max_steps=0)


@pytest.mark.slow
def test_demo_reaches_99_percent_within_two_minutes(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "attnlab", "demo", "--out", str(tmp_path), "--quiet"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["accuracy"] >= 0.99, metrics["history"]
    assert metrics["train_seconds"] <= 120
    assert "held-out exact match" in proc.stdout
