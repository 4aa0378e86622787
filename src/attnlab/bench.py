"""``attnlab bench``: run the benchmark scripts of a source checkout and print their tables.

The scripts live in ``benchmarks/`` beside ``src/`` (they compare attnlab with its peers —
PyTorch SDPA, ``torch.nn.MultiheadAttention``, ``transformers``, sentence-transformers — in the same
run, print a table of ratios and write JSON under ``benchmarks/results/``). Each shares the flags
``--quick`` (small sizes), ``--threads N`` and ``--out FILE``; ``--script-args`` passes more.
"""
from __future__ import annotations

import argparse
import ast
import os
import shlex
import subprocess
import sys
from pathlib import Path


def benchmarks_dir() -> Path:
    """``$ATTNLAB_BENCHMARKS_DIR``, else the ``benchmarks/`` folder of this source checkout.

    Raises:
        FileNotFoundError: neither exists (an installed wheel carries no benchmarks).
    """
    env = os.environ.get("ATTNLAB_BENCHMARKS_DIR")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "benchmarks"
    if not path.is_dir():
        raise FileNotFoundError(f"no benchmarks folder at {path}: attnlab bench runs the scripts of a source "
                                "checkout (git clone), or set ATTNLAB_BENCHMARKS_DIR")
    return path


def available() -> dict[str, str]:
    """``{name: first line of the script's docstring}`` for every ``benchmarks/NAME.py``."""
    out = {}
    for script in sorted(benchmarks_dir().glob("[!_]*.py")):
        doc = ast.get_docstring(ast.parse(script.read_text(encoding="utf-8"))) or ""
        out[script.stem] = doc.strip().splitlines()[0] if doc.strip() else ""
    return out


class _Help(argparse._HelpAction):
    """``--help`` after one benchmark's name (``attnlab bench train --help``): that script's own usage, its flags;
    otherwise this command's."""

    def __call__(self, parser, namespace, values, option_string=None):
        names = getattr(namespace, "names", None) or []
        try:
            script = benchmarks_dir() / f"{names[0]}.py" if len(names) == 1 and names[0] in available() else None
        except FileNotFoundError:  # no benchmarks folder: this command's usage says what it needs
            script = None
        if script is None:
            parser.print_help()
            parser.exit()
        parser.exit(subprocess.run([sys.executable, str(script), "--help"]).returncode)


EPILOG = """examples:
  attnlab bench --list                               # the benchmark scripts, one line each
  attnlab bench train --help                         # one benchmark's own flags (pass them with --script-args)
  attnlab bench                                      # attention: ours vs SDPA / torch MHA, as ratios
  attnlab bench generate encode --threads 2          # GPT-2 decoding, BERT / MiniLM encoding vs transformers
  attnlab bench attention --quick --script-args "--suite efficient"
  attnlab bench --report                             # regenerate docs/performance.md from benchmarks/results/
Needs the benchmarks/ folder of a source checkout; tables print; a full run's JSON goes to benchmarks/results/runs/
and its summary into benchmarks/results/<cpu class>.json, from which --report generates docs/performance.md."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``attnlab bench`` (the common flags are added by :mod:`attnlab.cli`)."""
    for action in p._actions:  # argparse's --help, made ours: after a benchmark's name it shows that script's usage
        if isinstance(action, argparse._HelpAction):
            action.__class__ = _Help
    p.add_argument("names", nargs="*", help="benchmarks to run (default: attention); see --list")
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    p.add_argument("--report", action="store_true",
                   help="regenerate docs/performance.md from benchmarks/results/*.json (after any benchmarks named)")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run of seconds")
    p.add_argument("--script-args", default="", help="more arguments for the scripts, quoted")


def main(args) -> int:
    """Run the chosen benchmarks one after another (default: ``attention``); exit 1 if any failed."""
    from attnlab._runtime import cpu_float32_only

    cpu_float32_only(args)
    names = available()
    if args.list:
        width = max(map(len, names), default=0)
        for name, line in names.items():
            print(f"{name:<{width}}  {line}")
        return 0
    chosen = args.names or ([] if args.report else ["attention"])
    unknown = [n for n in chosen if n not in names]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {unknown}; available: {', '.join(names)}")
    failed = []
    for name in chosen:
        cmd = [sys.executable, str(benchmarks_dir() / f"{name}.py")]
        cmd += ["--quick"] if args.quick else []
        cmd += ["--threads", str(args.threads)] if args.threads is not None else []
        cmd += shlex.split(args.script_args or "")
        print(f"== attnlab bench {name}: {' '.join(cmd[1:])}", flush=True)
        if subprocess.run(cmd).returncode != 0:
            failed.append(name)
    if args.report and subprocess.run([sys.executable, str(benchmarks_dir() / "_report.py")]).returncode != 0:
        failed.append("_report.py")
    if failed:
        print(f"attnlab bench: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
