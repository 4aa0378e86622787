"""Masks: which key each query may attend to.

Convention (as in SDPA): a boolean mask is True where attention is *allowed*.
Positions are absolute and aligned bottom-right: with ``Lq`` queries over ``Lk`` keys,
query row ``i`` sits at position ``p = Lk - Lq + i``. That is what decoding with a KV
cache needs (the one new query is the last position) and equals the usual top-left
alignment when ``Lq == Lk``.

Mask mods use FlexAttention's vocabulary: ``mask_mod(b, h, q_idx, kv_idx) -> bool``,
called here with broadcastable index tensors of shapes ``(B,1,1,1)``, ``(1,H,1,1)``,
``(1,1,Lq,1)`` and ``(1,1,1,Lk)``, so plain tensor code works unchanged.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def positions(Lq: int, Lk: int, device=None) -> tuple[Tensor, Tensor]:
    """Absolute query and key positions, shaped ``(Lq, 1)`` and ``(1, Lk)``.

    ``q_pos[i] = Lk - Lq + i`` (bottom-right alignment), ``k_pos[j] = j``.
    """
    q_pos = torch.arange(Lk - Lq, Lk, device=device).unsqueeze(-1)
    k_pos = torch.arange(Lk, device=device).unsqueeze(0)
    return q_pos, k_pos


def index_grids(B: int, H: int, Lq: int, Lk: int, device=None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Broadcastable ``(b, h, q_idx, kv_idx)`` tensors for a score_mod / mask_mod call."""
    q_pos, k_pos = positions(Lq, Lk, device)
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    return b, h, q_pos.view(1, 1, Lq, 1), k_pos.view(1, 1, 1, Lk)


def causal_mask(Lq: int, Lk: int, device=None) -> Tensor:
    """``(Lq, Lk)`` bool: key ``j`` visible to query at position ``p`` iff ``j <= p``."""
    q_pos, k_pos = positions(Lq, Lk, device)
    return k_pos <= q_pos


def window_mask(Lq: int, Lk: int, window: int, *, causal: bool, device=None) -> Tensor:
    """``(Lq, Lk)`` bool sliding window: ``p - j < w``, and also ``j - p < w`` when not causal.

    With ``causal=True`` the causal constraint ``j <= p`` is included as well.
    """
    q_pos, k_pos = positions(Lq, Lk, device)
    d = q_pos - k_pos
    if causal:
        return (d >= 0) & (d < window)
    return d.abs() < window


def build_mask(
    *,
    B: int,
    H: int,
    Lq: int,
    Lk: int,
    device,
    mask: Optional[Tensor] = None,
    causal: bool = False,
    window: Optional[int] = None,
    mask_mod: Optional[MaskMod] = None,
) -> Optional[Tensor]:
    """Combine every boolean constraint into one mask broadcastable to ``(B, H, Lq, Lk)``.

    Returns ``None`` when nothing is masked. A float ``mask`` is not handled here: it is an
    additive bias (see :func:`split_mask`).
    """
    allowed: Optional[Tensor] = None

    def _and(m: Tensor) -> None:
        nonlocal allowed
        allowed = m if allowed is None else allowed & m

    if window is not None:
        _and(window_mask(Lq, Lk, window, causal=causal, device=device))
    elif causal:
        _and(causal_mask(Lq, Lk, device))
    if mask is not None:
        _and(mask)
    if mask_mod is not None:
        _and(evaluate_mask_mod(mask_mod, B, H, Lq, Lk, device))
    return allowed


def evaluate_mask_mod(mask_mod: MaskMod, B: int, H: int, Lq: int, Lk: int, device) -> Tensor:
    """Materialise a mask_mod as a bool tensor broadcastable to ``(B, H, Lq, Lk)``."""
    b, h, q_idx, kv_idx = index_grids(B, H, Lq, Lk, device)
    out = mask_mod(b, h, q_idx, kv_idx)
    if not isinstance(out, Tensor) or out.dtype != torch.bool:
        got = type(out).__name__ if not isinstance(out, Tensor) else f"a {out.dtype} tensor"
        raise ValueError(f"mask_mod must return a bool tensor, got {got}")
    try:
        torch.broadcast_shapes(out.shape, (B, H, Lq, Lk))
    except RuntimeError:
        raise ValueError(
            f"mask_mod returned shape {tuple(out.shape)}, which does not broadcast to "
            f"(B, H, Lq, Lk) = {(B, H, Lq, Lk)}"
        ) from None
    return out


def split_mask(mask: Optional[Tensor]) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """Split a user mask into ``(bool_mask, float_bias)``; exactly one of them is set."""
    if mask is None:
        return None, None
    if mask.dtype == torch.bool:
        return mask, None
    return None, mask


# ---- mask_mod builders (FlexAttention-compatible) -------------------------------------

def causal_mod() -> MaskMod:
    """``kv_idx <= q_idx``."""
    return lambda b, h, q_idx, kv_idx: kv_idx <= q_idx


def sliding_window_mod(window: int, *, causal: bool = True) -> MaskMod:
    """``0 <= q_idx - kv_idx < window`` (causal) or ``|q_idx - kv_idx| < window``."""
    if window <= 0:
        raise ValueError(f"window must be a positive int, got {window}")
    if causal:
        return lambda b, h, q_idx, kv_idx: ((q_idx - kv_idx) >= 0) & ((q_idx - kv_idx) < window)
    return lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() < window


def prefix_lm_mod(prefix_len: int) -> MaskMod:
    """Bidirectional over the first ``prefix_len`` keys, causal after them."""
    return lambda b, h, q_idx, kv_idx: (kv_idx < prefix_len) | (kv_idx <= q_idx)


def document_mod(doc_ids: Tensor) -> MaskMod:
    """Block-diagonal mask for packed documents: attend only within the same document.

    ``doc_ids`` is ``(L,)`` or ``(B, L)`` giving each position's document number.
    """
    ids = doc_ids if doc_ids.dim() == 2 else doc_ids.unsqueeze(0)

    def mod(b, h, q_idx, kv_idx):
        row = b if ids.shape[0] > 1 else torch.zeros_like(b)
        return ids[row, q_idx] == ids[row, kv_idx]

    return mod


def and_masks(*mods: MaskMod) -> MaskMod:
    """Logical AND of several mask_mods."""
    def mod(b, h, q_idx, kv_idx):
        out = mods[0](b, h, q_idx, kv_idx)
        for m in mods[1:]:
            out = out & m(b, h, q_idx, kv_idx)
        return out

    return mod


def or_masks(*mods: MaskMod) -> MaskMod:
    """Logical OR of several mask_mods."""
    def mod(b, h, q_idx, kv_idx):
        out = mods[0](b, h, q_idx, kv_idx)
        for m in mods[1:]:
            out = out | m(b, h, q_idx, kv_idx)
        return out

    return mod


def padding_mask(lengths: Tensor, L: int) -> Tensor:
    """``(B, 1, 1, L)`` bool mask, True for the first ``lengths[b]`` keys of each sequence."""
    return (torch.arange(L, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)).view(-1, 1, 1, L)
