"""Evaluation metrics, computed with the field's own tools where they exist.

- :func:`perplexity`, :func:`accuracy` — language modelling / masked LM.
- :func:`bleu`, :func:`chrf` — corpus-level sacreBLEU on detokenised, cased text (0–100), returned with
  sacreBLEU's signature string so that scores are reproducible and comparable.
- :func:`rouge` — ROUGE-1/2/L F1 (0–1) from Google's ``rouge-score``.
- :func:`expected_calibration_error`, :func:`calibration_bins`, :func:`reliability_diagram` — calibration.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from attnlab._checks import boolean, int_at_least, is_real, positive_int
from attnlab._io import atomic_write

__all__ = ["MetricScore", "perplexity", "accuracy", "bleu", "chrf", "rouge", "calibration_bins",
           "expected_calibration_error", "reliability_diagram"]

References = Union[Sequence[str], Sequence[Sequence[str]]]


class MetricScore(NamedTuple):
    """A corpus score and the sacreBLEU signature that makes it reproducible (``score, sig = bleu(...)``)."""

    score: float
    signature: str


def perplexity(mean_nll: Union[float, Tensor]) -> float:
    """``PPL = exp(mean NLL)`` (natural log); ``inf`` past float range.

    Raises:
        ValueError: NaN or a negative mean NLL.
    """
    if isinstance(mean_nll, Tensor) and mean_nll.numel() == 1 and mean_nll.is_floating_point():
        mean_nll = mean_nll.item()
    if not is_real(mean_nll) or math.isnan(mean_nll) or mean_nll < 0:
        raise ValueError(f"mean_nll must be a non-negative number (or a one-element float tensor), got {mean_nll!r}")
    x = float(mean_nll)
    return math.exp(x) if x < 709.0 else math.inf


def accuracy(logits: Tensor, targets: Tensor, ignore_index: Optional[int] = -100) -> float:
    """``mean_{t : target_t ≠ ignore_index} [argmax_v logits_{t,v} = target_t]``.

    Args:
        logits: ``(..., V)`` scores.
        targets: ``(...)`` class ids; positions equal to ``ignore_index`` are skipped.

    Raises:
        ValueError: shapes disagree, targets are not integer ids in ``[0, V)`` (``ignore_index`` aside), logits hold
            NaN, or no position is scored.
    """
    if not isinstance(logits, Tensor) or not isinstance(targets, Tensor):
        raise TypeError("logits and targets must be tensors")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits (..., V) and targets (...) disagree: {tuple(logits.shape)} vs {tuple(targets.shape)}")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer class ids, got {targets.dtype}")
    scored = targets[targets != ignore_index] if ignore_index is not None else targets
    if scored.numel() and (int(scored.min()) < 0 or int(scored.max()) >= logits.shape[-1]):
        raise ValueError(f"targets must lie in [0, V={logits.shape[-1]}) (or equal ignore_index={ignore_index}), got "
                         f"values in [{int(scored.min())}, {int(scored.max())}]")
    if torch.isnan(logits).any():
        raise ValueError("logits hold NaN: no class can be predicted from them")
    keep = targets != ignore_index if ignore_index is not None else torch.ones_like(targets, dtype=torch.bool)
    if not keep.any():
        raise ValueError("no target to score (all equal ignore_index)")
    return (logits.argmax(-1) == targets)[keep].double().mean().item()


# The longest segment (one line of --hyp / --ref) the text metrics take, in characters: sentences and paragraphs
# are far shorter; a whole file on one line is a mistake that would otherwise run for hours.
MAX_SEGMENT_CHARS = 100_000
# ROUGE-L fills a table of (hypothesis tokens x reference tokens) cells per segment in Python: 5,000 tokens a side
# is 25 M cells (~200 MB, seconds); a 2 MB line would ask for terabytes.
MAX_ROUGE_TOKENS = 5_000


def _check_text(hyps: Sequence[str], refs: References) -> list[list[str]]:
    """Validate and return the references as sacreBLEU streams: ``streams[k][i]`` = k-th reference of hyp i.

    Raises:
        ValueError: no hypotheses, a count mismatch, or a segment longer than :data:`MAX_SEGMENT_CHARS`.
    """
    if not isinstance(hyps, Sequence) or isinstance(hyps, (str, bytes)) or not all(isinstance(h, str) for h in hyps):
        raise TypeError(f"hyps must be a sequence (list or tuple) of strings, got {type(hyps).__name__}")
    if len(hyps) == 0:
        raise ValueError("hyps must not be empty")
    if not isinstance(refs, Sequence) or isinstance(refs, bytes):
        raise TypeError(f"refs must be a sequence (list or tuple): one reference or list of references per "
                        f"hypothesis, got {type(refs).__name__}")
    if isinstance(refs, str) or len(refs) != len(hyps):
        raise ValueError(f"refs must have one entry per hypothesis ({len(hyps)}), got "
                         f"{'a string' if isinstance(refs, str) else len(refs)}")
    if all(isinstance(r, str) for r in refs):
        streams = [list(refs)]
    else:
        if not all(isinstance(r, (list, tuple)) and r and all(isinstance(x, str) for x in r) for r in refs):
            raise TypeError("refs must be strings (one reference each) or lists of strings (several each)")
        n = len(refs[0])
        if any(len(r) != n for r in refs):
            raise ValueError("every hypothesis must have the same number of references")
        streams = [[r[k] for r in refs] for k in range(n)]
    for what, stream in (("hypothesis", hyps), *(("reference", s) for s in streams)):
        for i, text in enumerate(stream):
            if len(text) > MAX_SEGMENT_CHARS:
                raise ValueError(f"{what} {i + 1} (line {i + 1}) holds {len(text):,} characters; a segment may hold "
                                 f"at most {MAX_SEGMENT_CHARS:,} (one sentence or paragraph per line)")
    return streams


def _check_rouge_lengths(hyps: Sequence[str], streams: list[list[str]]) -> None:
    """Each segment within :data:`MAX_ROUGE_TOKENS` of ROUGE's tokens (lowercased runs of ``[a-z0-9]``)."""
    import re

    for what, stream in (("hypothesis", hyps), *(("reference", s) for s in streams)):
        for i, text in enumerate(stream):
            n = len(re.findall(r"[a-z0-9]+", text.lower()))
            if n > MAX_ROUGE_TOKENS:
                raise ValueError(f"ROUGE: {what} {i + 1} (line {i + 1}) holds {n:,} tokens; ROUGE-L's table grows "
                                 f"with the product of the lengths, so a segment may hold at most "
                                 f"{MAX_ROUGE_TOKENS:,}")


# The highest n-gram order the text metrics take: an order beyond any segment's length only zeroes its precisions.
MAX_NGRAM_ORDER = 100


def _check_orders(options: dict, **least: int) -> None:
    """The integer options of sacreBLEU's metrics (``max_ngram_order``, ``char_order``, ``word_order``, ``beta``), when
    given, within ``[least, MAX_NGRAM_ORDER]``: sacreBLEU would score a 0 or negative order without a word."""
    for name, low in least.items():
        if name in options:
            value = options[name]
            int_at_least(name, value, low)
            if value > MAX_NGRAM_ORDER:
                raise ValueError(f"{name} must be an int in [{low}, {MAX_NGRAM_ORDER}], got {value!r}")


def _metric(cls, options: dict):
    """``cls(**options)`` (a sacreBLEU metric), its refusals of an option (an unknown tokenizer is a KeyError, an
    unknown smoothing an AssertionError there) as one ValueError naming the options."""
    try:
        return cls(**options)
    except TypeError:
        raise
    except (ValueError, KeyError, AssertionError) as e:
        raise ValueError(f"{cls.__name__} options {options} are not valid: {e}") from None


def bleu(hyps: Sequence[str], refs: References, **options) -> MetricScore:
    """Corpus BLEU with sacreBLEU (defaults: 13a tokenisation, cased, exponential smoothing).

    ``BLEU = BP · exp(¼ Σ_{n=1..4} log p_n)``, ``BP = min(1, exp(1 − r/c))`` with ``p_n`` the clipped
    n-gram precisions and ``r``/``c`` the reference/hypothesis lengths, all pooled over the corpus.

    Args:
        hyps: detokenised system outputs.
        refs: one reference per hypothesis, or a list of references per hypothesis.
        **options: passed to ``sacrebleu.metrics.BLEU`` (e.g. ``tokenize="intl"``, ``lowercase=True``).

    Returns:
        ``MetricScore(score in [0, 100], signature)``.
    """
    from sacrebleu.metrics import BLEU

    _check_orders(options, max_ngram_order=1)
    metric = _metric(BLEU, options)
    streams = _check_text(hyps, refs)
    return MetricScore(metric.corpus_score(list(hyps), streams).score, str(metric.get_signature()))


def chrf(hyps: Sequence[str], refs: References, **options) -> MetricScore:
    """Corpus chrF (character n-gram F-score, β = 2, n ≤ 6) with sacreBLEU; ``word_order=2`` gives chrF++.

    Returns:
        ``MetricScore(score in [0, 100], signature)``.
    """
    from sacrebleu.metrics import CHRF

    _check_orders(options, char_order=1, word_order=0, beta=0)
    metric = _metric(CHRF, options)
    streams = _check_text(hyps, refs)
    return MetricScore(metric.corpus_score(list(hyps), streams).score, str(metric.get_signature()))


def rouge(hyps: Sequence[str], refs: References, *, use_stemmer: bool = False) -> dict[str, float]:
    """Mean ROUGE-1, ROUGE-2 and ROUGE-L F1 over the corpus with ``rouge-score`` (best reference per hypothesis).

    Returns:
        ``{"rouge1": f, "rouge2": f, "rougeL": f}``, each in ``[0, 1]``.
    """
    from rouge_score import rouge_scorer

    boolean("use_stemmer", use_stemmer)
    streams = _check_text(hyps, refs)
    _check_rouge_lengths(hyps, streams)
    names = ("rouge1", "rouge2", "rougeL")
    scorer = rouge_scorer.RougeScorer(list(names), use_stemmer=use_stemmer)
    totals = dict.fromkeys(names, 0.0)
    for i, h in enumerate(hyps):
        scores = scorer.score_multi([s[i] for s in streams], h)
        for n in names:
            totals[n] += scores[n].fmeasure
    return {n: totals[n] / len(hyps) for n in names}


def _confidences(probs_or_logits, targets, *, from_logits: Optional[bool], ignore_index: Optional[int]):
    """Return ``(confidence (N,), correct (N,))`` in float64 from ``(N, C)`` or binary ``(N,)`` inputs."""
    x = torch.as_tensor(probs_or_logits).detach().to(torch.float64).cpu()
    t = torch.as_tensor(targets).detach().cpu()
    if x.dim() not in (1, 2) or t.shape != x.shape[:1] or t.dtype.is_floating_point:
        raise ValueError(f"expected probs/logits (N, C) or (N,) and integer targets (N,), got {tuple(x.shape)} and "
                         f"{tuple(t.shape)} {t.dtype}")
    if ignore_index is not None:
        keep = t != ignore_index
        x, t = x[keep], t[keep]
    if not torch.isfinite(x).all():
        raise ValueError("probs_or_logits contains NaN or inf")
    if t.numel() == 0:
        raise ValueError("no example to score")
    if from_logits is None:  # probabilities if they look like them
        ok = (x >= 0).all() and (x <= 1).all()
        from_logits = not (ok and (x.dim() == 1 or torch.allclose(x.sum(-1), torch.ones((), dtype=x.dtype), atol=1e-4)))
    if x.dim() == 1:  # binary: x is P(class 1)
        p1 = torch.sigmoid(x) if from_logits else x
        return torch.maximum(p1, 1 - p1), ((p1 >= 0.5).long() == t).double()
    p = torch.softmax(x, -1) if from_logits else x
    conf, pred = p.max(-1)
    return conf, (pred == t).double()


def calibration_bins(probs_or_logits, targets, *, n_bins: int = 15, from_logits: Optional[bool] = None,
                     ignore_index: Optional[int] = None) -> dict:
    """Per-bin counts, accuracy and mean confidence over ``n_bins`` equal-width confidence bins.

    Bin ``b`` holds predictions with confidence ``conf = max_c p_c`` in ``(b/n_bins, (b+1)/n_bins]``.

    Args:
        probs_or_logits: ``(N, C)`` probabilities or logits (or ``(N,)`` for binary, P(class 1)); rows that
            are non-negative and sum to 1 are read as probabilities unless ``from_logits`` says otherwise.
        targets: ``(N,)`` class ids.
        ignore_index: targets with this value are skipped.

    Returns:
        ``{"edges": [n_bins+1], "count": [n_bins], "accuracy": [n_bins], "confidence": [n_bins], "ece": float}``
        (empty bins have accuracy and confidence 0).
    """
    positive_int("n_bins", n_bins)
    conf, correct = _confidences(probs_or_logits, targets, from_logits=from_logits, ignore_index=ignore_index)
    idx = (torch.ceil(conf * n_bins).long() - 1).clamp(0, n_bins - 1)  # (N,)
    count = torch.bincount(idx, minlength=n_bins).double()
    acc_sum = torch.bincount(idx, weights=correct, minlength=n_bins)
    conf_sum = torch.bincount(idx, weights=conf, minlength=n_bins)
    safe = count.clamp(min=1)
    ece = ((acc_sum - conf_sum).abs().sum() / conf.numel()).item()  # Σ_b |B_b|/n · |acc_b − conf_b|
    edges = torch.linspace(0, 1, n_bins + 1, dtype=torch.float64)
    return {"edges": edges.tolist(), "count": count.long().tolist(),
            "accuracy": (acc_sum / safe).tolist(), "confidence": (conf_sum / safe).tolist(), "ece": ece}


def expected_calibration_error(probs_or_logits, targets, *, n_bins: int = 15, from_logits: Optional[bool] = None,
                               ignore_index: Optional[int] = None) -> float:
    """Expected calibration error (Guo et al., 2017) over equal-width confidence bins:

        ``ECE = Σ_b |B_b|/n · |acc(B_b) − conf(B_b)|``

    where ``B_b`` are the predictions whose confidence ``max_c p_c`` falls in ``(b/n_bins, (b+1)/n_bins]``,
    ``acc`` their accuracy and ``conf`` their mean confidence. Arguments as :func:`calibration_bins`.

    Returns:
        ECE in ``[0, 1]``.
    """
    return calibration_bins(probs_or_logits, targets, n_bins=n_bins, from_logits=from_logits,
                            ignore_index=ignore_index)["ece"]


def reliability_diagram(probs_or_logits, targets, path: Union[str, os.PathLike], *, n_bins: int = 15,
                        from_logits: Optional[bool] = None, ignore_index: Optional[int] = None,
                        title: str = "Reliability diagram") -> float:
    """Write a reliability diagram PNG (accuracy per confidence bin against the diagonal, and how many
    predictions fall in each bin) to ``path`` atomically, with matplotlib's Agg backend.

    Returns:
        the ECE shown in the figure.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    bins = calibration_bins(probs_or_logits, targets, n_bins=n_bins, from_logits=from_logits,
                            ignore_index=ignore_index)
    width = 1.0 / n_bins
    left = bins["edges"][:-1]
    fig = Figure(figsize=(5, 6.5))
    FigureCanvasAgg(fig)
    ax, ax_n = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax.bar(left, bins["accuracy"], width=width, align="edge", edgecolor="black", label="accuracy")
    gaps = [c - a if n else 0.0 for a, c, n in zip(bins["accuracy"], bins["confidence"], bins["count"])]
    ax.bar(left, gaps, bottom=bins["accuracy"], width=width, align="edge", color="tab:red", alpha=0.3,
           label="gap to confidence")
    ax.plot([0, 1], [0, 1], "k--", label="perfect calibration")
    ax.set(ylabel="accuracy", xlim=(0, 1), ylim=(0, 1), title=f"{title} (ECE = {bins['ece']:.4f})")
    ax.legend(loc="upper left")
    ax_n.bar(left, bins["count"], width=width, align="edge", edgecolor="black", color="tab:gray")
    ax_n.set(xlabel="confidence", ylabel="count")
    fig.tight_layout()
    atomic_write(Path(path), lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    return bins["ece"]
