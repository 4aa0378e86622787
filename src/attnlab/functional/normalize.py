"""Normalisers: scores -> attention weights, row by row over the last dimension.

Every normaliser takes scores in which disallowed positions are ``-inf`` and returns
weights that are exactly zero there. A row with no allowed position returns all zeros
(never NaN), in the forward pass and in gradients.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor


def _finite_row_max(scores: Tensor) -> Tensor:
    """Row maximum with ``-inf`` rows replaced by 0; detached (softmax is shift-invariant)."""
    m = scores.detach().amax(dim=-1, keepdim=True)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def softmax(scores: Tensor, top_k: Optional[int] = None) -> Tensor:
    """Numerically stable softmax: ``w_ij = exp(s_ij - m_i) / Σ_j exp(s_ij - m_i)``.

    ``m_i`` is the row maximum; a row of only ``-inf`` gives zeros instead of ``0/0``.
    """
    e = torch.exp(scores - _finite_row_max(scores))
    denom = e.sum(dim=-1, keepdim=True)
    return e / torch.where(denom > 0, denom, torch.ones_like(denom))


def topk_softmax(scores: Tensor, top_k: Optional[int] = None) -> Tensor:
    """Explicit Sparse Transformer (Zhao et al. 2019): keep the ``top_k`` largest scores of
    each row, set the rest to ``-inf``, then softmax.  Ties at the threshold are all kept.
    """
    if top_k is None:
        raise ValueError("normalize='topk' needs top_k (a positive int)")
    k = min(top_k, scores.shape[-1])
    kth = scores.detach().topk(k, dim=-1).values[..., -1:]
    return softmax(scores.masked_fill(scores < kth, float("-inf")))


def hard(scores: Tensor, top_k: Optional[int] = None) -> Tensor:
    """Hard attention: one-hot ``argmax_j s_ij`` in the forward pass, the softmax gradient in
    the backward pass (straight-through estimator): ``w = onehot + p - stopgrad(p)``.
    """
    p = softmax(scores)
    idx = scores.detach().argmax(dim=-1, keepdim=True)
    onehot = torch.zeros_like(p).scatter_(-1, idx, 1.0)
    onehot = onehot * (p.detach().sum(dim=-1, keepdim=True) > 0)  # empty rows stay zero
    return onehot + (p - p.detach())


def sparsemax(scores: Tensor, top_k: Optional[int] = None) -> Tensor:
    """Sparsemax (Martins & Astudillo 2016): the Euclidean projection onto the simplex,
    ``w_i = max(s_i - τ, 0)`` with ``τ = (Σ_{j≤k(s)} s_(j) - 1) / k(s)``, where ``s_(j)`` are the
    scores sorted in decreasing order and ``k(s) = max{k : 1 + k s_(k) > Σ_{j≤k} s_(j)}``.

    Autograd through this expression gives the exact sparsemax Jacobian
    ``diag(σ) - σσᵀ/|S|`` (σ the support indicator), so no custom backward is needed.
    """
    allowed = torch.isfinite(scores)
    any_allowed = allowed.any(dim=-1, keepdim=True)
    # Disallowed entries become (row max - 2): always below τ >= max - 1, hence weight 0,
    # and finite, so no inf - inf appears in the sort / cumsum.
    fill = _finite_row_max(scores) - 2.0
    z = torch.where(allowed, scores, fill)
    z_sorted, _ = torch.sort(z, dim=-1, descending=True)
    ks = torch.arange(1, z.shape[-1] + 1, device=z.device, dtype=z.dtype)
    cums = z_sorted.cumsum(dim=-1)
    support = (1 + ks * z_sorted) > cums
    k = support.sum(dim=-1, keepdim=True).clamp(min=1)
    tau = (cums.gather(-1, k - 1) - 1) / k.to(z.dtype)
    w = torch.clamp(z - tau, min=0)
    return torch.where(any_allowed & allowed, w, torch.zeros_like(w))


NORMALIZERS: dict[str, Callable[..., Tensor]] = {
    "softmax": softmax,
    "topk": topk_softmax,
    "hard": hard,
    "sparsemax": sparsemax,
}
