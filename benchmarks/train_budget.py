"""Our 10-minute ``shakespeare-char`` recipe against nanoGPT's own ``train.py``: the same model size and wall.

The target: on any machine, our ``default`` preset's val loss at least ``MARGIN`` (0.08) below nanoGPT's loop given
the same model size and the same 600 s, in the same benchmark run; the val-loss-vs-wall-clock curves of both in
one PNG. This is the one measurement where the result depends on the machine's speed by design (the preset itself
is already time-limited: ``time_budget`` plans its steps, ``max_seconds`` is its hard stop).

1. Ours: ``attnlab train shakespeare-char`` (the ``default`` preset, ``--set`` applied) in a fresh process, with
   the preset's ``time_budget``, ``max_seconds`` and its step cap ``max_steps`` scaled by ``budget_s / 600``
   (unchanged at 600 s), so it stops itself (at the cap where the machine is fast enough to reach it earlier). Its
   curve: the evaluations in ``metrics.jsonl`` (fixed validation blocks), each at its ``elapsed_s`` plus the
   process's time outside the trainer (``process_s - wall_s``, start-up before the trainer counted in full: the
   curve is never earlier than it was).
2. nanoGPT: its own ``train.py`` (an upstream checkout, :func:`_nanogpt_upstream.budget_flags`) at our resolved
   ``n_layer``, ``n_head``, ``n_embd``, ``block_size``, ``batch_size``, for ``--nanogpt-iters`` iterations with its
   cosine over them; by default as many as fit its time on this machine (:func:`_nanogpt_upstream.fitted_iters`: a
   60 s probe of its own ``train.py`` times an iteration and an evaluation), so that its schedule ends within the
   budget rather than being cut off midway; stopped ``max(budget_s, our process_s)`` after its start, so it never
   gets less time than ours took.
   Its curve: its own "val loss" estimates (``--nanogpt-eval-iters`` batches), stamped when read; its score: the
   last checkpoint it saved, on our fixed validation blocks.
3. The table: ours, nanoGPT, difference (theirs − ours), target (ours <= theirs − MARGIN), met; ``mfu`` of both.

It needs an upstream nanoGPT checkout (``--nanogpt-dir DIR``, by default ``$ATTNLAB_NANOGPT_DIR``; ``git clone
https://github.com/karpathy/nanoGPT``). ``--quick`` races for 20 s at the same model size (a smoke run, not recorded).

Run: ``python benchmarks/train_budget.py --nanogpt-dir DIR [--budget-s 600] [--nanogpt-iters N] [--set key=value ...]
[--threads 2] [--quick] [--out PATH]``
"""
from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, print_table, result, setup, write_json  # noqa: E402
from _mfu import mfu, nanogpt_flops, shown  # noqa: E402
from _nanogpt_upstream import budget_flags, check_checkout, fitted_iters, run_upstream_for  # noqa: E402
from _train_runs import add_nanogpt_dir, print_peak, run_preset  # noqa: E402

MARGIN = 0.08  # the target: ours <= nanoGPT's - 0.08 at the same model size and wall


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of the race (beside :func:`_common.parser`'s); it writes a PNG of both val-loss-vs-seconds curves
    beside ``--out``."""
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra setting for our run")
    add_nanogpt_dir(p)
    p.add_argument("--budget-s", type=float, default=None, help="the wall budget (default 600; 20 with --quick)")
    p.add_argument("--nanogpt-iters", type=int, default=None,
                   help="nanoGPT's max_iters = lr_decay_iters (default: as many as fit the "
                        "budget on this machine, timed by a 60 s probe of its train.py)")
    p.add_argument("--nanogpt-eval-iters", type=int, default=10,
                   help="batches per split of each of nanoGPT's 10 evaluations (default 10)")


def compare_budget(args: argparse.Namespace, *, run_preset) -> dict:
    """Run both for ``args.budget_s``; print the table, write the JSON (``args.out``) and the PNG beside it."""
    from attnlab._runtime import probe
    from attnlab.training.recipes import get_recipe, parse_set, resolve_settings

    if not args.budget_s > 0:
        raise SystemExit(f"--budget-s must be > 0, got {args.budget_s}")
    recipe = get_recipe("shakespeare-char")
    preset = resolve_settings(recipe)  # the default preset: its time limits are for 600 s
    scale = args.budget_s / 600.0
    ours_sets = [f"time_budget={preset.time_budget * scale}", f"max_seconds={preset.max_seconds * scale}",
                 f"max_steps={max(1, round(preset.max_steps * scale))}", *args.set]
    s = resolve_settings(recipe, overrides=parse_set(ours_sets))
    if (args.nanogpt_iters is not None and args.nanogpt_iters < 1) or args.nanogpt_eval_iters < 1:
        raise SystemExit("--nanogpt-iters and --nanogpt-eval-iters must be >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        ours = run_preset("default", threads=args.threads, overrides=ours_sets, out=Path(tmp) / "ours")
        ours["run"] = "attnlab default"
        offset = ours["process_s"] - ours["wall_s"]
        ours_curve = [[r["elapsed_s"] + offset, r["step"], r["val_loss"]]
                      for r in map(json.loads, (Path(tmp) / "ours" / "metrics.jsonl").read_text().splitlines())
                      if r.get("kind") == "eval"]
        print(f"attnlab default: {ours['process_s']:.1f} s, {ours['steps']} steps, val loss {ours['val_loss']:.4f}",
              flush=True)
        deadline = max(args.budget_s, ours["process_s"])
        iters, fitted = args.nanogpt_iters, None
        if iters is None:
            fitted = fitted_iters(args.nanogpt_dir, s, budget_s=deadline, eval_iters=args.nanogpt_eval_iters,
                                  threads=args.threads, work=Path(tmp) / "probe")
            iters = fitted["iters"]
            print(f"nanoGPT probe: {fitted['s_per_iter']:.3f} s per iteration, {fitted['eval_s']:.1f} s per "
                  f"evaluation, start-up {fitted['start_s']:.1f} s: {iters} iterations fit {deadline:.0f} s",
                  flush=True)
        flags = budget_flags(s, iters=iters, eval_iters=args.nanogpt_eval_iters)
        up = run_upstream_for(args.nanogpt_dir, flags=flags, deadline_s=deadline, threads=args.threads,
                              work=Path(tmp) / "nanogpt", fixed_blocks=dict(
                                  block=s.block_size, batch=s.eval_batch_size, batches=s.eval_batches,
                                  seed=s.seed + 1))
    flops = nanogpt_flops(up["model_args"], steps=up["steps"], batch_size=up["batch_size"])
    theirs = {"run": "nanoGPT train.py", "dtype": "fp32", "process_s": up["process_s"], "steps": up["steps"],
              "val_loss": up["val_loss_fixed"], "best_val_loss": "", "flops": flops,
              "mfu": mfu(flops, up["process_s"], "fp32"),
              "target": (f"{'stopped' if up['stopped'] else 'ended'} at {up['process_s']:.0f} s; checkpoint of "
                         f"step {up['scored_iter']}; its own last val {up['evals'][-1][2]:.4f}" if up["evals"] else "")}
    print(f"nanoGPT train.py: {up['process_s']:.1f} s, {up['steps']} steps, val loss {up['val_loss_fixed']:.4f} "
          f"(checkpoint of step {up['scored_iter']})", flush=True)
    difference = theirs["val_loss"] - ours["val_loss"]
    met = ours["val_loss"] <= theirs["val_loss"] - MARGIN
    ours["target"] = f"val <= nanoGPT's - {MARGIN}"
    ours["met"] = "yes" if met else "no"
    print()
    print_table(shown([ours, theirs]), ["run", "dtype", "process_s", "steps", "val_loss", "best_val_loss", "mfu",
                                        "target", "met"])
    print(f"\nsame {args.budget_s:.0f} s budget, model {s.n_layer} x {s.n_embd} ({s.n_head} heads), block "
          f"{s.block_size}, batch {s.batch_size}: ours {ours['val_loss']:.4f}, nanoGPT {theirs['val_loss']:.4f}, "
          f"difference {difference:+.4f}, target ours <= theirs - {MARGIN}: {'met' if met else 'not met'}")
    png = Path(args.out).with_suffix(".png")
    cap = probe()
    plot_curves(ours_curve, up["evals"], png, budget_s=args.budget_s,
                nanogpt_stop=up["process_s"] if up["stopped"] else None,
                nanogpt_final=(_time_of(up["evals"], up["scored_iter"]), theirs["val_loss"]),
                title=(f"shakespeare-char {s.n_layer} x {s.n_embd}, block {s.block_size}, batch {s.batch_size}: "
                       f"same {args.budget_s:.0f} s\n{cap.cpu} | ISA {cap.isa} | {args.threads} threads | "
                       f"ours {ours['dtype']}, nanoGPT fp32"))
    summary = {"ours": ours["val_loss"], "nanogpt": theirs["val_loss"], "difference": difference,
               "target": f"ours <= nanogpt - {MARGIN}", "met": met}
    results = [result(f"{args.budget_s:.0f} s race: val loss", ours["val_loss"], theirs["val_loss"], unit="val loss",
                      ratio=None, target=f"ours <= nanoGPT's - {MARGIN}", met=met)]
    write_json(args.out, [ours, theirs], results=results, quick=args.quick, budget_s=args.budget_s,
               threads=args.threads,
               nanogpt_dir=str(args.nanogpt_dir), nanogpt_flags=flags, nanogpt_fitted=fitted, summary=summary,
               curves={"ours": ours_curve, "nanogpt": up["evals"]}, png=str(png))
    print(f"wrote {args.out} and {png}")
    return summary


def _time_of(evals: list, step: int):
    """When nanoGPT's evaluation of ``step`` was read (its checkpoint follows it), or None."""
    return next((t for t, s, _ in evals if s == step), None)


def plot_curves(ours: list, theirs: list, path: Path, *, budget_s: float, nanogpt_stop, nanogpt_final: tuple,
                title: str) -> None:
    """Both val-loss-vs-seconds curves (``[seconds, step, val]`` points) in one PNG (matplotlib, no pyplot), the
    budget, when nanoGPT was stopped (None: it ended by itself) and its scored checkpoint ``(seconds, val)``."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), dpi=100)
    ax = fig.add_subplot()
    ax.plot([p[0] for p in ours], [p[2] for p in ours], marker="o", markersize=3, color="tab:blue",
            label="attnlab default (our fixed validation blocks)")
    ax.plot([p[0] for p in theirs], [p[2] for p in theirs], marker="s", markersize=3, color="tab:orange",
            label="nanoGPT train.py (its own val estimate)")
    if nanogpt_final[0] is not None:
        ax.plot(*nanogpt_final, marker="*", markersize=12, linestyle="none", color="tab:red",
                label="nanoGPT's last checkpoint on our fixed blocks")
    ax.axvline(budget_s, color="gray", linestyle=":", linewidth=1, label=f"budget {budget_s:.0f} s")
    if nanogpt_stop is not None:
        ax.axvline(nanogpt_stop, color="tab:orange", linestyle=":", linewidth=1,
                   label=f"nanoGPT stopped ({nanogpt_stop:.0f} s)")
    ax.set_xlabel("seconds since the process started")
    ax.set_ylabel("validation cross-entropy (nats/char)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())


def main() -> None:
    p = parser(__doc__.splitlines()[0], "train_budget.json")
    add_arguments(p)
    args = p.parse_args()
    if args.nanogpt_dir is None:
        raise SystemExit("train_budget.py needs --nanogpt-dir DIR or $ATTNLAB_NANOGPT_DIR (an upstream nanoGPT "
                         "checkout: git clone https://github.com/karpathy/nanoGPT)")
    args.nanogpt_dir = check_checkout(args.nanogpt_dir)  # before any run: a wrong folder fails at once
    if args.budget_s is None:
        args.budget_s = 20.0 if args.quick else 600.0
    setup(args)
    print_peak(args.threads)
    compare_budget(args, run_preset=run_preset)


if __name__ == "__main__":
    main()
