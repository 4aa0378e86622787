"""The short backend: explicit batched products with a hand-written backward, for CPU training on short
sequences.

``P = softmax(κ Q Kᵀ + M)``, ``O = P V`` with ``P`` kept for the backward (``B·H·Lq·Lk`` floats). torch's CPU
flash kernel tiles for long sequences; at nanoGPT-sized shapes (64–256 keys) its backward costs more than
this whole computation (measured in ``benchmarks/train.py``), so ``auto`` takes this backend when training
on a CPU with at most :data:`SHORT_KEYS` keys, as many key as query heads and no dropout
(:func:`auto_when`). Asked for by name it computes any softmax request without a score_mod, in O(Lq·Lk)
memory.

Float32 and bf16 requests whose only constraints are ``causal`` and ``window`` run in C++ (``csrc/train.cpp``, the
mask in closed form, no ``M`` built): up to :data:`FUSED_KEYS` keys as one call each way (:func:`fused_short_attention`:
a (batch, head) a task, the products by register tiles, a causal block of 16 queries computing only the keys they
see), past them the batched products with the softmax and its gradient one pass each (:class:`NativeShortAttention`);
every other request runs :class:`ShortAttention`.
"""
from __future__ import annotations

import torch

from attnlab import _native

from attnlab import _native_train
from attnlab._native import transformed
from attnlab.backends import reference
from attnlab._native_library import refuse_second_derivative
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
    if mask is None and mask_mod is None and _native.trainable(q, k, v, contiguous=False):
        if fused_applies(q, k, v):
            return fused_short_attention(q, k, v, scale, causal, window), None
        return NativeShortAttention.apply(q, k, v, scale, causal, window), None
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


# A causal request of at least this many queries runs as two query blocks, each against the keys up to its last
# query's: the products skip the masked upper-right quarter (3/4 of the products); in bf16 the gain is small (its
# products are fast, the strided blocks cost copies), and 64-query blocks are no better than 128.
CAUSAL_BLOCK_QUERIES = 128


def causal_blocks(Lq: int, Lk: int, causal: bool) -> list[tuple[int, int, int]]:
    """``(q0, q1, keys)``: the query rows ``[q0, q1)`` of a block and the keys ``[0, keys)`` they may see (the last
    query at position ``q1 − 1 + Lk − Lq``); one block unless ``causal`` with at least
    :data:`CAUSAL_BLOCK_QUERIES` queries, then two halves."""
    if not causal or Lq < CAUSAL_BLOCK_QUERIES or Lk < Lq:
        return [(0, Lq, Lk)]
    m = Lq // 2
    return [(0, m, m + Lk - Lq), (m, Lq, Lk)]


class NativeShortAttention(torch.autograd.Function):
    """:class:`ShortAttention`'s computation with the mask in closed form (``causal``, ``window``) and the softmax and
    its gradient in one C++ pass each (:func:`attnlab._native_train.softmax_rows`, :func:`~attnlab._native.softmax_rows_
    backward`), reading the products' dtype (float32 or bf16) and keeping ``P`` in float32::

        P = softmax(κ Q Kᵀ) on the visible keys (0 elsewhere),  O = P V
        dV = Pᵀ dO,   dP = dO Vᵀ,   κ dS = κ P ⊙ (dP − rowsum(dP ⊙ P)),   dQ = (κ dS) K,   dK = (κ dS)ᵀ Q

    A long enough causal request runs by query blocks (:func:`causal_blocks`): block ``b`` computes the columns of
    ``P`` up to its last query's key, the rest being 0; ``dK``, ``dV`` sum the blocks' parts.

    Its backward is not differentiable again: with ``create_graph=True`` it raises, naming this path, instead of
    coming out wrong, as the fused kernels' (SDPA's CPU flash kernel, ``tiled``'s C++ path) are not.
    """

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, window):
        B, H, Lq, D = q.shape
        Lk = k.shape[2]
        q3, k3, v3 = q.reshape(B * H, Lq, D), k.reshape(B * H, Lk, D), v.reshape(B * H, Lk, v.shape[-1])
        ctx.blocks = causal_blocks(Lq, Lk, causal)
        outs, ps = [], []
        for q0, q1, keys in ctx.blocks:
            p, p_cast = _native_train.softmax_rows(torch.bmm(q3[:, q0:q1], k3[:, :keys].transpose(1, 2)), scale=scale,
                                             causal=causal, window=window, cast=True)
            p_mm = p if p_cast is None else p_cast  # P in the products' dtype
            outs.append(torch.bmm(p_mm, v3[:, :keys]))
            ps += [p, p_mm]
        ctx.save_for_backward(q3, k3, v3, *ps)
        ctx.scale = scale
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return out.view(B, H, Lq, v.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        refuse_second_derivative("the short backend's C++ softmax pass")
        q3, k3, v3, *ps = ctx.saved_tensors
        B, H = grad_out.shape[:2]
        go = grad_out.reshape(q3.shape[0], q3.shape[1], v3.shape[2]).to(v3.dtype)  # (autocast: can be float32)
        dq, dk, dv = [], None, None
        for (q0, q1, keys), p, p_mm in zip(reversed(ctx.blocks), reversed(ps[0::2]), reversed(ps[1::2])):
            gb = go[:, q0:q1]
            ds = _native_train.softmax_rows_backward(torch.bmm(gb, v3[:, :keys].transpose(1, 2)), p, scale=ctx.scale)  # κ dS
            dq.append(torch.bmm(ds, k3[:, :keys]))
            dk_b, dv_b = torch.bmm(ds.transpose(1, 2), q3[:, q0:q1]), torch.bmm(p_mm.transpose(1, 2), gb)
            if dk is None:  # the last block sees every key
                dk, dv = dk_b, dv_b
            else:
                dk[:, :keys] += dk_b
                dv[:, :keys] += dv_b
        dq = dq[0] if len(dq) == 1 else torch.cat(dq[::-1], dim=1)
        return (dq.view(B, H, *dq.shape[1:]), dk.view(B, H, *dk.shape[1:]), dv.view(B, H, *dv.shape[1:]), None, None,
                None)


# The most keys fused_short_attention takes; past them (and for bf16 with native bf16 past FUSED_KEYS_NATIVE_BF16, where
# oneDNN's bf16 products win) NativeShortAttention's batched products: the limits are where the fused kernel's fwd + bwd
# stops beating the products (``benchmarks/train_passes.py``'s attention rows; see docs/performance.md).
FUSED_KEYS = SHORT_KEYS
FUSED_KEYS_NATIVE_BF16 = 128


def fused_applies(q, k, v) -> bool:
    """Whether :func:`fused_short_attention` takes a (mask-free, float32 or bf16) request: key counts as above, the
    value width the query's, each operand's last stride 1, at least one query (an empty request's gradients come
    in with any strides: the products path)."""
    limit = FUSED_KEYS_NATIVE_BF16 if q.dtype == torch.bfloat16 and _native.isa() == 2 else FUSED_KEYS
    return (0 < q.shape[2] and k.shape[2] <= limit and v.shape[-1] == q.shape[-1]
            and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1)


def fused_short_attention(q, k, v, scale, causal, window):
    """:class:`NativeShortAttention`'s computation as one autograd node
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
