"""``attnlab explain --list`` and ``attnlab explain NAME --out DIR [--quick] [--seed N]``."""
from __future__ import annotations

import argparse
import time

from attnlab.experiments.explain import EXPERIMENTS, run_experiment


def main(args: argparse.Namespace) -> int:
    """List the experiments, or run one and say where its files are.

    Raises:
        ValueError: neither ``--list`` nor a name, or an unknown name.
    """
    from attnlab.cli import cpu_float32_only

    cpu_float32_only(args)
    if args.list:
        width = max(map(len, EXPERIMENTS))
        for name, (description, _) in EXPERIMENTS.items():
            print(f"{name.ljust(width)}  {description}")
        return 0
    if not args.name:
        raise ValueError(f"name an experiment ({', '.join(EXPERIMENTS)}) or pass --list")
    if args.name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {args.name!r}; choose one of {', '.join(EXPERIMENTS)}")
    out = args.out or f"attnlab-explain-{args.name}"
    start = time.perf_counter()
    result = run_experiment(args.name, out, seed=args.seed or 0, quick=args.quick)
    print(f"\n{args.name}: done in {time.perf_counter() - start:.1f} s; wrote "
          + ", ".join(result["files"].values()))
    return 0
