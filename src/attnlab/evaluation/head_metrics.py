"""Metrics of attention maps ``(B, H, Lq, Lk)``, per head, over the valid query rows (the formulas are in
:mod:`attnlab.evaluation.analysis`'s docstring): entropy, mean attention distance, attention to sinks, and the
pairwise similarity of head patterns."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab._checks import one_of

SIMILARITIES = ("cosine", "js")


# ---- metrics on attention maps (B, H, Lq, Lk) -------------------------------------------------

def _rows(attn: Tensor, query_mask: Optional[Tensor]) -> Tensor:
    """Valid query rows ``(B, 1, Lq, 1)`` as float: in ``query_mask`` and with any weight."""
    if not isinstance(attn, Tensor) or attn.dim() != 4:
        raise ValueError(f"attn must be a (B, H, Lq, Lk) tensor, got {getattr(attn, 'shape', type(attn).__name__)}")
    valid = attn.sum(-1, keepdim=True).amax(1, keepdim=True) > 0  # (B, 1, Lq, 1): empty rows excluded
    if query_mask is not None:
        B, _, Lq, _ = attn.shape
        if query_mask.shape != (B, Lq):
            raise ValueError(f"query_mask must be (B, Lq) = {(B, Lq)}, got {tuple(query_mask.shape)}")
        valid = valid & query_mask.bool()[:, None, :, None]
    return valid.to(attn.dtype)


def _row_mean(values: Tensor, rows: Tensor) -> Tensor:
    """Mean of ``values (B, H, Lq)`` over the valid rows, pooled over the batch -> ``(H,)``."""
    rows = rows.squeeze(-1)  # (B, 1, Lq)
    n = rows.sum()
    if n == 0:
        raise ValueError("no valid query rows (every row is masked or empty)")
    return (values * rows).sum((0, 2)) / n


def head_entropy(attn: Tensor, query_mask: Optional[Tensor] = None) -> Tensor:
    """``H_h = mean_i −Σ_j a_ij log a_ij`` (nats, ``0 log 0 = 0``) per head ``(H,)``.

    Args:
        attn: weights ``(B, H, Lq, Lk)``, rows summing to 1 (or 0 for an empty row).
        query_mask: ``(B, Lq)``, True for real (non-padding) queries; empty rows are always excluded.

    Raises:
        ValueError: ``attn`` is not 4-D, ``query_mask`` has the wrong shape, or no row is valid.
    """
    rows = _rows(attn, query_mask)
    return _row_mean(-torch.special.xlogy(attn, attn).sum(-1), rows)


def mean_attention_distance(attn: Tensor, query_mask: Optional[Tensor] = None) -> Tensor:
    """``D_h = mean_i Σ_j a_ij |p_i − j|`` per head ``(H,)``; query ``i`` sits at ``p_i = Lk − Lq + i``
    (bottom-right aligned, as the pipeline's causal mask). Arguments as :func:`head_entropy`."""
    rows = _rows(attn, query_mask)
    Lq, Lk = attn.shape[-2:]
    qpos = torch.arange(Lk - Lq, Lk, device=attn.device)
    dist = (qpos[:, None] - torch.arange(Lk, device=attn.device)[None, :]).abs().to(attn.dtype)  # (Lq, Lk)
    return _row_mean((attn * dist).sum(-1), rows)


def sink_attention(attn: Tensor, key_mask: Optional[Tensor] = None, query_mask: Optional[Tensor] = None) -> Tensor:
    """``S_h = mean_i Σ_{j ∈ sinks} a_ij`` per head ``(H,)``: the weight the rows give to the sink keys.

    Args:
        attn: weights ``(B, H, Lq, Lk)``.
        key_mask: ``(B, Lk)`` bool, True for the sink keys (special tokens); None = the first key.
        query_mask: as :func:`head_entropy`.
    """
    rows = _rows(attn, query_mask)
    B, _, _, Lk = attn.shape
    if key_mask is None:
        key_mask = torch.zeros(B, Lk, dtype=torch.bool, device=attn.device)
        key_mask[:, 0] = True
    elif key_mask.shape != (B, Lk):
        raise ValueError(f"key_mask must be (B, Lk) = {(B, Lk)}, got {tuple(key_mask.shape)}")
    return _row_mean((attn * key_mask.bool()[:, None, None, :].to(attn.dtype)).sum(-1), rows)


def head_similarity(attns: Sequence[Tensor], query_mask: Optional[Tensor] = None, *,
                    metric: str = "cosine") -> Tensor:
    """Pairwise similarity of all heads' patterns ``(N, N)``, ``N = layers · H`` (layer-major), averaged
    over the texts of the batch.

    ``"cosine"``: ``⟨A_h, A_g⟩ / (‖A_h‖ ‖A_g‖)`` of the flattened maps of the valid rows.
    ``"js"``: ``1 − mean_i JS(a_i^h ‖ a_i^g) / ln 2`` (1 = identical rows, 0 = disjoint supports).

    Raises:
        ValueError: ``metric`` unknown, no maps, or maps of different shapes.
    """
    one_of("metric", metric, SIMILARITIES)
    if not attns:
        raise ValueError("attns must hold at least one (B, H, Lq, Lk) map")
    if any(a.shape[0] != attns[0].shape[0] or a.shape[2:] != attns[0].shape[2:] for a in attns):
        raise ValueError("all attention maps must share (B, ·, Lq, Lk)")
    rows = _rows(attns[0], query_mask)  # (B, 1, Lq, 1)
    a = torch.cat(list(attns), dim=1) * rows  # (B, N, Lq, Lk)
    if metric == "cosine":
        flat = F.normalize(a.flatten(2), dim=-1)  # (B, N, Lq·Lk)
        return (flat @ flat.transpose(1, 2)).mean(0)  # (N, N)
    n_rows = rows.squeeze(-1).sum(-1)  # (B, 1)
    neg_ent = torch.special.xlogy(a, a).sum(-1)  # (B, N, Lq): Σ_j a log a
    out = torch.empty(a.shape[1], a.shape[1], dtype=a.dtype, device=a.device)
    for x in range(a.shape[1]):  # one head against all: O(B · N · Lq · Lk) memory
        p = a[:, x:x + 1]  # (B, 1, Lq, Lk)
        m = (p + a) / 2
        # JS = (KL(p‖m) + KL(q‖m)) / 2 with KL(x‖m) = Σ x log x − Σ x log m; 0 on invalid rows
        js = (neg_ent[:, x:x + 1] + neg_ent - torch.special.xlogy(p + a, m).sum(-1)) / 2  # (B, N, Lq)
        out[x] = (1 - js.sum(-1) / (n_rows * math.log(2))).mean(0)
    return out
