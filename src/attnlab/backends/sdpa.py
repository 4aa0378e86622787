"""The SDPA backend: ``torch.nn.functional.scaled_dot_product_attention``.

PyTorch's fused kernels (a flash-style kernel on CPU) for softmax attention with no score_mod.
Causal attention with ``Lq == Lk`` and nothing else uses ``is_causal`` (which skips blocks);
every other mask is combined into one dense mask. Rows with nothing to attend to come back
as zeros from torch >= 2.5 (checked by the conformance tests).

Training on a CPU with at most :data:`SHORT_KEYS` keys (no dropout, as many key as query heads)
takes :class:`ShortAttention` instead: explicit batched products with a hand-written backward.
torch's CPU flash kernel tiles for long sequences; at nanoGPT-sized shapes (64–256 keys) its
backward costs more than the whole explicit computation (measured in ``benchmarks/train.py``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from attnlab.functional.masks import build_mask, split_mask

# Most keys for which CPU training uses ShortAttention (at 512 keys the fused kernel wins again).
SHORT_KEYS = 256


def unsupported(q, k, v, *, normalize, score_mod, return_weights, **_) -> str:
    if normalize != "softmax":
        return f"normalize={normalize!r} (SDPA computes softmax only)"
    if score_mod is not None:
        return "score_mod (SDPA takes no score function)"
    if return_weights:
        return "return_weights=True (SDPA does not materialise the weights)"
    return ""


def attention(q, k, v, *, mask, causal, window, scale, score_mod, mask_mod, dropout_p, normalize,
              top_k, return_weights):
    """``softmax(κ Q Kᵀ + M) V`` through PyTorch's fused kernel, or :class:`ShortAttention` when
    training on a CPU with at most :data:`SHORT_KEYS` keys.

    Other CPU training in bf16/fp16 (attention dropout, GQA, long sequences) runs the fused kernel in
    float32 and casts back: its half-precision backward is up to 2.5× slower (64 keys: 5.8 vs 2.3 ms per
    layer; equal from 256 keys), and float32 is at least as exact.
    """
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    gqa = bool(k.shape[1] != H)  # a Python bool even while tracing (ONNX export)
    if q.device.type == "cpu" and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        if Lk <= SHORT_KEYS and not gqa and dropout_p == 0.0:
            return _short(q, k, v, mask=mask, causal=causal, window=window, mask_mod=mask_mod, scale=scale), None
        if q.dtype in (torch.bfloat16, torch.float16):
            with torch.autocast("cpu", enabled=False):
                out, _ = attention(q.float(), k.float(), v.float(), mask=mask, causal=causal, window=window,
                                   scale=scale, score_mod=score_mod, mask_mod=mask_mod, dropout_p=dropout_p,
                                   normalize=normalize, top_k=top_k, return_weights=return_weights)
            return out.to(q.dtype), None
    if mask is None and window is None and mask_mod is None and (not causal or Lq == 1 or Lq == Lk):
        # plain or causal: the fast paths (bottom-right causal with one query attends to all)
        is_causal = causal and Lq > 1
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal,
                                             scale=scale, enable_gqa=gqa)
        return out, None
    bool_mask, bias = split_mask(mask)
    allowed = build_mask(B=B, H=H, Lq=Lq, Lk=Lk, device=q.device, mask=bool_mask, causal=causal,
                         window=window, mask_mod=mask_mod)
    if bias is not None and allowed is not None:
        attn_mask = bias.masked_fill(~allowed, float("-inf"))
    else:
        attn_mask = bias if bias is not None else allowed
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                         scale=scale, enable_gqa=gqa)
    return out, None


def _short(q, k, v, *, mask, causal, window, mask_mod, scale):
    """Every constraint folded into one additive bias for :class:`ShortAttention`."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    bool_mask, bias = split_mask(mask)
    allowed = build_mask(B=B, H=H, Lq=Lq, Lk=Lk, device=q.device, mask=bool_mask, causal=causal,
                         window=window, mask_mod=mask_mod)
    if bias is None and allowed is None:
        full = None
    else:
        acc = torch.promote_types(q.dtype, torch.float32)
        full = torch.zeros((), dtype=acc, device=q.device) if bias is None else bias.to(acc)
        if allowed is not None:
            full = full.masked_fill(~allowed, float("-inf"))
        full = full.expand(B, H, Lq, Lk)
    return ShortAttention.apply(q, k, v, full, D ** -0.5 if scale is None else scale)


class ShortAttention(torch.autograd.Function):
    """``O = P V`` with ``P = softmax(κ Q Kᵀ + M)``, for a few hundred keys at most.

    The products run in the input dtype, the softmax and its gradient in float32 (float64 for float64); ``P`` is kept
    for the backward (``B·H·Lq·Lk`` floats: small at these lengths)::

        dV = Pᵀ dO,   dP = dO Vᵀ,   dS = P ⊙ (dP − rowsum(dP ⊙ P)),   dQ = κ dS K,   dK = κ dSᵀ Q,   dM = dS

    Rows where every key is masked give ``P = 0``: zero output and zero gradients, as SDPA.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, scale):
        B, H, Lq, D = q.shape
        Lk = k.shape[2]
        q3, k3, v3 = q.reshape(B * H, Lq, D), k.reshape(B * H, Lk, D), v.reshape(B * H, Lk, v.shape[-1])
        acc = torch.promote_types(q.dtype, torch.float32)  # softmax precision: float32, or float64 for float64
        s = torch.bmm(q3, k3.transpose(1, 2)).to(acc)
        s = s.mul_(scale) if bias is None else torch.add(bias.reshape(B * H, Lq, Lk), s, alpha=scale)
        p = torch.softmax(s, dim=-1)
        if bias is not None:
            p = p.nan_to_num_(0.0)  # rows with every key masked: softmax of all −inf
        out = torch.bmm(p.to(q.dtype), v3)
        ctx.save_for_backward(q3, k3, v3, p)
        ctx.scale = scale
        return out.view(B, H, Lq, v.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        q3, k3, v3, p = ctx.saved_tensors
        B, H = grad_out.shape[:2]
        # (B·H, Lq, Dv), in the products' dtype: under autocast the incoming gradient can be float32
        # while q, k, v are bfloat16
        go = grad_out.reshape(q3.shape[0], q3.shape[1], v3.shape[2]).to(v3.dtype)
        dv = torch.bmm(p.to(go.dtype).transpose(1, 2), go)
        dp = torch.bmm(go, v3.transpose(1, 2)).to(p.dtype)
        ds = torch._softmax_backward_data(dp, p, -1, p.dtype)  # dS, which is also dM
        dbias = ds.view(B, H, *ds.shape[1:]) if ctx.needs_input_grad[3] else None
        ds = ds.to(q3.dtype)
        dq = torch.bmm(ds, k3).mul_(ctx.scale)
        dk = torch.bmm(ds.transpose(1, 2), q3).mul_(ctx.scale)
        return dq.view(B, H, *dq.shape[1:]), dk.view(B, H, *dk.shape[1:]), dv.view(B, H, *dv.shape[1:]), dbias, None
