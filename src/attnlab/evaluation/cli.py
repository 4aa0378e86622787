"""``attnlab eval``: score a hypothesis file against reference file(s), or a trained checkpoint.

Text mode: one segment per line, detokenised; BLEU/chrF are sacreBLEU's corpus scores (with their
signatures), ROUGE is rouge-score's mean F1. Checkpoint mode hands the folder to
``attnlab.training.recipes.evaluate_checkpoint`` (the recipe knows its data and metrics).
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import re
from pathlib import Path

from attnlab._io import atomic_write, check_output_file, read_text_arg

TEXT_METRICS = ("bleu", "chrf", "rouge")
DEFAULT_METRICS = "bleu,chrf"


def _parse_metrics(spec: str | None, *, allowed: tuple[str, ...] | None) -> list[str] | None:
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
    """Lines of a UTF-8 text file, stripped. Raises FileNotFoundError / ValueError naming the argument."""
    return [line.strip() for line in read_text_arg(what, path).splitlines()]


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


def _checkpoint_scores(args: argparse.Namespace) -> dict:
    try:
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
    wanted = {"device": args.device, "metrics": _parse_metrics(args.metrics, allowed=None), "split": args.split,
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


def format_table(scores: dict) -> str:
    """Two columns, metric and value; signatures listed below the table."""
    rows = [(k, f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in scores.items()
            if not k.endswith("_signature") and isinstance(v, (int, float, str))]
    w = max([len("metric")] + [len(k) for k, _ in rows])
    lines = [f"{'metric':<{w}}  value", f"{'-' * w}  {'-' * 10}"] + [f"{k:<{w}}  {v}" for k, v in rows]
    lines += [f"{k}: {v}" for k, v in scores.items() if k.endswith("_signature")]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Run ``attnlab eval``; returns 0. User errors raise ValueError/FileNotFoundError."""
    if args.dtype not in (None, "float32", "auto"):
        raise ValueError(f"attnlab eval scores in float32; --dtype {args.dtype} is not supported")
    for flag, value in (("--out", args.out), ("--reliability-png", args.reliability_png)):
        if value is not None:
            check_output_file(flag, value, inputs=[("--hyp", args.hyp), *(("--ref", r) for r in args.ref)])
    if args.checkpoint is not None:
        if args.hyp is not None or args.ref:
            raise ValueError("give either --checkpoint or --hyp/--ref, not both")
        scores = _checkpoint_scores(args)
    else:
        if args.hyp is None or not args.ref:
            raise ValueError("give --hyp FILE and --ref FILE (or --checkpoint DIR)")
        for opt in ("device", "split", "max_batches", "reliability_png"):
            if getattr(args, opt) is not None:
                raise ValueError(f"--{opt.replace('_', '-')} applies to --checkpoint only")
        metrics = _parse_metrics(args.metrics or DEFAULT_METRICS, allowed=TEXT_METRICS)
        scores = score_files(args.hyp, args.ref, metrics, tokenize=args.tokenize)
    print(format_table(scores))
    if args.out:
        clean = {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in scores.items()}
        text = json.dumps(clean, indent=2, default=str) + "\n"
        atomic_write(Path(args.out), lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return 0
