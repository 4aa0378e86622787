"""The speedrun techniques of ``shakespeare-char``, each alone, against its 10-minute default.

Each row is one ``attnlab train shakespeare-char`` process (the ``default`` preset: ``time_budget`` plans its steps
into 600 s, so a lever that makes a step slower gets fewer steps, as it would for a user), with one lever's
settings added to ``--set``. The baseline runs first and again last: the spread of its two values is the machine's
noise in this run, the yardstick a lever's Δ must clear before it counts. Columns: the best validation loss
(fixed blocks), Δ = lever − mean of the baselines, the steps, the seconds per step, and whether Δ clears the noise.

| lever | settings |
|---|---|
| (controls: the default's parts undone one at a time) AdamW for all parameters, not Muon | ``optimizer=adamw`` |
| Muon at the schedule's lr (not 2×); with 5 Newton–Schulz steps (not 3) | ``muon_lr_scale=1``; ``muon_ns_steps=5`` |
| dropout 0; 0.05; 0.1 (the default: 0.05 in bf16, 0 in fp32) | ``dropout=0``; ``dropout=0.05``; ``dropout=0.1`` |
| context 128 with batch 32 (the same tokens a step) instead of 256 × 16 | ``block_size=128 batch_size=32`` |
| GPT-2's architecture instead of Llama's | ``arch=gpt2`` |
| zero-initialised output projections | ``zero_init=true`` |
| logit soft-cap at 30 | ``logit_softcap=30`` |
| untied head | ``tie_embeddings=false`` |
| QK-norm (RMSNorm on each head's q and k) | ``qk_norm=true`` |
| ReLU²-gated MLP instead of SwiGLU | ``activation=relu2_glu`` |
| value embeddings (a token table per layer added to the values) | ``value_embeddings=true`` |
| warmup–stable–decay schedule instead of cosine (linear decay over the last 20 %) | ``schedule=wsd`` |
| (a control, not a lever: the schedule's lr doubled, Muon's with it) | ``lr=4e-3`` |
| (a control: float32 throughout instead of the preset's dtype) | ``dtype=fp32`` |

``--quick`` runs the ``tiny`` preset for 20 steps with the default's architecture, dropout and optimiser (a smoke run,
not recorded).

Run: ``python benchmarks/train_levers.py [LEVER ...] [--set key=value ...] [--threads 2] [--quick] [--out PATH]``
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, print_table, setup, write_json  # noqa: E402
from _train_runs import print_peak, run_preset  # noqa: E402

LEVERS = {
    "adamw": ["optimizer=adamw"],
    "muon-lr1": ["muon_lr_scale=1"],
    "muon-ns5": ["muon_ns_steps=5"],
    "no-dropout": ["dropout=0"],
    "dropout-0.05": ["dropout=0.05"],
    "dropout-0.1": ["dropout=0.1"],
    "block-128": ["block_size=128", "batch_size=32"],
    "gpt2": ["arch=gpt2"],
    "zero-init": ["zero_init=true"],
    "softcap-30": ["logit_softcap=30"],
    "untied-head": ["tie_embeddings=false"],
    "qk-norm": ["qk_norm=true"],
    "relu2": ["activation=relu2_glu"],
    "value-embeds": ["value_embeddings=true"],
    "wsd": ["schedule=wsd"],
    "lr-2x": ["lr=4e-3"],
    "fp32": ["dtype=fp32"],
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of the levers run (beside :func:`_common.parser`'s)."""
    p.add_argument("levers", nargs="*", choices=sorted(LEVERS), default=[], metavar="LEVER",
                   help=f"run the default preset with each lever alone (all, or those named: {', '.join(LEVERS)}), "
                        "between two baseline runs; prints val at the end of the budget and the change")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra setting for every run")


def run_levers(args: argparse.Namespace, *, run_preset) -> list[dict]:
    """Baseline, each lever, baseline again; print the table and write the JSON (``args.out``)."""
    names = list(args.levers) or list(LEVERS)
    preset = "tiny" if args.quick else "default"
    # the default preset is llama with dropout and Muon; tiny is none of them
    extra = ["max_steps=20", "arch=llama", "dropout=0.05", "optimizer=muon"] if args.quick else []
    plan = [("baseline", [])] + [(n, LEVERS[n]) for n in names] + [("baseline (again)", [])]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, settings) in enumerate(plan):
            row = run_preset(preset, threads=args.threads, overrides=args.set + extra + settings,
                             out=Path(tmp) / str(i))
            row.update(run=name, settings=" ".join(settings) or "(preset)", s_per_step=row["wall_s"] / row["steps"])
            rows.append(row)
            print(f"{name}: best val {row['best_val_loss']:.4f} in {row['steps']} steps "
                  f"({row['s_per_step']:.3f} s a step)", flush=True)
    base = [r["best_val_loss"] for r in rows if r["run"].startswith("baseline")]
    mean, noise = sum(base) / len(base), abs(base[0] - base[1])
    for r in rows:
        r["delta"] = r["best_val_loss"] - mean
        if not r["run"].startswith("baseline"):
            r["pays"] = "yes" if r["delta"] < -noise else ("no" if r["delta"] > noise else "within noise")
    print()
    print_table(rows, ["run", "settings", "dtype", "steps", "s_per_step", "best_val_loss", "delta", "pays", "run_s"])
    print(f"\ndelta = best val - the baselines' mean ({mean:.4f}); noise = their spread ({noise:.4f}); "
          "'pays' = delta below -noise")
    write_json(args.out, rows, quick=args.quick, threads=args.threads, baseline_mean=mean, noise=noise)
    print(f"wrote {args.out}")
    return rows


def main() -> None:
    p = parser(__doc__.splitlines()[0], "train_levers.json")
    add_arguments(p)
    args = p.parse_args()
    setup(args)
    print_peak(args.threads)
    run_levers(args, run_preset=run_preset)


if __name__ == "__main__":
    main()
