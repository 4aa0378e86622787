"""The short backend: explicit batched products with a hand-written backward, for CPU training on short
sequences.

``P = softmax(κ Q Kᵀ + M)``, ``O = P V`` with ``P`` kept for the backward (``B·H·Lq·Lk`` floats). torch's CPU
flash kernel tiles for long sequences; at nanoGPT-sized shapes (64–256 keys) its backward costs more than
this whole computation (measured in ``benchmarks/train.py``), so ``auto`` takes this backend when training
on a CPU with at most :data:`SHORT_KEYS` keys, as many key as query heads and no dropout
(:func:`auto_when`). Asked for by name it computes any softmax request without a score_mod, in O(Lq·Lk)
memory.

Float32 and bf16 requests whose only constraints are ``causal`` and ``window``, with at most :data:`FUSED_KEYS` keys,
run in C++ (``csrc/train.cpp``, the mask in closed form, no ``M`` built) as one call each way
(:func:`fused_short_attention`: a (batch, head) a task, the products by register tiles, a causal block of 16 queries
computing only the keys they see); every other request runs :class:`ShortAttention`.
"""
from __future__ import annotations

import torch

from attnlab import _native

from attnlab import _native_train
from attnlab._native import transformed
from attnlab.backends import reference
from attnlab.functional.masks import build_mask, split_mask
from attnlab.functional.request import default_scale

# Most keys for which auto trains with this backend on a CPU (at 512 keys the fused kernel wins again).
SHORT_KEYS = 256


def unsupported(q, k, v, *, normalize, score_mod, dropout_p, return_weights, **_) -> str:
    if normalize != "softmax":
        return f"normalize={normalize!r} (short computes softmax only)"
    if score_mod is not None:
        return "score_mod (short folds constraints into one additive mask; use tiled)"
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
    """``softmax(κ Q Kᵀ + M) V`` by :class:`ShortAttention`, every constraint folded into one additive ``M``
    (grouped-query k and v repeated to the query heads; autograd sums their gradients back)."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    scale = default_scale(D) if scale is None else scale
    if k.shape[1] != H:
        k, v = k.repeat_interleave(H // k.shape[1], dim=1), v.repeat_interleave(H // k.shape[1], dim=1)
    if mask is None and mask_mod is None and _native.trainable(q, k, v, contiguous=False) and fused_applies(q, k, v):
        return fused_short_attention(q, k, v, scale, causal, window), None
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
    return ShortAttention.apply(q, k, v, full, scale), None


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
        ctx.save_for_backward(q3, k3, v3, p, q, k, v, bias)  # q, k, v, bias: for create_graph=True
        ctx.scale = scale
        return out.view(B, H, Lq, v.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        q3, k3, v3, p, q, k, v, bias = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: gradients differentiable again, from the formula
            return (*reference.formula_grads(
                grad_out, q, k, v, (bias,), ctx.needs_input_grad[:4], compute_dtype=p.dtype, mask=bias, causal=False,
                window=None, scale=ctx.scale, score_mod=None, mask_mod=None), None)
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


# The most keys fused_short_attention takes: those auto trains with (past them, asked for by name: ShortAttention)
FUSED_KEYS = SHORT_KEYS


def fused_applies(q, k, v) -> bool:
    """Whether :func:`fused_short_attention` takes a (mask-free, float32 or bf16) request: at most :data:`FUSED_KEYS`
    keys, the value width the query's, each operand's last stride 1 and none an expanded view (the kernel refuses
    those), at least one query (an empty request's gradients come in with any strides: :class:`ShortAttention`)."""
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
