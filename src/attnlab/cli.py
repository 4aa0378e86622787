"""The ``attnlab`` command line: a table of subcommand -> module.

Each subcommand's module holds its arguments next to its handler (``HELP``, ``EPILOG``,
``add_arguments(parser)``, ``main(args)``); this file only wires them. User errors (ValueError,
FileNotFoundError) print one line; ``--debug`` shows the traceback.
Every subcommand takes the common flags ``--seed``, ``--threads``, ``--device`` and ``--dtype``
(:func:`common_flags`); :func:`main` applies seed and threads and checks the device, and each
command passes device and dtype to the models it builds or loads.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
from typing import Optional

from attnlab._runtime import cpu_float32_only, model_dtype  # noqa: F401  (their old home; subcommands use _runtime)

# name -> (one-line help, the module that runs it). Each module exports EPILOG (examples),
# add_arguments(parser) and main(args) -> exit code; this file only wires them, adds the common flags,
# and imports only the module of the command being run (`attnlab --help` imports none of them).
COMMANDS = {
    "demo": (
        "train a small encoder-decoder Transformer to reverse digit strings (no download)",
        "attnlab.experiments.demo",
    ),
    "viz": (
        "self-contained HTML head and model views (and PNG heatmaps) of a model's attention on a text",
        "attnlab.viz.cli",
    ),
    "analyze": (
        "per-head attention statistics: entropy, distance, sinks, redundancy, pruning loss",
        "attnlab.evaluation.analyze_cli",
    ),
    "explain": (
        "the classic questions about attention (why sqrt(d_k)? why heads? ...) answered by experiment",
        "attnlab.experiments.explain.cli",
    ),
    "eval": (
        "score outputs against references (BLEU/chrF via sacreBLEU, ROUGE) or a trained checkpoint",
        "attnlab.training.eval_cli",  # text scoring is evaluation/'s; --checkpoint needs the recipes
    ),
    "generate": (
        "continue a prompt (GPT-2, Llama) or answer a source text (T5, BART): greedy, sampling or beam search",
        "attnlab.generate_cli",
    ),
    "train": (
        "train a recipe (e.g. shakespeare-char) with checkpoints, resume and torchrun DDP",
        "attnlab.training.cli",
    ),
    "predict": (
        "classify texts (or text pairs) with a sequence-classification model: labels and probabilities",
        "attnlab.adapt.predict_cli",
    ),
    "bench": (
        "run the benchmarks (ours vs PyTorch / transformers, side by side) and print their tables",
        "attnlab.bench",
    ),
    "env": (
        "what this machine computes natively (ISA, bf16, AMX, measured speed) and the defaults that follow",
        "attnlab.env_cli",
    ),
    "export": (
        "write a BERT encoder or a GPT-2 / Llama decoder (with its KV cache as inputs and outputs) as an ONNX file",
        "attnlab.adapt.export_cli",
    ),
    "rag": (
        "retrieve the passages of a corpus closest to a query (all-MiniLM-L6-v2), optionally generate an answer",
        "attnlab.adapt.rag_cli",
    ),
}


DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_SHORT = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # the names every message prints


def dtype_flag(value: str) -> str:
    """``--dtype``'s value as one of :data:`DTYPES`: the long names, or fp32 / bf16 / fp16 for them."""
    name = DTYPE_SHORT.get(value, value)
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"must be one of auto, fp32, bf16, fp16 (or float32, bfloat16, float16), "
                                         f"got {value!r}")
    return name


def version_line() -> str:
    """``attnlab X.Y.Z``: the version of the code that runs (``attnlab.__version__``, which the package metadata
    is built from; an editable install's metadata may be older than its source)."""
    from attnlab import __version__

    return f"attnlab {__version__}"


def common_flags() -> argparse.ArgumentParser:
    """The flags every subcommand takes (an argparse parent parser)."""
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("common options")
    # --debug is also the main parser's: accepted before or after the subcommand (SUPPRESS: absent here leaves
    # the main parser's value)
    g.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks on errors")
    g.add_argument("--seed", type=int, default=None, help="random seed (default 0)")
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, all cores)")
    g.add_argument("--device", default=None, help="cpu (default), cuda, cuda:1, ...")
    g.add_argument("--dtype", type=dtype_flag, default=None, metavar="{auto,fp32,bf16,fp16}",
                   help="model dtype, also float32/bfloat16/float16 (default float32; auto = bfloat16 where this CPU "
                   "computes it natively and faster, see `attnlab env`; for train: the autocast dtype, default the "
                   "recipe's)")
    return common


def apply_common(args: argparse.Namespace) -> None:
    """Seed torch and ``random``, set the threads, check the device; defaults filled in place.

    Raises:
        ValueError: ``--threads`` outside [1, 1024] (above the cores: a warning), ``--seed`` outside [0, 2**63),
            a device other than cpu / cuda / cuda:N, or one absent on this machine (:mod:`attnlab._limits`).
    """
    import random

    import torch

    from attnlab._limits import check_device, check_seed, check_threads

    check_device("--device", args.device)
    if args.seed is not None:
        check_seed("--seed", args.seed)
    if args.threads is not None:
        check_threads("--threads", args.threads)
        torch.set_num_threads(args.threads)
    seed = 0 if args.seed is None else args.seed  # args.seed stays None: a recipe keeps its own seed
    random.seed(seed)
    torch.manual_seed(seed)


# the arguments that name a file or folder (an empty one would mean the working folder) and those that hold text
# (a name the shell passed as bytes that are not UTF-8 reaches Python as lone surrogates, which no tokenizer takes)
PATH_ARGUMENTS = ("model", "generator", "tokenizer", "out", "png", "hyp", "ref", "file", "corpus", "checkpoint",
                  "image", "init", "reliability_png")
TEXT_ARGUMENTS = ("prompt", "text", "text_b", "src", "tgt", "query", "title")


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse an empty path and text that is not UTF-8, naming the flag.

    Raises:
        ValueError: ``--out ''``, ``--model ''``, ... or a ``--prompt`` / ``--text`` / ... holding bytes that are
            not UTF-8.
    """
    for name in PATH_ARGUMENTS + TEXT_ARGUMENTS:
        value = getattr(args, name, None)
        flag = "--" + name.replace("_", "-")
        for v in value if isinstance(value, list) else [value]:
            if name in PATH_ARGUMENTS and v == "":
                raise ValueError(f"{flag} must name a file or folder, got an empty string")
            if isinstance(v, str):
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise ValueError(f"{flag} is not UTF-8 text (an undecodable byte at character {e.start})") from None


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (``attnlab CMD: error: ...``) and exit 2, like every other
    user error; ``--help`` still prints the full usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    """The ``attnlab`` parser: every subcommand's arguments, or, given ``command``, that one's only
    (the others then have their one-line help but no arguments, and their modules are not imported)."""
    parser = _Parser(
        prog="attnlab", description="Attention mechanisms and Transformers: exact, fast, end to end.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    parser.add_argument("--version", action="version", version=version_line(), help="print attnlab's version")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    common = common_flags()
    for name, (help_, module) in COMMANDS.items():
        if command is not None and name != command:
            sub.add_parser(name, help=help_, description=help_)
            continue
        m = importlib.import_module(module)
        p = sub.add_parser(name, help=help_, description=help_, epilog=m.EPILOG, parents=[common],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        m.add_arguments(p)
    return parser


def _command_in(argv: list[str]) -> str:
    """The subcommand named in ``argv`` (the first word that is not an option), or "" when none is."""
    word = next((a for a in argv if not a.startswith("-")), "")
    return word if word in COMMANDS else ""


def main(argv=None) -> int:
    os.environ.setdefault("MPLBACKEND", "Agg")  # the command line writes figures to files, never opens a window
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(_command_in(argv)).parse_args(argv)
    try:
        apply_common(args)
        check_arguments(args)
        if getattr(args, "model", None) is not None:  # a --model may name a run folder: the training layer reads it
            importlib.import_module("attnlab.training.recipes")
        command = importlib.import_module(COMMANDS[args.command][1])
        return int(command.main(args) or 0)
    except BrokenPipeError:  # `attnlab ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
    except (ValueError, OSError, KeyboardInterrupt) as e:  # a user's mistake: one line, exit 2
        if args.debug:
            raise
        if isinstance(e, KeyboardInterrupt):
            msg = "interrupted"
        elif isinstance(e, OSError) and e.filename is not None and not isinstance(e, FileNotFoundError):
            msg = f"{e.strerror or type(e).__name__}: {e.filename}"  # a folder given for a file, no permission, ...
        else:
            msg = str(e)
        msg = " ".join(msg.split("\n")).strip() or type(e).__name__
        print(f"attnlab {args.command}: error: {msg}", file=sys.stderr)
        return 2
    finally:
        # the interpreter's shutdown collects garbage over every object torch's import made (~1 M): most of a second
        # of each process, a quarter of it with them set aside first — the command is done, nothing is lost (objects
        # are still freed by their counts; only cycles among these are left to the process's end)
        gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
