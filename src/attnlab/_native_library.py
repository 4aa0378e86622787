"""What ``torch.library`` knows of attnlab's C++ ops beyond their CPU kernels, so that ``torch.compile``,
``torch.export`` and autograd treat them as they treat PyTorch's own operations:

- a fake implementation of every op (:func:`torch.library.register_fake`): the outputs' shapes, dtypes and strides
  from the inputs' alone, never their data, so that a graph can be traced through the op;
- the autograd of the training passes that are one node (:func:`torch.library.register_autograd`), each a forward op
  whose outputs include what its backward op reads:

  ========================================  ==============================================
  forward                                   backward
  ========================================  ==============================================
  ``int8_linear`` (the int8 training layer)  ``int8_linear_backward``
  ``short_attention`` (the fused kernel)     ``short_attention_backward``
  ``short_attention_packed``                 ``short_attention_packed_backward``
  ``act_train`` (with or without ``keep``)   ``∂L/∂h ⊙ act'(g)`` / ``act_train_backward``
  ``gpt_block_train``                        ``gpt_block_train_backward``
  ========================================  ==============================================

None of these backwards is differentiable again: with ``create_graph=True`` each raises a RuntimeError that names the
path (a gradient penalty through it would otherwise be dropped); ``ATTNLAB_NATIVE=0`` runs the same model on PyTorch's
operations (the int8 training layer is then ``nn.Linear``'s, which differentiates twice).

The ops of no tensor (``int8_kernel``, ``int8_cols_laid``, ``cpu_isa``, ``limit_isa``: settings and questions, not
computations) need no fake; ``all_finite`` has none: it returns a Python bool read from the data (compiled code does
not call it: :func:`attnlab.backends.dispatch.all_finite`).
``decoder_step``'s fake is its finite result, ``(B, 1, E)``; where the layer's projection is not finite the op returns
an empty tensor instead (a shape no fake can foresee), so compiled code takes the layer's modules
(:func:`attnlab.nn.layer_native.decoder_step`).

:func:`register` runs once, when :mod:`attnlab._native` has loaded the library.
"""
from __future__ import annotations

import torch
from torch import Tensor

_done: list = []
F32, I8 = torch.float32, torch.int8


def refuse_second_derivative(path: str) -> None:
    """Raise where a backward runs with ``create_graph=True`` (grad mode on inside it): ``path`` has no second
    derivative."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"attnlab: {path} has no second derivative (a gradient taken through it with "
                           "create_graph=True would be silently detached); ATTNLAB_NATIVE=0 runs the model on "
                           "PyTorch's operations instead")


def _merged(like: Tensor, rows: int) -> Tensor:
    """``(B, H, rows, D)`` of ``like``'s dtype as a view of a new contiguous ``(B, rows, H, D)`` (csrc's
    ``heads_merged``)."""
    B, H, _, D = like.shape
    return like.new_empty((B, rows, H, D)).permute(0, 2, 1, 3)


def _rows(x: Tensor) -> int:
    last = x.shape[-1] if x.dim() else 1
    return x.numel() // last if last else 0


def _cols_layout(x_rows: int, n: int, left: int, right: int) -> Tensor:
    """The int8 ``(n, x_rows)`` operand ``qxt`` of an int8 layer's weight gradient as ``int8_linear`` lays it:
    contiguous, or the transposed view of an ``(x_rows, n)`` rounding where the product that reads it is
    ``int8_gemm.h``'s (asked of the library: ``int8_cols_laid``)."""
    if torch.ops.attnlab.int8_cols_laid.default(x_rows, left, right):
        return torch.empty((x_rows, n), dtype=I8).t()
    return torch.empty((n, x_rows), dtype=I8)


def _fakes(ops) -> None:
    fake = torch.library.register_fake

    # matvec.cpp
    fake("attnlab::matvec")(lambda x, w, scale, bias: x.new_empty((*x.shape[:-1], w.shape[0])))
    fake("attnlab::int4_dequantize")(lambda w, scale, K: scale.new_empty((w.shape[0], K)))
    fake("attnlab::gated_matvec")(
        lambda x, w1, s1, b1, w3, s3, b3, act: x.new_empty((*x.shape[:-1], w1.shape[0])))

    # decode.cpp
    fake("attnlab::rms_norm")(lambda x, w, eps: torch.empty_like(x))
    fake("attnlab::activate")(lambda x, g, act: torch.empty_like(x))
    fake("attnlab::attend_decode")(
        lambda qkv, k_cache, v_cache, length, heads, kv_heads, cos, sin, interleaved, scale:
        qkv.new_empty((qkv.shape[0], 1, heads * k_cache.shape[-1])))
    fake("attnlab::decoder_step")(lambda x, k_cache, v_cache, t, *args: torch.empty_like(x))

    # flash_forward.cpp, flash_backward.cpp
    fake("attnlab::flash_forward")(
        lambda q, k, v, *args: (q.new_empty((*q.shape[:3], v.shape[-1])), q.new_empty(q.shape[:3])))
    fake("attnlab::flash_backward")(
        lambda q, k, v, out, lse, d_out, *args: (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)))

    # train.cpp: the element-wise passes
    fake("attnlab::rms_norm_train")(
        lambda x, w, eps: (torch.empty_like(x), x.new_empty((_rows(x),), dtype=F32)))
    fake("attnlab::rms_norm_train_backward")(
        lambda dy, x, w, r: (torch.empty_like(x), w.new_empty((x.shape[-1] if x.dim() else 1,))))
    fake("attnlab::rope_train")(lambda x, cos, sin, sign: x.new_empty(x.shape))
    fake("attnlab::act_train")(
        lambda g, u, act, keep: (torch.empty_like(g), torch.empty_like(g) if keep else g.new_empty((0,))))
    fake("attnlab::act_train_backward")(
        lambda dh, g, u, act: (torch.empty_like(g), torch.empty_like(g) if u is not None else g.new_empty((0,))))
    fake("attnlab::clip_grad_norm_")(lambda grads, max_norm: torch.empty((), dtype=F32))

    # short_attention.cpp: the short backend's kernel
    fake("attnlab::short_attention")(
        lambda q, k, v, scale, causal, window: (
            _merged(q, q.shape[2]), q.new_empty((*q.shape[:3], k.shape[2]), dtype=F32)))
    fake("attnlab::short_attention_backward")(
        lambda q, k, v, p, d_out, scale, causal, window: (
            _merged(q, q.shape[2]), _merged(q, k.shape[2]), _merged(q, k.shape[2])))

    @fake("attnlab::short_attention_packed")
    def _(qkv, heads, scale, causal, window):
        B, L, E3 = qkv.shape
        return qkv.new_empty((B, L, E3 // 3)), qkv.new_empty((B, heads, L, L), dtype=F32)

    fake("attnlab::short_attention_packed_backward")(
        lambda qkv, p, d_out, heads, scale, causal, window: qkv.new_empty(qkv.shape))

    # int8_quantize.cpp, int8_product.cpp, int8_train.cpp: the int8 roundings, products and layer
    fake("attnlab::quantize_rows")(
        lambda x, c, levels: (x.new_empty(x.shape, dtype=I8), x.new_empty(x.shape[:1], dtype=F32)))
    fake("attnlab::quantize_rows_cols")(
        lambda x, c, levels, col_levels: (
            x.new_empty(x.shape, dtype=I8), x.new_empty(x.shape[:1], dtype=F32),
            x.new_empty((x.shape[1], x.shape[0]), dtype=I8), x.new_empty(x.shape[1:], dtype=F32),
            x.new_empty(x.shape[1:], dtype=F32)))
    fake("attnlab::dequantize")(
        lambda acc, rs, cs, b, bf16: acc.new_empty(acc.shape, dtype=torch.bfloat16 if bf16 else F32))
    fake("attnlab::int8_product")(
        lambda a, b, rs, cs, bias, bf16, max_inner: a.new_empty(
            (a.shape[0], b.shape[1]), dtype=torch.bfloat16 if bf16 else F32))

    @fake("attnlab::int8_linear")
    def _(x, w, b, left, right, cols, bf16):
        T, n = x.shape
        y = x.new_empty((T, w.shape[0]), dtype=torch.bfloat16 if bf16 else F32)
        qw, sw = w.new_empty(w.shape, dtype=I8), w.new_empty(w.shape[:1], dtype=F32)
        if cols:
            return y, qw, sw, _cols_layout(T, n, left, right), x.new_empty((n,), dtype=F32)
        return y, qw, sw, x.new_empty((0,), dtype=I8), x.new_empty((0,), dtype=F32)

    @fake("attnlab::int8_linear_backward")
    def _(g, qw, sw, qxt, sxc, left, right, dx, dw, db, dx_bf16):
        none = g.new_empty((0,), dtype=F32)
        T, (out, n) = g.shape[0], qw.shape
        return (g.new_empty((T, n), dtype=torch.bfloat16 if dx_bf16 else F32) if dx else none,
                g.new_empty((out, n), dtype=F32) if dw else none, g.new_empty((out,), dtype=F32) if db else none)

    # gpt_block.cpp: the GPT block
    @fake("attnlab::gpt_block_train")
    def _(x, n1w, n1b, wqkv, bqkv, wo, bo, n2w, n2b, w1, b1, w2, b2, heads, scale, eps1, eps2, act, left, right):
        B, L, C = x.shape
        T, E3, E, Fw = B * L, wqkv.shape[0], wqkv.shape[0] // 3, w1.shape[0]
        stat = lambda: x.new_empty((B, L, 1))  # noqa: E731  (LayerNorm's mean and rstd)

        def layer(out: int, n: int):  # an int8 layer's rounded operands: qw, sw, qxt, sxc
            return [x.new_empty((out, n), dtype=I8), x.new_empty((out,)), _cols_layout(T, n, left, right),
                    x.new_empty((n,))]

        saved = [stat(), stat(), *layer(E3, C), x.new_empty((B, L, E3)), x.new_empty((B, heads, L, L)),
                 *layer(C, E), x.new_empty((B, L, C)), stat(), stat(), *layer(Fw, C), x.new_empty((T, Fw)),
                 *layer(C, Fw)]
        return x.new_empty((B, L, C)), saved

    @fake("attnlab::gpt_block_train_backward")
    def _(dy, x, saved, n1w, n1b, wqkv, bqkv, wo, bo, n2w, n2b, w1, b1, w2, b2, heads, scale, act, left, right):
        like = [x, n1w, n1b, wqkv, bqkv, wo, bo, n2w, n2b, w1, b1, w2, b2]
        return [x.new_empty(t.shape) if t is not None else x.new_empty((0,)) for t in like]


# the autograd of the one-node training passes


def _only_first(ctx, rest) -> None:
    """The op's outputs after the first are what its backward reads, not results: no gradient flows into them (and
    none is made of zeros for them)."""
    ctx.mark_non_differentiable(*rest)
    ctx.set_materialize_grads(False)


def _int8_setup(ctx, inputs, output):
    x, w, b, left, right, cols, bf16 = inputs
    ctx.save_for_backward(*output[1:])
    _only_first(ctx, output[1:])
    ctx.levels, ctx.x_bf16 = (left, right), x.dtype == torch.bfloat16


def _int8_backward(ctx, gy, *_):
    refuse_second_derivative("the int8 training layer (attnlab.adapt.int8_training)")
    qw, sw, qxt, sxc = ctx.saved_tensors
    nx, nw, nb = ctx.needs_input_grad[:3]
    g = gy if gy.dtype in (torch.float32, torch.bfloat16) else gy.float()
    dx, dw, db = torch.ops.attnlab.int8_linear_backward.default(g.contiguous(), qw, sw, qxt, sxc, *ctx.levels, nx, nw,
                                                               nb, ctx.x_bf16)
    return dx if nx else None, dw if nw else None, db if nb else None, None, None, None, None


def _short_setup(ctx, inputs, output):
    q, k, v, scale, causal, window = inputs
    ctx.save_for_backward(q, k, v, output[1])
    ctx.args = (scale, causal, window)
    _only_first(ctx, output[1:])


def _grad_rows(grad: Tensor, dtype: torch.dtype) -> Tensor:
    """A gradient as the short kernels read it: in ``dtype``, the last stride 1, no expanded dimension (the
    gradient of a ``sum()`` or ``mean()`` arrives as a stride-0 view)."""
    grad = grad.to(dtype)
    expanded = any(st == 0 and n > 1 for st, n in zip(grad.stride(), grad.shape))
    return grad if grad.stride(-1) == 1 and not expanded else grad.contiguous()


def _short_backward(ctx, g_out, _g_p):
    refuse_second_derivative("the short backend's fused attention kernel")
    q, k, v, p = ctx.saved_tensors
    dq, dk, dv = torch.ops.attnlab.short_attention_backward.default(q, k, v, p, _grad_rows(g_out, q.dtype), *ctx.args)
    return dq, dk, dv, None, None, None


def _packed_setup(ctx, inputs, output):
    qkv, heads, scale, causal, window = inputs
    ctx.save_for_backward(qkv, output[1])
    ctx.args = (heads, scale, causal, window)
    _only_first(ctx, output[1:])


def _packed_backward(ctx, g_out, _g_p):
    refuse_second_derivative("the short backend's fused attention kernel")
    qkv, p = ctx.saved_tensors
    dqkv = torch.ops.attnlab.short_attention_packed_backward.default(qkv, p, _grad_rows(g_out, qkv.dtype), *ctx.args)
    return dqkv, None, None, None, None


def _act_setup(ctx, inputs, output):
    g, u, act, keep = inputs
    ctx.keep, ctx.act, ctx.gated = keep, act, u is not None
    ctx.save_for_backward(output[1]) if keep else ctx.save_for_backward(g, u)
    _only_first(ctx, output[1:])


def _act_backward(ctx, g_h, _g_d):
    refuse_second_derivative("the FFN activation's C++ pass")
    if ctx.keep:  # ∂L/∂g = ∂L/∂h ⊙ act'(g), the derivative kept by the forward
        (d,) = ctx.saved_tensors
        return g_h.mul(d), None, None, None
    g, u = ctx.saved_tensors
    dg, du = torch.ops.attnlab.act_train_backward.default(g_h.contiguous(), g, u, ctx.act)
    return dg, (du if ctx.gated else None), None, None


def _block_setup(ctx, inputs, output):
    x, n1w, n1b, wqkv, bqkv, wo, bo, n2w, n2b, w1, b1, w2, b2, heads, scale, eps1, eps2, act, left, right = inputs
    ctx.save_for_backward(x, n1w, n1b, wqkv, bqkv, wo, bo, n2w, n2b, w1, b1, w2, b2, *output[1])
    ctx.args = (heads, scale, act, left, right)
    _only_first(ctx, output[1])


def _block_backward(ctx, dy, *_):
    refuse_second_derivative("the GPT block's one-node training pass (attnlab.nn.layer_native.decoder_train)")
    x, *params = ctx.saved_tensors[:13]
    grads = torch.ops.attnlab.gpt_block_train_backward.default(dy.contiguous(), x, list(ctx.saved_tensors[13:]),
                                                               *params, *ctx.args)
    inputs = (x, *params)
    return (*(gr if t is not None else None for gr, t in zip(grads, inputs)),) + (None,) * 7


def _autograd() -> None:
    reg = torch.library.register_autograd
    reg("attnlab::int8_linear", _int8_backward, setup_context=_int8_setup)
    reg("attnlab::short_attention", _short_backward, setup_context=_short_setup)
    reg("attnlab::short_attention_packed", _packed_backward, setup_context=_packed_setup)
    reg("attnlab::act_train", _act_backward, setup_context=_act_setup)
    reg("attnlab::gpt_block_train", _block_backward, setup_context=_block_setup)


def register() -> None:
    """Register the fakes and the autograd above (once per process; the library must be loaded)."""
    if _done:
        return
    _fakes(torch.ops.attnlab)
    _autograd()
    _done.append(True)
