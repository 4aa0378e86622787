"""One ``attnlab train shakespeare-char`` run as a benchmark row, shared by ``train.py``, ``train_budget.py`` and
``train_levers.py``: a fresh process (nothing warm from a previous row) into a given folder, its ``metrics.json``
read back with the process's wall time, its matrix-product FLOPs and ``mfu`` (``_mfu.py``), and the preset's target.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _mfu import mfu, peak_gflops, settings_flops

ROOT = Path(__file__).resolve().parents[1]
# preset -> (the metric, its bound, the run's wall bound in seconds)
TARGETS = {"nanogpt-cpu": ("val_loss", 1.88, 30.0), "default": ("best_val_loss", 1.47, 600.0),
           "tiny": ("val_loss", 4.2, 120.0)}


def get_settings(preset: str):
    """The resolved settings of a ``shakespeare-char`` preset (for the peers' fixed validation blocks)."""
    from attnlab.training.recipes import get_recipe, resolve_settings

    return resolve_settings(get_recipe("shakespeare-char"), preset=preset)


def resolve_saved(out: Path):
    """The settings a finished run in ``out`` was made with (its ``config.json``)."""
    from attnlab.training.recipes import get_recipe, resolve_settings

    saved = json.loads((out / "config.json").read_text())
    return resolve_settings(get_recipe(saved["recipe"]), base=saved["settings"])


def run_preset(preset: str, *, threads: int, overrides: list[str], out: Path) -> dict:
    """One ``attnlab train`` process; its metrics plus the process wall time."""
    cmd = [sys.executable, "-m", "attnlab", "train", "shakespeare-char", "--preset", preset, "--out", str(out),
           "--threads", str(threads), "--quiet"]
    for kv in overrides:
        cmd += ["--set", kv]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
    process_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    m = json.loads((out / "metrics.json").read_text())
    settings = resolve_saved(out)
    flops = settings_flops(settings, vocab_size=m["vocab_size"], tokens=m["train_tokens"])
    key, limit, budget = TARGETS[preset]
    met = m[key] is not None and m[key] <= limit and m["total_wall_s"] <= budget
    return {"run": "", "preset": preset, "run_s": m["total_wall_s"], "process_s": process_s, "steps": m["steps"],
            "tokens_per_s": m["train_tokens_per_s"], "val_loss": m["val_loss"], "best_val_loss": m["best_val_loss"],
            "target": f"{key} <= {limit} in <= {budget:.0f} s", "met": "yes" if met else "no",
            "parameters": m.get("parameters"), "overrides": overrides, "dtype": m.get("dtype"),
            "dtype_reason": m.get("dtype_reason"), "wall_s": m["wall_s"], "train_tokens": m["train_tokens"],
            "flops": flops, "mfu": mfu(flops, process_s, "int8" if m.get("int8_layers") else m["dtype"]),
            "int8_layers": m.get("int8_layers", 0)}


def add_nanogpt_dir(p) -> None:
    """``--nanogpt-dir`` (default ``$ATTNLAB_NANOGPT_DIR``): the upstream checkout whose ``train.py`` is the peer."""
    p.add_argument("--nanogpt-dir", type=Path, default=os.environ.get("ATTNLAB_NANOGPT_DIR") or None,
                   help="an upstream nanoGPT checkout (git clone https://github.com/karpathy/nanoGPT): its own "
                        "train.py is the peer (default: $ATTNLAB_NANOGPT_DIR)")


def print_peak(threads: int) -> None:
    """The peak GFLOP/s that ``mfu`` divides by, measured now."""
    print(f"peak (measured now, attnlab._runtime probe: 512² products, {threads} threads): "
          f"fp32 {peak_gflops('fp32'):.1f}, bf16 {peak_gflops('bf16'):.1f}, int8 {peak_gflops('int8'):.1f} GFLOP/s "
          "(the int8 layers' product call, right operand ±63); mfu = matrix-product FLOP/s of the whole process / "
          "the peak of the row's dtype (int8 for a run with int8_training)", flush=True)
