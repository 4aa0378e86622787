"""``attnlab eval``, wired next to the recipes: text scoring is :mod:`attnlab.evaluation.cli`'s; a
``--checkpoint`` is scored by the run's recipe (:func:`checkpoint_scores`), which is why the command's
entry point lives here and not in ``evaluation/`` (a lower layer than ``training/``).
"""
from __future__ import annotations

import argparse
import inspect
import re
from pathlib import Path

from attnlab.evaluation import cli as _text
from attnlab.evaluation.cli import EPILOG, add_arguments, parse_metrics

__all__ = ["EPILOG", "add_arguments", "main", "checkpoint_scores"]


def checkpoint_scores(args: argparse.Namespace) -> dict:
    """Score ``--checkpoint`` (a run folder, or one ``ckpt-*.pt`` of a run) with its recipe's
    ``evaluate_checkpoint``, passing on the flags it takes; a flag it does not take is refused."""
    try:  # the recipes: imported only when asked for
        from attnlab.training.recipes import evaluate_checkpoint
    except ImportError as e:
        raise ValueError(f"scoring a --checkpoint needs attnlab.training.recipes.evaluate_checkpoint from the "
                         f"training package, which is not available ({e})") from None
    ckpt, single = Path(args.checkpoint), None
    if ckpt.is_file() and re.fullmatch(r"ckpt-\d{8,}\.pt", ckpt.name):
        ckpt, single = ckpt.parent, ckpt  # one checkpoint of a run: scored with its run's settings
    elif ckpt.is_file():
        raise ValueError(f"--checkpoint {ckpt} is a file: give a run's output folder or one of its ckpt-*.pt")
    elif not ckpt.is_dir():
        raise FileNotFoundError(f"--checkpoint: no such folder {ckpt}")
    wanted = {"device": args.device, "metrics": parse_metrics(args.metrics, allowed=None), "split": args.split,
              "max_batches": args.max_batches, "reliability_png": args.reliability_png}
    params = inspect.signature(evaluate_checkpoint).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {}
    for name, value in wanted.items():
        if value is None:
            continue
        if name not in params and not takes_any:
            raise ValueError(f"--{name.replace('_', '-')} is not supported by this checkpoint's evaluation")
        kwargs[name] = value
    result = evaluate_checkpoint(ckpt, **kwargs) if single is None else evaluate_checkpoint(ckpt, checkpoint=single,
                                                                                             **kwargs)
    if not isinstance(result, dict):
        raise ValueError(f"evaluate_checkpoint returned {type(result).__name__}, expected a dict of metrics")
    return result


def main(args: argparse.Namespace) -> int:
    """Run ``attnlab eval`` (see :func:`attnlab.evaluation.cli.main`) with checkpoint scoring."""
    return _text.main(args, checkpoint_scores=checkpoint_scores)
