"""Smoke test of ``benchmarks/attention.py``: both suites run at ``--quick`` sizes and write JSON of
the documented shape. No timing assertions: only that every number is there and positive."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "attention.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    """Run ``--suite all --quick --threads 1`` once; the two JSON files it writes."""
    out = tmp_path_factory.mktemp("bench")
    paths = {"basic": out / "basic.json", "efficient": out / "efficient.json"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--suite", "all", "--quick", "--threads", "1",
                           "--out", str(paths["basic"]), "--out-efficient", str(paths["efficient"])],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "targets met:" in proc.stdout
    return {name: json.loads(p.read_text()) for name, p in paths.items()}


def test_basic_suite(results):
    data = results["basic"]
    assert {"environment", "max_overhead", "within_5_percent", "torch_mha_fast_path", "rows"} <= data.keys()
    assert data["environment"]["threads"] == 1
    cases = {(r["case"], r["N"]) for r in data["rows"]}
    assert cases == {("dense", 512), ("causal", 512), ("dense", 1024), ("causal", 1024),
                     ("mha eval no_grad", 256), ("mha train fwd+bwd", 256)}
    for r in data["rows"]:
        assert r["ours_ms"] > 0 and r["peer_ms"] > 0 and r["repeat"] >= 1
        assert r["ratio"] == pytest.approx(r["ours_ms"] / r["peer_ms"])


def test_efficient_suite(results):
    data = results["efficient"]
    assert data["quick"] is True and data["window"] == 256
    rows = {r["case"]: r for r in data["rows"] if r["case"] != "window fwd"}
    assert [r["N"] for r in data["rows"] if r["case"] == "window fwd"] == [256, 512]
    assert set(rows) == {"window fwd+bwd", "window 2N/N", "causal tiled", "under load", "alibi causal", "document",
                         "bigbird", "weights 4 rows"}
    keys = {"case", "N", "ours_ms", "peer_ms", "ratio", "ours_mib", "peer_mib", "target", "met", "repeat"}
    for r in data["rows"]:
        assert keys <= r.keys()
        assert r["ours_ms"] > 0 and r["repeat"] >= 1
        if r["peer_ms"] is not None:  # a compared row
            assert r["ratio"] > 0 and r["ratio"] == pytest.approx(r["ours_ms"] / r["peer_ms"])
        assert r["met"] in (None, "yes", "no")
    # memory of both sides measured. At --quick sizes a step needs a few MiB, which the allocator may
    # serve from pages freed earlier (a rise of 0 is then a true reading), so only >= 0 is asserted.
    for case in ("window fwd+bwd", "window 2N/N", "causal tiled"):
        assert isinstance(rows[case]["ours_mib"], float) and rows[case]["ours_mib"] >= 0
        assert isinstance(rows[case]["peer_mib"], float) and rows[case]["peer_mib"] >= 0
    w = rows["window fwd+bwd"]
    if w["peer_mib"] > 0:
        assert w["mem_ratio"] == pytest.approx(w["ours_mib"] / w["peer_mib"])
    assert rows["alibi causal"]["ours_mib"] >= 0
    # the naive estimate is 3 and 4 x B*H*N^2*4 bytes at the memory row's N (512 here), B=1, H=8: 24 and 32 MiB
    assert rows["alibi causal"]["naive_mib"] == pytest.approx([24.0, 32.0])
    assert rows["weights 4 rows"]["ours_mib"] >= 0
    # the window row against its FLOPs: the exact band (pairs x H x 2D x 7) at the measured rate
    w = rows["window fwd+bwd"]
    pairs = sum(min(i + 1, 256) for i in range(512))
    assert w["gflop"] == pytest.approx(pairs * 8 * 2 * 64 * 7 / 1e9)
    assert w["flop_ratio"] == pytest.approx(w["ours_ms"] / (w["gflop"] / w["peak_gflops"] * 1e3))
    # under load: both slowdowns measured, and the busy process the benchmark started is gone
    ld = rows["under load"]
    assert ld["slowdown_ours"] == pytest.approx(ld["ours_ms"] / ld["quiet_ours_ms"])
    assert ld["slowdown_peer"] == pytest.approx(ld["peer_ms"] / ld["quiet_peer_ms"])
    with pytest.raises(ProcessLookupError):
        os.kill(ld["busy_pid"], 0)
    # block-sparse rows: the empty-block fraction is the mask's (documents skip some blocks; BigBird at
    # N=512 with 64-wide blocks leaves no 128x128 tile empty)
    assert 0 < rows["document"]["skipped"] < 1 and rows["bigbird"]["skipped"] == 0.0


def test_only_runs_the_named_sections_of_the_efficient_suite(tmp_path):
    out = tmp_path / "efficient.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--suite", "efficient", "--quick", "--threads", "1",
                           "--only", "causal", "--out-efficient", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["case"] for r in json.loads(out.read_text())["rows"]] == ["causal tiled"]
    bad = subprocess.run([sys.executable, str(SCRIPT), "--suite", "efficient", "--only", "nope"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--only" in bad.stderr and "nope" in bad.stderr
