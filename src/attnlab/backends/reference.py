"""The reference backend: the pipeline written out, materialising the ``(B, H, Lq, Lk)`` scores.

Readable and exact (works in float64); the oracle every other backend is tested against,
and the path that returns attention weights and runs the non-softmax normalisers.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from attnlab.functional.masks import build_mask, call_score_mod, index_grids, split_mask
from attnlab.functional.normalize import NORMALIZERS
from attnlab.functional.dropout import dropout


def unsupported(q, k, v, **request) -> str:
    return ""


def apply_score_mod(scores: Tensor, score_mod) -> Tensor:
    """``scores = score_mod(scores, b, h, q_idx, kv_idx)``, checked to keep shape and dtype."""
    B, H, Lq, Lk = scores.shape
    b, h, q_idx, kv_idx = index_grids(B, H, Lq, Lk, scores.device)
    return call_score_mod(score_mod, scores, b, h, q_idx, kv_idx)


def attention(q, k, v, *, mask, causal, window, scale, score_mod, mask_mod, dropout_p, normalize,
              top_k, return_weights):
    """``weights = normalize(mask(score_mod(κ Q Kᵀ))); out = dropout(weights) V``."""
    B, H, Lq, _ = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    if Hkv != H:  # GQA / MQA: each key/value head serves H // Hkv query heads
        k = k.repeat_interleave(H // Hkv, dim=1)
        v = v.repeat_interleave(H // Hkv, dim=1)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, H, Lq, Lk)
    if score_mod is not None:
        scores = apply_score_mod(scores, score_mod)
    bool_mask, bias = split_mask(mask)
    if bias is not None:
        scores = scores + bias
    allowed = build_mask(B=B, H=H, Lq=Lq, Lk=Lk, device=q.device, mask=bool_mask, causal=causal,
                         window=window, mask_mod=mask_mod)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    weights = NORMALIZERS[normalize](scores, top_k)  # (B, H, Lq, Lk)
    dropped = dropout(weights, dropout_p) if dropout_p > 0 else weights
    out = torch.matmul(dropped, v)  # (B, H, Lq, Dv)
    return out, (weights if return_weights else None)


def formula_grads(d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, extra: Sequence[Optional[Tensor]],
                  needs: Sequence[bool], *, compute_dtype: torch.dtype, **request) -> list[Optional[Tensor]]:
    """The gradients of softmax attention w.r.t. ``(q, k, v, *extra)`` (``extra``: a float mask, the tensors a
    score_mod reads), computed from this formula with their graph (``create_graph=True``), so they are
    differentiable again: what a custom backward of another backend returns when it runs in grad mode (a gradient
    penalty, ``torch.autograd.gradgradcheck``). ``request``: mask, causal, window, scale, score_mod, mask_mod.
    Materialises the ``(B, H, Lq, Lk)`` scores, as this backend always does; ``None`` where ``needs`` is False."""
    inputs = (q, k, v, *extra)
    wanted = [i for i, (t, n) in enumerate(zip(inputs, needs)) if n and t is not None]
    with torch.enable_grad():
        out = attention(q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype), dropout_p=0.0,
                        normalize="softmax", top_k=None, return_weights=False, **request)[0]
        grads = torch.autograd.grad(out, [inputs[i] for i in wanted], d_out.to(out.dtype), create_graph=True,
                                    allow_unused=True)
    result: list[Optional[Tensor]] = [None] * len(inputs)
    for i, g in zip(wanted, grads):
        result[i] = torch.zeros_like(inputs[i]) if g is None else g
    return result
