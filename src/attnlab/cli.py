"""The ``attnlab`` command line: a table of subcommand -> function.

Each entry names its function by import path so that ``attnlab --help`` imports nothing heavy.
User errors (ValueError, FileNotFoundError) print one line; ``--debug`` shows the traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys

DEMO_HELP = """examples:
  attnlab demo                       # train the reversal model, write ./attnlab-demo-<time>/
  attnlab demo --out runs/demo --seed 1
  attnlab demo --max-seconds 60      # a shorter budget"""


def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="output folder (default: a fresh ./attnlab-demo-<time>)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--max-steps", type=int, default=3000, help="training steps at most (default 3000)")
    p.add_argument("--max-seconds", type=float, default=110.0, help="wall-clock budget for training (default 110)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


# name -> (one-line help, epilog, add-arguments function, "module:function" to run)
COMMANDS = {
    "demo": (
        "train a small encoder-decoder Transformer to reverse digit strings (no download)",
        DEMO_HELP, _demo_args, "attnlab.experiments.demo:main",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnlab", description="Attention mechanisms and Transformers: exact, fast, end to end.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (help_, epilog, add_args, _) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_, epilog=epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        add_args(p)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    module, func = COMMANDS[args.command][3].split(":")
    fn = getattr(importlib.import_module(module), func)
    try:
        return int(fn(args) or 0)
    except (ValueError, FileNotFoundError, KeyboardInterrupt) as e:
        if args.debug:
            raise
        msg = "interrupted" if isinstance(e, KeyboardInterrupt) else str(e)
        print(f"attnlab {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
