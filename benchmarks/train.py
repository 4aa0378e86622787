"""Training speed and quality of the ``shakespeare-char`` recipes against nanoGPT's own ``train.py``.

Each recipe runs as ``python -m attnlab train shakespeare-char --preset P --threads T`` in a fresh
process (nothing warm from a previous row), into a temporary folder; its ``metrics.json`` gives the
steps, the training tokens/s and the validation loss (fp32, fixed validation blocks). Two wall
times are reported: ``run_s`` = the recipe from data loading to the last file written (what the
targets are about) and ``process_s`` = the whole command, Python and torch start-up included.

The peer, for ``nanogpt-cpu``: nanoGPT's own ``train.py`` from an upstream checkout (``--nanogpt-dir DIR``, by default
``$ATTNLAB_NANOGPT_DIR``; ``git clone https://github.com/karpathy/nanoGPT``), its CPU recipe on the same ``input.txt``
prepared by its own ``prepare.py``, in a fresh process, its final model scored on our fixed validation blocks
(``benchmarks/_nanogpt_upstream.py``). Without a checkout our rows run alone, and the output says so. The target: our
whole process in **≤ 0.5×** its wall time, at a val loss ≤ its val loss on the same blocks (``vs_upstream`` = our
process_s / its process_s). ``--pairs N`` runs its ``train.py`` and ours alternately N times (theirs, ours, theirs,
ours, …): on a machine whose speed drifts by minutes (a shared VM) one pair can land either side of the line, so
``vs_upstream`` is then the median of the N pairs' ratios, each pair printed and written, and the rows show the median
pair.

``mfu`` (every row run here): matrix-product FLOPs per second of the whole process ÷ this machine's peak for the row's
dtype, measured in the same run and printed (``benchmarks/_mfu.py`` states the formula: ``tokens · (6·N_mm +
12·L·T·d)``, training tokens only, the same for ours and nanoGPT's).

The other training benchmarks: ``train_budget.py`` (the 600 s race of our ``default`` preset against nanoGPT's
``train.py`` at the same model size), ``train_levers.py`` (the speedrun techniques, each alone, against the
``default`` preset) and ``train_passes.py`` (the C++ training passes against the PyTorch operations they replace).

| recipe | target |
|---|---|
| ``nanogpt-cpu`` | val loss <= 1.88 and run_s <= 30 |
| ``default`` | best val loss <= 1.47 and run_s <= 600 |

Run: ``python benchmarks/train.py [--recipe nanogpt-cpu|default|all] [--threads 2] [--nanogpt-dir DIR [--pairs N]]
[--set key=value ...] [--quick] [--out PATH]`` (``--quick``: the ``tiny`` preset, a smoke run).
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, print_table, result, setup, write_json  # noqa: E402
from _mfu import mfu, nanogpt_flops, peak_gflops, shown  # noqa: E402
from _nanogpt_upstream import check_checkout, run_upstream  # noqa: E402
from _train_runs import TARGETS, add_nanogpt_dir, get_settings, print_peak, run_preset  # noqa: E402

UPSTREAM_RATIO = 0.5  # the target: our wall <= 0.5x nanoGPT's own train.py on the same machine


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


def main() -> None:
    p = parser(__doc__.splitlines()[0], "train.json")
    p.add_argument("--recipe", choices=("nanogpt-cpu", "default", "all"), default="all")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra setting for every run")
    add_nanogpt_dir(p)
    p.add_argument("--pairs", type=int, default=1,
                   help="with --nanogpt-dir: run its train.py and our nanogpt-cpu alternately this many times "
                        "(odd); vs_upstream is the median of the pairs' ratios")
    args = p.parse_args()
    if args.pairs < 1 or (args.pairs > 1 and args.nanogpt_dir is None):
        raise SystemExit(f"--pairs must be >= 1 and needs --nanogpt-dir (pairs of nanoGPT's train.py and ours), "
                         f"got {args.pairs}")
    if args.nanogpt_dir is not None:
        args.nanogpt_dir = check_checkout(args.nanogpt_dir)  # before any run: a wrong folder fails at once
    setup(args)
    if not os.environ.get("ATTNLAB_DATA_DIR"):
        print("note: ATTNLAB_DATA_DIR is not set; the data comes from ~/.cache/attnlab (or a download)")
    print_peak(args.threads)
    presets = ["tiny"] if args.quick else (["nanogpt-cpu", "default"] if args.recipe == "all" else [args.recipe])
    if args.nanogpt_dir is None and "nanogpt-cpu" in presets:
        print("no peer: nanoGPT's train.py runs beside nanogpt-cpu with --nanogpt-dir DIR (or $ATTNLAB_NANOGPT_DIR) "
              "naming an upstream checkout (git clone https://github.com/karpathy/nanoGPT)", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, preset in enumerate(presets):
            overrides = args.set + (["max_steps=20"] if args.quick else [])
            upstream, pairs = None, []
            with_peer = preset == "nanogpt-cpu" and args.nanogpt_dir is not None
            for k in range(args.pairs if with_peer else 1):
                if with_peer:
                    upstream = run_nanogpt(args, preset, Path(tmp) / f"nanogpt-{i}-{k}")
                row = run_preset(preset, threads=args.threads, overrides=overrides, out=Path(tmp) / f"{i}-{k}")
                row["run"] = "attnlab"
                if upstream:
                    row["vs_upstream"] = row["process_s"] / upstream["process_s"]
                    row["upstream_met"] = "yes" if (row["vs_upstream"] <= UPSTREAM_RATIO
                                                    and row["val_loss"] <= upstream["val_loss"]) else "no"
                print(f"attnlab {preset}: {row['run_s']:.1f} s, val loss {row['val_loss']:.4f}"
                      + (f", {row['vs_upstream']:.3f}x nanoGPT's" if upstream else ""), flush=True)
                pairs.append((upstream, [row]))
            if len(pairs) > 1:
                (upstream, pair), ratios = median_pair(pairs)
                pair[0]["vs_upstream_pairs"] = ratios
                print(f"pairs (nanoGPT's train.py, ours) x {len(pairs)}: ratios "
                      + ", ".join(f"{r:.3f}" for r in ratios) + f"; median {pair[0]['vs_upstream']:.3f}", flush=True)
            else:
                upstream, pair = pairs[0]
            rows.extend(pair)
            if upstream:
                rows.append(upstream)
    print()
    print_table(shown(rows), ["run", "preset", "dtype", "run_s", "process_s", "steps", "tokens_per_s", "val_loss",
                              "best_val_loss", "mfu", "vs_upstream", "upstream_met", "target", "met"])
    ours = [r for r in rows if r["run"] == "attnlab"]
    print(f"\ntargets met: {sum(r['met'] == 'yes' for r in ours)}/{len(ours)}")
    if args.nanogpt_dir is not None:
        print(f"vs_upstream: our process wall / nanoGPT's own train.py wall; target <= {UPSTREAM_RATIO} at a val loss "
              "<= its val loss on the same fixed blocks (upstream_met)")
    write_json(args.out, rows, results=summary(rows), quick=args.quick, threads=args.threads,
               peak_gflops={d: peak_gflops(d) for d in ("fp32", "bf16", "int8")},
               nanogpt_dir=None if args.nanogpt_dir is None else str(args.nanogpt_dir))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
