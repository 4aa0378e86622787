"""The tiled backend's C++ path (``csrc/flash_*.cpp`` through :mod:`attnlab._native`): which requests it computes, with
which tiles, and the autograd Function around its two passes. :mod:`attnlab.backends.tiled` calls it first and runs
its PyTorch loop for everything else.

It computes masks that are one interval of keys per query (causal, a sliding window, a ``mask_mod`` with
``key_spans``: packed documents, prefix-LM) or a block layout (``bigbird_mod``'s ``block_layout``), and the score mods
ALiBi (``alibi_score_mod``'s ``.alibi``) and softcap (``softcap_score_mod``'s ``.softcap``), in float32 (bf16/fp16
inputs are converted), forward and backward.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from attnlab import _native
from attnlab._native_library import refuse_second_derivative

# the C++ kernel's blocks, (query rows, keys) per tile of each pass: the fastest of the sizes tried on a causal
# N=4096 request. A causal window w tiles a band, and each tile computes (rows + w - 1) · keys scores of which
# rows · w are seen: narrow tiles waste less.
NATIVE_BLOCKS = ((128, 1024), (512, 128))        # (forward, backward)
NATIVE_BLOCKS_WINDOW = ((64, 512), (512, 32))    # a window of at most NARROW_WINDOW keys
NARROW_WINDOW = 512


def native_applies(q: Tensor) -> bool:
    """Whether the C++ kernel may serve a request on ``q`` (given a mask and mods it computes, :func:`native_request`):
    a float32/bf16/fp16 CPU tensor the kernels may read (:func:`attnlab._native.runs_on`: no ``torch.jit`` trace, no
    ``torch.func`` transform, the kernels built). Its backward is not differentiable again, as SDPA's CPU flash
    kernel's is not: with ``create_graph=True`` it raises, naming this path."""
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and _native.runs_on(q))


def native_request(q: Tensor, k: Tensor, score_mod, mask_mod, captured: list) -> Optional[dict]:
    """The C++ kernel's arguments for ``score_mod`` and ``mask_mod`` (``spans``, ``mod``, ``slopes``, ``cap``), or
    None where it cannot compute them: a score_mod other than ALiBi and softcap (``alibi_score_mod`` and
    ``softcap_score_mod`` mark theirs) or one reading a tensor that wants a gradient, a mask_mod without
    ``key_spans`` (:func:`~attnlab.functional.masks.document_mod` and ``prefix_lm_mod`` give theirs) or a
    ``block_layout`` (``bigbird_mod``'s), or whose spans / layout do not fit. ``captured``: the tensors the
    score_mod reads that want a gradient (:func:`~attnlab.functional.masks.captured_tensors`): their gradients need
    the PyTorch loop."""
    request: dict = {}
    if score_mod is not None:
        alibi, cap = getattr(score_mod, "alibi", None), getattr(score_mod, "softcap", None)
        if captured:
            return None
        if alibi is not None and alibi[0].dim() == 1 and alibi[0].numel() == q.shape[1]:
            request.update(mod="alibi" if alibi[1] else "alibi_symmetric",
                           slopes=alibi[0].detach().to(device="cpu", dtype=torch.float32).contiguous())
        elif cap is not None:
            request.update(mod="softcap", cap=float(cap))
        else:
            return None
    if mask_mod is not None:
        Lq, Lk = q.shape[2], k.shape[2]
        key_spans, block_layout = getattr(mask_mod, "key_spans", None), getattr(mask_mod, "block_layout", None)
        if key_spans is not None:
            spans = key_spans(Lk) if Lq <= Lk else None
            if spans is None or spans.shape[0] not in (1, q.shape[0]):
                return None
            request["spans"] = spans
        elif block_layout is not None:
            layout, G = block_layout
            if not 1 <= G <= Lk or layout.dim() != 2 or min(layout.shape) * G < Lk or (Lk - Lq) % G or Lq > Lk:
                return None
            request.update(layout=layout.to(device="cpu", dtype=torch.uint8).contiguous(), granularity=G)
        else:
            return None
    return request


def native_blocks(window: Optional[int], request: dict) -> tuple:
    """The kernel's (forward, backward) tiles for a request: a block layout's granularity G fixes the forward's
    query tile and the backward's key tile at G (the other side ~1024 / 512 keys / rows in whole blocks)."""
    G = request.get("granularity")
    if G is not None:
        return (G, max(G, NATIVE_BLOCKS[0][1] // G * G)), (max(G, NATIVE_BLOCKS[1][0] // G * G), G)
    return NATIVE_BLOCKS_WINDOW if window is not None and window <= NARROW_WINDOW else NATIVE_BLOCKS


class NativeFlash(torch.autograd.Function):
    """Both passes in C++ (``csrc/flash_forward.cpp``, ``flash_backward.cpp``), in float32; ``(out in q's dtype, lse
    float32)``."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, window, blocks, request):
        f32 = [t.to(torch.float32).contiguous() for t in (q, k, v)]
        (fq, fk), (bq, bk) = blocks
        out, lse = _native.flash_forward(*f32, scale=scale, causal=causal, window=window, block_q=fq, block_k=fk,
                                         **request)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = dict(scale=scale, causal=causal, window=window, block_q=bq, block_k=bk, **request)
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, d_out, _d_lse):
        refuse_second_derivative("the tiled backend's C++ flash attention")
        q, k, v, out, lse = ctx.saved_tensors
        f32 = [t.to(torch.float32).contiguous() for t in (q, k, v)]
        dq, dk, dv = _native.flash_backward(*f32, out, lse, d_out.to(torch.float32).contiguous(), **ctx.args)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None
