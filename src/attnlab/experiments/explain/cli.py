"""``attnlab explain --list`` and ``attnlab explain NAME --out DIR [--quick] [--seed N]``."""
from __future__ import annotations

import argparse
import time

from attnlab.experiments.explain import EXPERIMENTS, run_experiment


EPILOG = """examples:
  attnlab explain --list                         # the experiments, one line each
  attnlab explain scaling --out runs/scaling     # prints numbers, writes scaling.png/.md/.json
  attnlab explain position --out runs/pos --quick --seed 1"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``attnlab explain`` (the common flags are added by :mod:`attnlab.cli`)."""
    p.add_argument("name", nargs="?", help="experiment to run (see --list)")
    p.add_argument("--list", action="store_true", help="list the experiments and exit")
    p.add_argument("--out", default=None, help="output folder (default: ./attnlab-explain-NAME)")
    p.add_argument("--quick", action="store_true", help="a few-second version (smaller sizes, fewer steps)")


def main(args: argparse.Namespace) -> int:
    """List the experiments, or run one and say where its files are.

    Raises:
        ValueError: neither ``--list`` nor a name, or an unknown name.
    """
    from attnlab._runtime import cpu_float32_only

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
    from attnlab._io import check_output_dir

    check_output_dir("--out", out)  # not a file, not under one, writable: before the experiment runs
    start = time.perf_counter()
    result = run_experiment(args.name, out, seed=args.seed or 0, quick=args.quick)
    print(f"\n{args.name}: done in {time.perf_counter() - start:.1f} s; wrote "
          + ", ".join(result["files"].values()))
    return 0
