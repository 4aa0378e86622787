"""``attnlab eval``: score a hypothesis file against reference file(s), or a trained checkpoint.

Text mode: one segment per line, detokenised; BLEU/chrF are sacreBLEU's corpus scores (with their
signatures), ROUGE is rouge-score's mean F1. Checkpoint mode needs a training run's recipe, which
sits above this package: the command is wired through :mod:`attnlab.training.eval_cli`, which
passes its ``checkpoint_scores`` to :func:`main`.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Callable, Optional

from attnlab._io import atomic_write, check_output_file, read_text_arg, text_lines

TEXT_METRICS = ("bleu", "chrf", "rouge")
DEFAULT_METRICS = "bleu,chrf"


def parse_metrics(spec: str | None, *, allowed: tuple[str, ...] | None) -> list[str] | None:
    """``--metrics a,b`` as a list without repeats (None when not given); names outside ``allowed`` are refused."""
    if spec is None:
        return None
    names = [m.strip().lower() for m in spec.split(",") if m.strip()]
    if not names:
        raise ValueError("--metrics must name at least one metric")
    if allowed is not None:
        bad = [m for m in names if m not in allowed]
        if bad:
            raise ValueError(f"--metrics: unknown metric {bad[0]!r}; valid: {', '.join(allowed)}")
    return list(dict.fromkeys(names))


def read_lines(path: str, what: str) -> list[str]:
    """Lines of a UTF-8 text file as sacreBLEU reads them (:func:`~attnlab._io.text_lines`: split at ``"\n"`` only,
    no byte-order mark), stripped. Raises FileNotFoundError / ValueError naming the argument."""
    return [line.strip() for line in text_lines(read_text_arg(what, path))]


def score_files(hyp: str, refs: list[str], metrics: list[str], *, tokenize: str = "13a") -> dict:
    """Score ``hyp`` against one or more reference files. Returns a flat dict (scores + signatures)."""
    from sacrebleu.metrics import BLEU

    from attnlab.evaluation import metrics as M

    if tokenize not in BLEU.TOKENIZERS:
        raise ValueError(f"--tokenize must be one of {', '.join(BLEU.TOKENIZERS)}, got {tokenize!r}")
    hyps = read_lines(hyp, "--hyp")
    ref_lines = [read_lines(r, "--ref") for r in refs]
    for r, lines in zip(refs, ref_lines):
        if len(lines) != len(hyps):
            raise ValueError(f"--hyp {hyp} has {len(hyps)} lines but --ref {r} has {len(lines)}")
    per_hyp = [list(rs) for rs in zip(*ref_lines)] if len(refs) > 1 else ref_lines[0]
    out: dict = {"segments": len(hyps)}
    for m in metrics:
        if m == "bleu":
            out["bleu"], out["bleu_signature"] = M.bleu(hyps, per_hyp, tokenize=tokenize)
        elif m == "chrf":
            out["chrf"], out["chrf_signature"] = M.chrf(hyps, per_hyp)
        elif m == "rouge":
            out.update(M.rouge(hyps, per_hyp))
    return out


def format_table(scores: dict) -> str:
    """Two columns, metric and value; signatures listed below the table."""
    rows = [(k, f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in scores.items()
            if not k.endswith("_signature") and isinstance(v, (int, float, str))]
    w = max([len("metric")] + [len(k) for k, _ in rows])
    lines = [f"{'metric':<{w}}  value", f"{'-' * w}  {'-' * 10}"] + [f"{k:<{w}}  {v}" for k, v in rows]
    lines += [f"{k}: {v}" for k, v in scores.items() if k.endswith("_signature")]
    return "\n".join(lines)


EPILOG = """examples:
  attnlab eval --hyp out.en --ref test.en                    # sacreBLEU BLEU + chrF, cased, detokenised
  attnlab eval --hyp out.en --ref ref1.en --ref ref2.en --metrics bleu,chrf,rouge --out scores.json
  attnlab eval --checkpoint runs/shakespeare                 # perplexity/accuracy of a trained run
  attnlab eval --checkpoint runs/m30k --split test_2016_flickr --reliability-png calib.png"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``attnlab eval`` (the common flags are added by :mod:`attnlab.cli`)."""
    p.add_argument("--hyp", default=None, help="system outputs, one detokenised segment per line (UTF-8)")
    p.add_argument("--ref", action="append", default=[], help="references, line-aligned with --hyp (repeatable)")
    p.add_argument("--metrics", default=None, help="comma-separated: bleu, chrf, rouge (default bleu,chrf); with "
                   "--checkpoint, passed to the recipe's evaluation")
    p.add_argument("--tokenize", default="13a", help="sacreBLEU tokenizer for BLEU (default 13a)")
    p.add_argument("--checkpoint", default=None, metavar="DIR", help="score a training run's latest checkpoint")
    p.add_argument("--split", default=None, help="with --checkpoint: data split to score (recipe default)")
    p.add_argument("--max-batches", type=int, default=None, help="with --checkpoint: score at most this many batches")
    p.add_argument("--reliability-png", default=None, help="with --checkpoint: write a reliability diagram here")
    p.add_argument("--out", default=None, help="also write the scores as JSON to this file")


def main(args: argparse.Namespace, *, checkpoint_scores: Optional[Callable[[argparse.Namespace], dict]] = None) -> int:
    """Run ``attnlab eval``; returns 0. User errors raise ValueError/FileNotFoundError.

    ``checkpoint_scores(args) -> dict`` scores ``--checkpoint`` (given by
    :mod:`attnlab.training.eval_cli`); without it ``--checkpoint`` is refused.
    """
    if args.dtype not in (None, "float32", "auto"):
        raise ValueError(f"attnlab eval scores in float32; --dtype {args.dtype} is not supported")
    from attnlab.data.datasets import dataset_files

    inputs = [("--hyp", args.hyp), *(("--ref", r) for r in args.ref), ("--checkpoint", args.checkpoint)]
    if args.checkpoint is not None:  # its recipe reads a dataset
        inputs += dataset_files()
    if args.checkpoint is not None and Path(args.checkpoint).is_file():  # one ckpt-*.pt: its run is read too
        inputs.append(("the run of --checkpoint", Path(args.checkpoint).parent))
    if args.out is not None and args.reliability_png is not None and \
            Path(args.out).resolve() == Path(args.reliability_png).resolve():
        raise ValueError(f"--reliability-png {args.reliability_png} is also --out: give two different files")
    for flag, value in (("--out", args.out), ("--reliability-png", args.reliability_png)):
        if value is not None:
            check_output_file(flag, value, inputs=inputs)
    if args.checkpoint is not None:
        if args.hyp is not None or args.ref:
            raise ValueError("give either --checkpoint or --hyp/--ref, not both")
        if checkpoint_scores is None:
            raise ValueError("scoring a --checkpoint needs attnlab.training (run it as `attnlab eval`)")
        scores = checkpoint_scores(args)
    else:
        if args.hyp is None or not args.ref:
            raise ValueError("give --hyp FILE and --ref FILE (or --checkpoint DIR)")
        for opt in ("device", "split", "max_batches", "reliability_png"):
            if getattr(args, opt) is not None:
                raise ValueError(f"--{opt.replace('_', '-')} applies to --checkpoint only")
        metrics = parse_metrics(DEFAULT_METRICS if args.metrics is None else args.metrics, allowed=TEXT_METRICS)
        scores = score_files(args.hyp, args.ref, metrics, tokenize=args.tokenize)
    print(format_table(scores))
    if args.out:
        clean = {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in scores.items()}
        text = json.dumps(clean, indent=2, default=str) + "\n"
        atomic_write(Path(args.out), lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return 0
