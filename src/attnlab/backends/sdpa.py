"""The SDPA backend: ``torch.nn.functional.scaled_dot_product_attention``.

PyTorch's fused kernels (a flash-style kernel on CPU) for softmax attention with no score_mod.
Causal attention with ``Lq == Lk`` and nothing else uses ``is_causal`` (which skips blocks);
every other mask is combined into one dense mask. Rows with nothing to attend to come back
as zeros from torch >= 2.5 (checked by the conformance tests).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from attnlab.functional.masks import build_mask, split_mask


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
    """``softmax(κ Q Kᵀ + M) V`` through PyTorch's fused kernel.

    Training in bf16/fp16 on a CPU runs the kernel in float32 and casts the output back: torch's CPU
    flash kernel is 1.6–3.6× slower forward+backward in half precision than in float32 (measured at
    nanoGPT-sized shapes), and the result is at least as exact. Inference keeps the half dtype.
    """
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad):
        out, _ = attention(q.float(), k.float(), v.float(), mask=mask, causal=causal, window=window, scale=scale,
                           score_mod=score_mod, mask_mod=mask_mod, dropout_p=dropout_p, normalize=normalize,
                           top_k=top_k, return_weights=return_weights)
        return out.to(q.dtype), None
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    gqa = bool(k.shape[1] != H)  # a Python bool even while tracing (ONNX export)
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
