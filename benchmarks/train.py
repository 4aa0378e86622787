"""Training speed and quality of the ``shakespeare-char`` recipes against nanoGPT's recorded numbers.

Each recipe runs as ``python -m attnlab train shakespeare-char --preset P --threads T`` in a fresh
process (nothing warm from a previous row), into a temporary folder; its ``metrics.json`` gives the
steps, the training tokens/s and the validation loss (fp32, fixed validation blocks). Two wall
times are reported: ``run_s`` = the recipe from data loading to the last file written (what the
targets are about) and ``process_s`` = the whole command, Python and torch start-up included.

nanoGPT is not installed here. Two peer rows: nanoGPT's numbers recorded once (``NANOGPT``: fp32,
2 threads, on a different CPU with AMX: labelled "recorded", never re-run), and for ``nanogpt-cpu``
``benchmarks/nanogpt_peer.py`` run in this invocation: nanoGPT's model and CPU training loop in
plain PyTorch, on this machine, its final model scored on the recipe's validation blocks
("nanoGPT-equivalent"; ``--no-peer`` skips it). ``speedup`` = peer wall / our wall, against the
same-machine peer where there is one. With ``--ablate`` each recipe also runs with ``dtype=fp32``.

``--nanogpt-dir DIR`` adds the real peer for ``nanogpt-cpu``: nanoGPT's own ``train.py`` from an upstream checkout
(``git clone https://github.com/karpathy/nanoGPT``), its CPU recipe on the same ``input.txt`` prepared by its own
``prepare.py``, in a fresh process, its final model scored on our fixed validation blocks
(``benchmarks/_nanogpt_upstream.py``). The target: our whole process in **≤ 0.5×** its wall time, at a val
loss ≤ its val loss on the same blocks (``vs_upstream`` = our process_s / its process_s). ``--pairs N`` runs its
``train.py`` and ours alternately N times (theirs, ours, theirs, ours, …): on a machine whose speed drifts by minutes
(a shared VM) one pair can land either side of the line, so ``vs_upstream`` is then the median of the N pairs' ratios,
each pair printed and written, and the rows show the median pair.

``mfu`` (every row run here): matrix-product FLOPs per second of the whole process ÷ this machine's peak for the row's
dtype, measured in the same run and printed (``benchmarks/_mfu.py`` states the formula: ``tokens · (6·N_mm +
12·L·T·d)``, training tokens only, the same for ours and nanoGPT's).

``--compare-budget --nanogpt-dir DIR`` is the wall-clock race instead (``benchmarks/_compare_budget.py``): our
``default`` preset and nanoGPT's own ``train.py`` at the same model size, each for ``--budget-s`` seconds (600), in
this one invocation; a PNG of both val-loss-vs-seconds curves and the table ours, nanoGPT, difference, target
(ours <= theirs - 0.08), met.

| recipe | target |
|---|---|
| ``nanogpt-cpu`` | val loss <= 1.88 and run_s <= 30 (nanoGPT: 1.874 in 59 s) |
| ``default`` | best val loss <= 1.47 (nanoGPT's A100 result; on AVX512-BF16) and run_s <= 600 |

Run: ``python benchmarks/train.py [--recipe nanogpt-cpu|default|all] [--threads 2] [--ablate] [--no-peer]
[--nanogpt-dir DIR [--pairs N]] [--set key=value ...] [--quick] [--out PATH]`` (``--quick``: the ``tiny`` preset, a
smoke run);
``python benchmarks/train.py --compare-budget --nanogpt-dir DIR [--budget-s 600] [--nanogpt-iters N] [--set ...]``;
``python benchmarks/train.py --levers [LEVER ...]`` (``benchmarks/_levers.py``: the speedrun techniques, each alone in
the 10-minute default, between two baseline runs).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, print_table, result, setup, write_json  # noqa: E402
from _compare_budget import add_arguments as add_budget_arguments, compare_budget  # noqa: E402
from _levers import add_arguments as add_lever_arguments, run_levers  # noqa: E402
from _mfu import mfu, nanogpt_flops, peak_gflops, settings_flops, shown  # noqa: E402
from _nanogpt_upstream import check_checkout, run_upstream  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# nanoGPT's character-level tiny-shakespeare runs (fp32, 2 threads, another CPU with AMX; recorded once, not re-run)
NANOGPT = {
    "nanogpt-cpu": {"wall_s": 59.0, "steps": 2000, "tokens_per_s": 29_000, "val_loss": 1.874,
                    "config": "4 layers x 128, block 64, batch 12, 2000 iters"},
    "default": {"wall_s": 560.0, "steps": 1500, "tokens_per_s": 12_000, "val_loss": 1.554,
                "config": "4 layers x 256, block 128, batch 32, 1500 iters"},
}
TARGETS = {"nanogpt-cpu": ("val_loss", 1.88, 30.0), "default": ("best_val_loss", 1.47, 600.0),
           "tiny": ("val_loss", 4.2, 120.0)}
UPSTREAM_RATIO = 0.5  # the target: our wall <= 0.5x nanoGPT's own train.py on the same machine


def get_settings(preset: str):
    """The resolved settings of a ``shakespeare-char`` preset (for the peers' fixed validation blocks)."""
    from attnlab.training.recipes import get_recipe, resolve_settings

    return resolve_settings(get_recipe("shakespeare-char"), preset=preset)


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


def summary(rows: list[dict]) -> list[dict]:
    """Our rows' targets for ``results/<cpu class>.json``: quality and time, and the ratio to nanoGPT's own
    ``train.py`` process where it ran."""
    out = []
    for row in (r for r in rows if r["run"] == "attnlab"):
        key = TARGETS[row["preset"]][0]
        out.append(result(f"{row['preset']}: {key}, run_s", row[key], None, unit="val loss", ratio=None,
                          target=row["target"], met=row["met"] == "yes"))
        if "vs_upstream" in row:
            out.append(result(f"{row['preset']}: process wall vs nanoGPT's train.py", row["process_s"],
                              row["process_s"] / row["vs_upstream"], unit="s", ratio=row["vs_upstream"],
                              target=f"ratio <= {UPSTREAM_RATIO} at val <= its val", met=row["upstream_met"] == "yes"))
    return out


def resolve_saved(out: Path):
    """The settings a finished run in ``out`` was made with (its ``config.json``)."""
    from attnlab.training.recipes import get_recipe, resolve_settings

    saved = json.loads((out / "config.json").read_text())
    return resolve_settings(get_recipe(saved["recipe"]), base=saved["settings"])


def median_pair(pairs: list[tuple[dict, list[dict]]]) -> tuple[tuple[dict, list[dict]], list[float]]:
    """``pairs``: (nanoGPT's row, our rows) in run order. The pair whose ratio (our first row's ``vs_upstream``) is the
    median — the upper of the middle two for an even count: give an odd ``--pairs`` — and every pair's ratio."""
    ratios = [ours[0]["vs_upstream"] for _, ours in pairs]
    return sorted(pairs, key=lambda p: p[1][0]["vs_upstream"])[len(pairs) // 2], ratios


def run_nanogpt(args, preset: str, work: Path) -> dict:
    """nanoGPT's own ``train.py`` (``--nanogpt-dir``) in a fresh process, scored on our fixed validation blocks: its
    row of the table."""
    s = get_settings(preset)
    up = run_upstream(args.nanogpt_dir, threads=args.threads, work=work, fixed_blocks=dict(
        block=s.block_size, batch=s.eval_batch_size, batches=s.eval_batches, seed=s.seed + 1))
    flops = nanogpt_flops(up["model_args"], steps=up["steps"], batch_size=up["batch_size"])
    print(f"nanoGPT upstream: {up['process_s']:.1f} s, val loss {up['val_loss_fixed']:.4f}", flush=True)
    return {"run": "nanoGPT train.py (upstream, this machine)", "preset": preset, "run_s": "", "flops": flops,
            "mfu": mfu(flops, up["process_s"], "fp32"), "process_s": up["process_s"], "steps": up["steps"],
            "val_loss": up["val_loss_fixed"], "best_val_loss": "", "dtype": "fp32", "met": "",
            "target": f"its own val estimate {up['val_loss_own']:.4f} (step {up['scored_iter']})"}


def run_peer(*, threads: int) -> dict:
    """``nanogpt_peer.py`` in a fresh process: nanoGPT's CPU run of the ``nanogpt-cpu`` recipe, on this machine."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "nanogpt_peer.py"), "--threads", str(threads)],
                          check=False, capture_output=True, text=True, env=env)
    process_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"nanogpt_peer.py failed:\n{proc.stderr[-3000:]}")
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    flops = nanogpt_flops(m["model_args"], steps=m["steps"], batch_size=m["batch_size"])
    return {"run": "nanoGPT-equivalent (this machine)", "preset": "nanogpt-cpu", "run_s": m["wall_s"],
            "process_s": process_s, "steps": m["steps"], "tokens_per_s": m["tokens_per_s"],
            "val_loss": m["val_loss_fixed"], "best_val_loss": m["val_loss_fixed"],
            "target": f"nanoGPT's own estimate {m['val_loss']:.3f}", "met": "", "dtype": "fp32",
            "flops": flops, "mfu": mfu(flops, process_s, "fp32")}


def main() -> None:
    p = parser(__doc__.splitlines()[0], "train.json")
    p.add_argument("--recipe", choices=("nanogpt-cpu", "default", "all"), default="all")
    p.add_argument("--ablate", action="store_true", help="also run each recipe with dtype=fp32")
    p.add_argument("--no-peer", action="store_true", help="skip the same-machine nanoGPT-equivalent run")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra setting for every run")
    p.add_argument("--nanogpt-dir", type=Path, default=None,
                   help="an upstream nanoGPT checkout: its own train.py is the nanogpt-cpu peer")
    p.add_argument("--pairs", type=int, default=1,
                   help="with --nanogpt-dir: run its train.py and our nanogpt-cpu alternately this many times "
                        "(odd); vs_upstream is the median of the pairs' ratios")
    add_budget_arguments(p)
    add_lever_arguments(p)
    args = p.parse_args()
    if args.compare_budget and args.levers is not None:
        raise SystemExit("--compare-budget and --levers are two different runs: give one of them")
    if args.compare_budget and args.nanogpt_dir is None:
        raise SystemExit("--compare-budget needs --nanogpt-dir DIR (an upstream nanoGPT checkout: "
                         "git clone https://github.com/karpathy/nanoGPT)")
    if args.pairs < 1 or (args.pairs > 1 and args.nanogpt_dir is None):
        raise SystemExit(f"--pairs must be >= 1 and needs --nanogpt-dir (pairs of nanoGPT's train.py and ours), "
                         f"got {args.pairs}")
    if args.nanogpt_dir is not None:
        args.nanogpt_dir = check_checkout(args.nanogpt_dir)  # before any run: a wrong folder fails at once
    setup(args)
    if not os.environ.get("ATTNLAB_DATA_DIR"):
        print("note: ATTNLAB_DATA_DIR is not set; the data comes from ~/.cache/attnlab (or a download)")
    print(f"peak (measured now, attnlab._runtime probe: 512² products, {args.threads} threads): "
          f"fp32 {peak_gflops('fp32'):.1f}, bf16 {peak_gflops('bf16'):.1f}, int8 {peak_gflops('int8'):.1f} GFLOP/s "
          "(the int8 layers' product call, right operand ±63); mfu = matrix-product FLOP/s of the whole process / "
          "the peak of the row's dtype (int8 for a run with int8_training)", flush=True)
    if args.compare_budget:
        if args.out == p.get_default("out"):
            args.out = str(Path(args.out).with_name("train_budget.json"))
        compare_budget(args, run_preset=run_preset)
        return
    if args.levers is not None:
        if args.out == p.get_default("out"):
            args.out = str(Path(args.out).with_name("train_levers.json"))
        run_levers(args, run_preset=run_preset)
        return
    presets = ["tiny"] if args.quick else (["nanogpt-cpu", "default"] if args.recipe == "all" else [args.recipe])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, preset in enumerate(presets):
            extra = ["max_steps=20"] if args.quick else []
            variants = [("attnlab", args.set + extra)]
            if args.ablate:
                variants.append(("attnlab fp32", args.set + extra + ["dtype=fp32"]))
            peer = run_peer(threads=args.threads) if preset == "nanogpt-cpu" and not args.no_peer else None
            if peer:
                print(f"nanoGPT-equivalent: {peer['run_s']:.1f} s, val loss {peer['val_loss']:.4f}", flush=True)
            upstream, pairs = None, []
            for k in range(args.pairs if preset == "nanogpt-cpu" and args.nanogpt_dir is not None else 1):
                if preset == "nanogpt-cpu" and args.nanogpt_dir is not None:
                    upstream = run_nanogpt(args, preset, Path(tmp) / f"nanogpt-{i}-{k}")
                pair = []
                for j, (label, overrides) in enumerate(variants):
                    row = run_preset(preset, threads=args.threads, overrides=overrides, out=Path(tmp) / f"{i}-{j}-{k}")
                    row["run"] = label
                    ref = peer or NANOGPT.get(preset)
                    if ref:
                        row["speedup"] = (ref["run_s"] if peer else ref["wall_s"]) / row["run_s"]
                    if upstream:
                        row["vs_upstream"] = row["process_s"] / upstream["process_s"]
                        row["upstream_met"] = "yes" if (row["vs_upstream"] <= UPSTREAM_RATIO
                                                        and row["val_loss"] <= upstream["val_loss"]) else "no"
                    pair.append(row)
                    print(f"{label} {preset}: {row['run_s']:.1f} s, val loss {row['val_loss']:.4f}"
                          + (f", {row['vs_upstream']:.3f}x nanoGPT's" if upstream else ""), flush=True)
                pairs.append((upstream, pair))
            if len(pairs) > 1:
                (upstream, pair), ratios = median_pair(pairs)
                pair[0]["vs_upstream_pairs"] = ratios
                print(f"pairs (nanoGPT's train.py, ours) x {len(pairs)}: ratios "
                      + ", ".join(f"{r:.3f}" for r in ratios) + f"; median {pair[0]['vs_upstream']:.3f}", flush=True)
            rows.extend(pair)
            if peer:
                rows.append(peer)
            if upstream:
                rows.append(upstream)
            if preset in NANOGPT:
                ref = NANOGPT[preset]
                rows.append({"run": "nanoGPT (recorded)", "preset": preset, "run_s": ref["wall_s"], "process_s": "",
                             "steps": ref["steps"], "tokens_per_s": ref["tokens_per_s"], "val_loss": ref["val_loss"],
                             "best_val_loss": ref["val_loss"], "target": ref["config"], "met": ""})
    print()
    print_table(shown(rows), ["run", "preset", "dtype", "run_s", "process_s", "steps", "tokens_per_s", "val_loss",
                              "best_val_loss", "mfu", "speedup", "vs_upstream", "upstream_met", "target", "met"])
    ours = [r for r in rows if r["run"] == "attnlab"]
    print(f"\ntargets met: {sum(r['met'] == 'yes' for r in ours)}/{len(ours)}  "
          "(recorded rows: NANOGPT, another CPU, not re-run; speedup against the same-machine peer where run)")
    if args.nanogpt_dir is not None:
        print(f"vs_upstream: our process wall / nanoGPT's own train.py wall; target <= {UPSTREAM_RATIO} at a val loss "
              "<= its val loss on the same fixed blocks (upstream_met)")
    write_json(args.out, rows, results=summary(rows), quick=args.quick, threads=args.threads, nanogpt_recorded=NANOGPT,
               peak_gflops={d: peak_gflops(d) for d in ("fp32", "bf16", "int8")},
               nanogpt_dir=None if args.nanogpt_dir is None else str(args.nanogpt_dir))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
