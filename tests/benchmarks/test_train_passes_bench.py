"""Smoke test of ``benchmarks/train_passes.py`` at ``--quick`` sizes: every pass in both dtypes and the training step,
ours and PyTorch's, written to JSON with the machine. No timing assertion: only that every number is there."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _native_isas import needs_native

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "train_passes.py"


@needs_native
def test_quick_run_times_every_pass_and_the_step(tmp_path):
    out = tmp_path / "passes.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.startswith("machine: ")
    data = json.loads(out.read_text())
    assert data["quick"] is True and data["environment"]["capability"]["isa"]
    passes = [(r["pass"], r["dtype"]) for r in data["rows"]]
    for dtype in ("float32", "bfloat16"):
        for name in ("rope fwd+bwd (q)", "swiglu gate fwd+bwd", "gelu fwd+bwd",
                     "causal attention fwd+bwd: fused (ours) vs sdpa"):
            assert (name, dtype) in passes
    assert ("rmsnorm fwd+bwd", "float32") in passes and ("rmsnorm fwd+bwd", "bfloat16") not in passes
    assert ("clip grad norm (0.8 M grads)", "float32") in passes
    assert passes[-1][0] == "default preset's training step (every pass)"
    for r in data["rows"]:
        assert r["ours_ms"] > 0 and r["pytorch_ms"] > 0
        assert r["ratio"] == pytest.approx(r["ours_ms"] / r["pytorch_ms"])
        assert r["pass"] in proc.stdout
