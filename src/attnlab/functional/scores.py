"""Scoring helpers shared by the classic attention modules (scores that are not dot products).

``score_attention`` takes any ``(B, Lq, Lk)`` score tensor through the pipeline's mask and
normaliser stages: ``weights = normalize(mask(scores))``, ``context = weights @ values``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from attnlab._checks import one_of, positive_int
from attnlab.functional.normalize import NORMALIZERS


def check_normalize(normalize: str, top_k: Optional[int]) -> None:
    """Validate a ``normalize`` name from :data:`NORMALIZERS` and its ``top_k``."""
    one_of("normalize", normalize, sorted(NORMALIZERS))
    if normalize == "topk":
        positive_int("top_k (with normalize='topk')", top_k)
    elif top_k is not None:
        raise ValueError(f"top_k is only used with normalize='topk' (normalize={normalize!r})")


def prepare_inputs(
    query: Tensor,
    keys: Tensor,
    values: Optional[Tensor],
    mask: Optional[Tensor],
    *,
    query_dim: int,
    key_dim: int,
    value_dim: int,
    step_only: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor], bool]:
    """Check shapes and bring the inputs to batch-first 3-D form.

    Args:
        query: ``(B, Lq, Dq)``, or ``(B, Dq)`` for one decoder step (the only form when
            ``step_only``).
        keys: ``(B, Lk, Dk)``.
        values: ``(B, Lk, Dv)`` or ``None`` (the keys are the values).
        mask: bool, True = may attend, broadcastable to ``(B, Lq, Lk)``; a 2-D mask is read as
            ``(B, Lk)`` (one row of key padding per sequence).

    Returns:
        ``(query (B, Lq, Dq), keys, values, mask (B, Lq, Lk) or None, one_step)``, where
        ``one_step`` says the query came without its ``Lq`` axis (squeeze it off the results).

    Raises:
        TypeError: a non-tensor input, or a mask that is not bool.
        ValueError: wrong ranks, feature sizes, batch sizes, lengths or mask shape.
    """
    values = keys if values is None else values
    for name, t in (("query", query), ("keys", keys), ("values", values)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    ranks = (2,) if step_only else (2, 3)
    if query.dim() not in ranks:
        want = "(B, Dq)" if step_only else "(B, Lq, Dq) or (B, Dq)"
        raise ValueError(f"query must have shape {want}, got {tuple(query.shape)}")
    for name, t in (("keys", keys), ("values", values)):
        if t.dim() != 3:
            raise ValueError(f"{name} must have shape (B, Lk, D), got {tuple(t.shape)}")
    one_step = query.dim() == 2
    q = query.unsqueeze(1) if one_step else query  # (B, Lq, Dq)
    for name, got, want in (("query", q.shape[-1], query_dim), ("keys", keys.shape[-1], key_dim),
                            ("values", values.shape[-1], value_dim)):
        if got != want:
            raise ValueError(f"{name} last dim must be {want}, got {got}")
    B, Lq, Lk = q.shape[0], q.shape[1], keys.shape[1]
    if Lk == 0:
        raise ValueError(f"keys must hold at least one position (Lk >= 1), got shape {tuple(keys.shape)}")
    if not (keys.shape[0] == values.shape[0] == B):
        raise ValueError(f"batch sizes differ: query {B}, keys {keys.shape[0]}, values {values.shape[0]}")
    if values.shape[1] != Lk:
        raise ValueError(f"keys and values must have the same length, got {Lk} and {values.shape[1]}")
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            got = f"a {mask.dtype} tensor" if isinstance(mask, Tensor) else type(mask).__name__
            raise TypeError(f"mask must be a bool tensor (True = may attend), got {got}")
        m = mask.unsqueeze(1) if mask.dim() == 2 else mask  # (B, Lk) -> (B, 1, Lk)
        if m.dim() > 3 or any(a not in (1, b) for a, b in zip(m.shape[::-1], (Lk, Lq, B))):
            raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to (B, Lq, Lk) = "
                             f"{(B, Lq, Lk)} (a 2-D mask is read as (B, Lk))")
        mask = m.expand(B, Lq, Lk)
    return q, keys, values, mask, one_step


def score_attention(
    scores: Tensor,
    values: Tensor,
    *,
    mask: Optional[Tensor] = None,
    normalize: str = "softmax",
    top_k: Optional[int] = None,
) -> tuple[Tensor, Tensor]:
    """The tail of the pipeline for precomputed scores: ``α = normalize(mask(e))``, ``c = α V``.

    Args:
        scores: ``e`` of shape ``(B, Lq, Lk)``.
        values: ``(B, Lk, Dv)``.
        mask: bool ``(B, Lq, Lk)``, True = may attend; masked scores become ``-inf``.

    Returns:
        ``(context (B, Lq, Dv), weights (B, Lq, Lk))``; a row with nothing to attend to gives
        zeros, never NaN (also in gradients).
    """
    if normalize == "topk" and top_k > scores.shape[-1]:
        raise ValueError(f"top_k must be an int in [1, Lk={scores.shape[-1]}] with normalize='topk', got {top_k!r}")
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = NORMALIZERS[normalize](scores, top_k)  # (B, Lq, Lk)
    return torch.bmm(weights, values), weights  # (B, Lq, Dv)
