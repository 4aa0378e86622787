"""``attnlab bench``: one entry per benchmark, and every entry ``--list`` names runs.

Each entry's own ``--help`` through ``attnlab bench NAME --help`` (its flags parsed, its modules imported, its peers
named), and a ``--quick`` run of each entry whose quick run no other test makes (``attention``: test_bench_smoke,
``generate``: test_generate_smoke, ``train``, ``train_levers`` and ``train_budget``: test_train_bench,
``train_passes``: test_train_passes_bench; those of a minute or more are marked slow). Quick runs write to a temporary
``--out``: nothing is recorded into ``benchmarks/results/``. No timing assertions."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from attnlab.bench import available

LISTED = sorted(available())
QUICK_ELSEWHERE = {"attention", "generate", "train", "train_levers", "train_budget", "train_passes"}


def _bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "attnlab", "bench", *args], capture_output=True, text=True,
                          timeout=timeout, env={k: v for k, v in os.environ.items() if k != "ATTNLAB_NANOGPT_DIR"})


def test_one_entry_per_training_benchmark_and_no_stand_in():
    """The training benchmarks are separate entries (no modes of one script), each compared with nanoGPT's own
    ``train.py`` where it has a peer; no re-implementation of nanoGPT stands in for it."""
    assert {"train", "train_budget", "train_levers", "train_passes"} <= set(LISTED)
    assert not any("nanogpt" in name for name in LISTED)
    listed = _bench("--list")
    assert listed.returncode == 0 and [line.split()[0] for line in listed.stdout.splitlines()] == LISTED


@pytest.mark.parametrize("name", LISTED)
def test_each_listed_entry_shows_its_own_flags(name):
    proc = _bench(name, "--help")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"usage: {name}.py ") and "--quick" in proc.stdout and "--threads" in proc.stdout


def test_help_before_or_without_a_name_is_the_commands_own():
    for args in (["--help"], ["--help", "train"]):
        proc = _bench(*args)
        assert proc.returncode == 0 and proc.stdout.startswith("usage: attnlab bench ") and "--list" in proc.stdout


QUICK_SLOW = {"linear", "quantize", "rag"}  # quick runs of a minute or more on 2 cores: run with -m slow


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in QUICK_SLOW else n
                                  for n in LISTED if n not in QUICK_ELSEWHERE])
def test_each_entry_without_a_quick_test_elsewhere_runs_quick(name, tmp_path, shakespeare):
    if name == "rag":  # its corpus: Multi30k's validation captions
        from attnlab.data.datasets import DataUnavailableError, load_parallel
        try:
            load_parallel("val", src="de", tgt="en")
        except DataUnavailableError as e:  # offline and no local copy
            pytest.skip(f"Multi30k unavailable: {e}")
    out = tmp_path / f"{name}.json"
    proc = _bench(name, "--quick", "--threads", "1", f"--script-args=--out {out}", timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.startswith(f"== attnlab bench {name}: ") and "machine: " in proc.stdout
    data = json.loads(out.read_text())
    assert data["rows"] and data["environment"]["threads"] == 1
