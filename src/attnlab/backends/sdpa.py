"""The SDPA backend: ``torch.nn.functional.scaled_dot_product_attention``.

PyTorch's fused kernels (a flash-style kernel on CPU) for softmax attention with no score_mod.
Causal attention with ``Lq == Lk`` and nothing else uses ``is_causal`` (which skips blocks);
every other mask is combined into one dense mask. Rows with nothing to attend to come back
as zeros from torch >= 2.5 (checked by the conformance tests).

For CPU training with at most a few hundred keys ``auto`` takes the ``short`` backend instead
(:mod:`attnlab.backends.short`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from attnlab.functional.masks import build_mask, split_mask


def unsupported(q, k, v, *, normalize, score_mod, return_weights, return_lse=False, dropout_p=0.0, **_) -> str:
    if return_lse:
        if q.device.type != "cpu":
            return "return_lse=True off the CPU (the log-sum-exp comes from the CPU flash kernel)"
        if k.shape[1] != q.shape[1] or v.shape[-1] != q.shape[-1]:
            return "return_lse=True with grouped-query k/v or a value width other than D (the CPU kernel's limits)"
        if dropout_p > 0:
            return "return_lse=True with dropout"
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return "return_lse=True with gradients (tiled differentiates through it)"
    if normalize != "softmax":
        return f"normalize={normalize!r} (SDPA computes softmax only)"
    if score_mod is not None:
        return "score_mod (SDPA takes no score function)"
    if return_weights:
        return "return_weights=True (SDPA does not materialise the weights)"
    return ""


def attention(q, k, v, *, mask, causal, window, scale, score_mod, mask_mod, dropout_p, normalize,
              top_k, return_weights):
    """``softmax(κ Q Kᵀ + M) V`` through PyTorch's fused kernel.

    CPU training in bf16/fp16 runs the fused kernel in float32 and casts back: its half-precision backward is
    up to 2.5× slower (64 keys: 5.8 vs 2.3 ms per layer; equal from 256 keys), and float32 is at least as exact.
    """
    gqa = bool(k.shape[1] != q.shape[1])  # a Python bool even while tracing (ONNX export)
    if q.device.type == "cpu" and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        if q.dtype in (torch.bfloat16, torch.float16):
            with torch.autocast("cpu", enabled=False):
                out, _ = attention(q.float(), k.float(), v.float(), mask=mask, causal=causal, window=window,
                                   scale=scale, score_mod=score_mod, mask_mod=mask_mod, dropout_p=dropout_p,
                                   normalize=normalize, top_k=top_k, return_weights=return_weights)
            return out.to(q.dtype), None
    attn_mask, is_causal = _sdpa_mask(q, k, mask=mask, causal=causal, window=window, mask_mod=mask_mod)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                         scale=scale, enable_gqa=gqa)
    return out, None


def attention_lse(q, k, v, *, mask, causal, window, scale, mask_mod, **_):
    """``(out, lse)`` on a CPU: the fused flash kernel that ``F.scaled_dot_product_attention`` runs there, called
    for its second output ``LSE_i = log Σ_j e^(s_ij)`` (so ``out`` is bitwise the plain call's); ``-inf`` on rows
    that see no key."""
    attn_mask, is_causal = _sdpa_mask(q, k, mask=mask, causal=causal, window=window, mask_mod=mask_mod)
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # the kernel adds a mask of q's dtype
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(~attn_mask, float("-inf"))
    elif attn_mask is not None:
        attn_mask = attn_mask.to(q.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal,
                                                                        attn_mask=attn_mask, scale=scale)
    if attn_mask is not None:  # the kernel leaves 0 where a row sees no key
        empty = torch.isneginf(attn_mask).all(-1).expand(lse.shape)  # (B, H, Lq)
        lse = lse.masked_fill(empty, float("-inf"))
    return out, lse


def _sdpa_mask(q, k, *, mask, causal, window, mask_mod):
    """``(attn_mask or None, is_causal)`` for torch's kernel: plain and causal requests keep its fast paths
    (bottom-right causal with one query attends to all); every other constraint is one dense mask."""
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    if mask is None and window is None and mask_mod is None and (not causal or Lq == 1 or Lq == Lk):
        return None, causal and Lq > 1
    bool_mask, bias = split_mask(mask)
    allowed = build_mask(B=B, H=H, Lq=Lq, Lk=Lk, device=q.device, mask=bool_mask, causal=causal,
                         window=window, mask_mod=mask_mod)
    if bias is not None and allowed is not None:
        return bias.masked_fill(~allowed, float("-inf")), False
    return (bias if bias is not None else allowed), False
