"""The short backend: attention with ``P`` kept for the backward, for CPU training on short sequences.

``P = softmax(κ Q Kᵀ + M)``, ``O = P V`` with ``P`` kept for the backward (``B·H·Lq·Lk`` floats). torch's CPU
flash kernel tiles for long sequences; at nanoGPT-sized shapes (64–256 keys) its backward costs more than
this whole computation (``benchmarks/train_passes.py``'s attention rows), so ``auto`` takes this backend when
training on a CPU with at most :data:`SHORT_KEYS` keys, as many key as query heads and no dropout
(:func:`auto_when`). Asked for by name it computes any softmax request without a score_mod, in O(Lq·Lk)
memory.

Float32 and bf16 requests whose only constraints are ``causal`` and ``window``, with at most :data:`FUSED_KEYS` keys,
run in C++ (``csrc/short_attention.cpp``, the mask in closed form, no ``M`` built) as one call each way
(:func:`fused_short_attention`: a (batch, head) a task, the products by register tiles, a causal block of 16 queries
computing only the keys they see); every other request runs :func:`formula`.
"""
from __future__ import annotations

import torch

from attnlab import _native

from attnlab import _native_train
from attnlab._native import transformed
from attnlab.backends import reference
from attnlab.functional.request import default_scale

# Most keys for which auto trains with this backend on a CPU (at 512 keys the fused kernel wins again).
SHORT_KEYS = 256


def unsupported(q, k, v, *, normalize, score_mod, dropout_p, return_weights, **_) -> str:
    if normalize != "softmax":
        return f"normalize={normalize!r} (short computes softmax only)"
    if score_mod is not None:
        return "score_mod (short computes masks, not score mods; use tiled)"
    if dropout_p > 0:
        return "dropout_p > 0 (short has no dropout)"
    if return_weights:
        return "return_weights=True (short keeps the weights for its backward but does not return them)"
    return ""


def auto_when(q, k, v, **_) -> bool:
    """Training on a CPU (grad mode on, an input requires grad) with at most :data:`SHORT_KEYS` keys and as
    many key/value as query heads (grouped-query attention keeps the fused kernel, which shares them), outside
    ``torch.func`` transforms (:func:`~attnlab._native.transformed`)."""
    return (q.device.type == "cpu" and torch.is_grad_enabled()
            and (q.requires_grad or k.requires_grad or v.requires_grad) and k.shape[2] <= SHORT_KEYS
            and k.shape[1] == q.shape[1] and not transformed(q))


def attention(q, k, v, *, mask, causal, window, scale, score_mod, mask_mod, dropout_p, normalize, top_k,
              return_weights):
    """``softmax(κ Q Kᵀ + M) V``: the fused kernel where it applies (grouped-query k and v repeated to the query
    heads; autograd sums their gradients back), else :func:`formula`."""
    H = q.shape[1]
    scale = default_scale(q.shape[-1]) if scale is None else scale
    if mask is None and mask_mod is None and _native.trainable(q, k, v, contiguous=False):
        if k.shape[1] != H:
            k, v = k.repeat_interleave(H // k.shape[1], dim=1), v.repeat_interleave(H // k.shape[1], dim=1)
        if fused_applies(q, k, v):
            return fused_short_attention(q, k, v, scale, causal, window), None
    return formula(q, k, v, mask=mask, causal=causal, window=window, scale=scale, mask_mod=mask_mod), None


def formula(q, k, v, *, mask, causal, window, scale, mask_mod):
    """The request by the reference backend's formula in float32 (float64 for float64; autocast off) under autograd,
    cast back to q's dtype: any mask, a float mask's gradient, differentiable twice; a row that sees no key gives 0
    and zero gradients."""
    acc = torch.promote_types(q.dtype, torch.float32)
    with torch.autocast(q.device.type, enabled=False):
        out, _ = reference.attention(q.to(acc), k.to(acc), v.to(acc), mask=mask, causal=causal, window=window,
                                     scale=scale, score_mod=None, mask_mod=mask_mod, dropout_p=0.0,
                                     normalize="softmax", top_k=None, return_weights=False)
    return out.to(q.dtype)


# The most keys fused_short_attention takes: those auto trains with (past them, asked for by name: formula)
FUSED_KEYS = SHORT_KEYS


def fused_applies(q, k, v) -> bool:
    """Whether :func:`fused_short_attention` takes a (mask-free, float32 or bf16) request: at most :data:`FUSED_KEYS`
    keys, the value width the query's, each operand's last stride 1 and none an expanded view (the kernel refuses
    those), at least one query (an empty request's gradients come in with any strides: :func:`formula`)."""
    return (0 < q.shape[2] and k.shape[2] <= FUSED_KEYS and v.shape[-1] == q.shape[-1]
            and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
            and not any(n > 1 and s == 0 for t in (q, k, v) for n, s in zip(t.shape, t.stride())))


def fused_short_attention(q, k, v, scale, causal, window):
    """``softmax(κ Q Kᵀ) V`` over the keys ``causal`` and ``window`` leave each query, as one autograd node
    (:func:`attnlab._native_train.short_attention_train`: ``short_attention`` forward, ``short_attention_backward``
    from the kept ``P``): a (batch, head) a task, reading q, k, v where they lie (views of the packed projection), 16
    queries' scores at a time (a causal block computes only the keys its queries see), ``P`` (float32) kept for the
    backward; the output and the gradients written with the heads merged."""
    return _native_train.short_attention_train(q, k, v, scale=scale, causal=causal, window=window)


def fused_short_attention_packed(qkv, heads, scale, causal, window):
    """:func:`fused_short_attention` of the q, k, v that ``qkv (B, L, 3E)`` packs (``[q | k | v]``, ``heads`` heads
    each) as one node on ``qkv`` itself (:func:`attnlab._native_train.short_attention_packed`): ``out (B, L, E)``
    with the heads merged, ``∂L/∂qkv`` written whole by its backward. The same bits."""
    return _native_train.short_attention_packed(qkv, heads, scale=scale, causal=causal, window=window)
