"""The wrappers of attnlab's C++ training passes (loaded by :mod:`attnlab._native`): RMSNorm, rotary embedding and an
FFN's (gated) activation forward and backward in one pass each (``csrc/train.cpp``), the short backend's fused
attention (``short_attention.cpp``), the int8 roundings and products of :mod:`attnlab.adapt.int8_training`
(``int8_quantize.cpp``, ``int8_product.cpp``, ``int8_train.cpp``) and the GPT block (``gpt_block.cpp``). Each reads
and writes float32 or bfloat16 with float32 arithmetic, in the caller's instruction set, and raises RuntimeError
where the kernels are not :func:`~attnlab._native.available` (callers check that first).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from attnlab import _native
from attnlab._native import ACTIVATIONS, GATES


def rms_norm_train(x: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """RMSNorm's training forward in one pass: ``x (..., E)`` contiguous float32 or bfloat16, ``w (E,)`` float32 ->
    ``(y, r)``, ``y = (x · r) ⊙ w`` in ``x``'s dtype and ``r = (mean(x²) + ε)^(-1/2)`` float32, one per row (what
    :func:`rms_norm_train_backward` needs beside ``x``).

    Raises:
        RuntimeError: the native kernels are not :func:`~attnlab._native.available` (callers check that first).
    """
    _native._need()
    return _native._state["rms_norm_train"](x, w, eps)


def rms_norm_train_backward(dy: Tensor, x: Tensor, w: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
    """RMSNorm's gradients in one pass over the rows, ``x̂ = x · r``, ``h = dy ⊙ w``::

        dx = r (h − x̂ · mean(h ⊙ x̂)),    dw = Σ_rows dy ⊙ x̂  (float32)

    ``dy`` like ``x`` (contiguous, same dtype), ``w`` and ``r`` from :func:`rms_norm_train`.

    Raises:
        RuntimeError: the native kernels are not :func:`~attnlab._native.available` (callers check that first).
    """
    _native._need()
    return _native._state["rms_norm_train_backward"](dy, x, w, r)


def rope_train(x: Tensor, cos: Tensor, sin: Tensor, *, inverse: bool = False) -> Tensor:
    """Rotary embedding of ``x (B, H, L, D)`` (float32 or bfloat16, any strides with the last one 1) in one pass,
    half-split pairs ``(i, i + D/2)`` rotated by ``φ`` (``-φ`` with ``inverse``: the backward, ``Rᵀ = R(−φ)``)::

        y_i = x_i cos φ_i − x_{i+D/2} sin φ_i,    y_{i+D/2} = x_{i+D/2} cos φ_i + x_i sin φ_i

    ``cos``, ``sin`` ``(L, D/2)`` contiguous float32; the arithmetic in float32, one rounding to ``x``'s dtype; ``y``
    contiguous.

    Raises:
        RuntimeError: the native kernels are not :func:`~attnlab._native.available` (callers check that first).
    """
    _native._need()
    return _native._state["rope_train"](x, cos, sin, -1.0 if inverse else 1.0)


def act_train(g: Tensor, u: Optional[Tensor], activation: str) -> Tensor:
    """An FFN's activation in one pass, ``h = act(g) ⊙ u`` (gated, ``activation`` one of :data:`GATES`) or ``act(g)``
    (``u`` None, one of :data:`ACTIVATIONS`); ``g``, ``u`` contiguous float32 or bfloat16 of one shape and dtype, the
    arithmetic in float32 (``decode_body.h``: e^x within ~1 ulp, erf within 1.5e-7).

    Raises:
        RuntimeError: the native kernels are not :func:`~attnlab._native.available` (callers check that first).
    """
    _native._need()
    return _native._state["act_train"](g, u, (GATES if u is not None else ACTIVATIONS)[activation], False)[0]


def act_with_grad(g: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    """A plain activation (one of :data:`ACTIVATIONS`) and its derivative in one pass: ``(act(g), act'(g))``, both in
    ``g``'s dtype (contiguous float32 or bfloat16), the arithmetic in float32 as :func:`act_train` (which computes
    the same ``act(g)`` bits). Keeping ``act'(g)`` makes the backward one product, ``∂L/∂g = ∂L/∂h ⊙ act'(g)``.

    Raises:
        RuntimeError: the native kernels are not :func:`~attnlab._native.available` (callers check that first).
    """
    _native._need()
    return _native._state["act_train"](g, None, ACTIVATIONS[activation], True)


def act_kept_train(g: Tensor, activation: str) -> Tensor:
    """``act(g)`` as one autograd node that keeps ``act'(g)`` (:func:`act_with_grad`) for its backward,
    ``∂L/∂g = ∂L/∂h ⊙ act'(g)`` (``act_train``'s autograd, :mod:`attnlab._native_library`; training, plain
    activations).

    Raises:
        RuntimeError: the native kernels are not :func:`~attnlab._native.available` (callers check that first).
    """
    _native._need()
    return _native._state["act_train"](g, None, ACTIVATIONS[activation], True)[0]


def act_train_backward(dh: Tensor, g: Tensor, u: Optional[Tensor], activation: str) -> tuple[Tensor, Optional[Tensor]]:
    """:func:`act_train`'s gradients in one pass: ``dg = dh ⊙ u ⊙ act'(g)``, ``du = dh ⊙ act(g)`` (None without ``u``).

    Raises:
        RuntimeError: the native kernels are not :func:`~attnlab._native.available` (callers check that first).
    """
    _native._need()
    dg, du = _native._state["act_train_backward"](dh, g, u, (GATES if u is not None else ACTIVATIONS)[activation])
    return dg, (du if u is not None else None)


def short_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, causal: bool, window: Optional[int]
                    ) -> tuple[Tensor, Tensor]:
    """``P = softmax(κ Q Kᵀ)`` over the keys each query sees (query i at position ``t = i + Lk − Lq`` sees key j where
    ``causal`` (``j ≤ t``) and ``window`` w (``t − j < w``; without causal ``|t − j| < w``) allow; a row that sees none
    is 0), ``O = P V``, one (batch, head) a task in float32: ``q (B, H, Lq, D)``, ``k``, ``v (B, H, Lk, D)`` float32 or
    bfloat16 of one dtype, any strides with the last 1 (views of a packed projection). Returns ``(out, p)``: ``out``
    in q's dtype, ``(B, H, Lq, D)`` as a view of a contiguous ``(B, Lq, H, D)`` (the heads merged); ``p (B, H, Lq,
    Lk)`` float32 for :func:`short_attention_backward`, written only where computed (a causal block of 16 queries
    stops at its last query's keys).

    Raises:
        RuntimeError: the native kernels are not :func:`~attnlab._native.available` (callers check that first), or
            the operands do not fit (named in the message).
    """
    _native._need()
    return _native._state["short_attention"](q, k, v, scale, causal, -1 if window is None else window)


def short_attention_train(q: Tensor, k: Tensor, v: Tensor, *, scale: float, causal: bool, window: Optional[int]
                          ) -> Tensor:
    """:func:`short_attention`'s ``out`` as one autograd node whose backward is :func:`short_attention_backward` from
    the ``p`` it kept (the op's autograd, :mod:`attnlab._native_library`; the short backend's fused path)."""
    _native._need()
    return _native._state["short_attention"](q, k, v, scale, causal, -1 if window is None else window)[0]


def short_attention_packed(qkv: Tensor, heads: int, *, scale: float, causal: bool, window: Optional[int]) -> Tensor:
    """:func:`short_attention_train` on the packed projection ``qkv (B, L, 3E)`` (float32 or bfloat16, the last stride
    1) that q, k, v are cut from — ``[q | k | v]``, ``heads`` heads of ``E / heads`` each — as one autograd node:
    ``out (B, L, E)`` with the heads merged; its backward (``short_attention_packed_backward``) writes ``∂L/∂qkv``
    as one tensor (no split and views of q, k, v in the graph, no concatenation of their gradients). The same bits
    as the unpacked node."""
    _native._need()
    return _native._state["short_attention_packed"](qkv, heads, scale, causal, -1 if window is None else window)[0]


def short_attention_backward(q: Tensor, k: Tensor, v: Tensor, p: Tensor, d_out: Tensor, *, scale: float,
                             causal: bool, window: Optional[int]) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`short_attention`'s gradients from its ``p``::

        dP = dO Vᵀ,   κ dS = κ P ∘ (dP − rowsum(dP ∘ P)),   dQ = (κ dS) K,   dK = (κ dS)ᵀ Q,   dV = Pᵀ dO

    ``d_out`` like ``q`` (any strides, the last 1); each gradient in q's dtype, ``(B, H, L, D)`` viewing a contiguous
    ``(B, L, H, D)``.
    """
    _native._need()
    return _native._state["short_attention_backward"](q, k, v, p, d_out, scale, causal,
                                                      -1 if window is None else window)


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """Whether no entry of any of ``tensors`` (CPU) is NaN or ±inf: one pass over each, by the native kernels for
    float32 and bfloat16 tensors whose elements fill one block of memory (contiguous or permuted), else
    ``torch.isfinite`` (the attention pipeline's check, :func:`attnlab.backends.dispatch.all_finite`).

    Raises:
        RuntimeError / NotImplementedError: the native kernels are not :func:`~attnlab._native.available`, or a
            tensor is not on the CPU (the caller routes those to ``sum``).
    """
    _native._need()
    return _native._state["all_finite"](list(tensors))


def clip_grad_norm_(grads: list[Tensor], max_norm: float) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for contiguous float32 CPU gradients in one call: ``‖g‖ = (Σ g²)^½`` over
    all of them and, where ``c = max_norm / (‖g‖ + 1e-6) < 1`` (or NaN), every gradient scaled by ``c`` in place;
    returns ``‖g‖`` (float32, 0-d). One pass of fixed chunks (the same bits on any thread count) where PyTorch's CPU
    path runs a norm and a product per tensor.

    Raises:
        RuntimeError: the native kernels are not :func:`~attnlab._native.available` (callers check that first), or a
            gradient is not a contiguous float32 CPU tensor, or ``max_norm`` is not positive and finite.
    """
    _native._need()
    return _native._state["clip_grad_norm_"](grads, float(max_norm))


def quantize_rows(x: Tensor, levels: int, c: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Symmetric int8 with one scale a row: ``s_r = max_j |x_rj c_j| / levels``, ``q_rj = round(x_rj c_j / s_r)``
    (half to even) ``∈ [−levels, levels]``; ``x (R, n)`` contiguous float32 or bfloat16, ``c (n,)`` float32 or None
    (1). Returns ``(q int8 (R, n), s float32 (R,))``; a zero row has ``s = 0``, a row holding a NaN or an infinity
    ``s = NaN`` (its products come out NaN) and ``q = 0``.

    Raises:
        RuntimeError: the native kernels are not :func:`~attnlab._native.available` (callers check that first).
    """
    _native._need()
    return _native._state["quantize_rows"](x, c, levels)


def quantize_rows_cols(x: Tensor, levels: int, col_levels: int, c: Optional[Tensor] = None
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`quantize_rows` of ``x ⊙ c`` and, in the same two reads of ``x``, ``x`` rounded with one scale a column
    (``sc_j = max_r |x_rj| / col_levels``, ``c`` not applied) written transposed, ``qct_jr = round(x_rj / sc_j)``
    (contiguous ``(n, R)``: the operand of a product over the rows, which oneDNN runs fastest so), and the column sums
    ``Σ_r x_rj`` in float32 (fixed blocks of rows: the same bits on any thread count). Returns ``(q, s, qct (n, R),
    sc (n,), sum (n,))``."""
    _native._need()
    return _native._state["quantize_rows_cols"](x, c, levels, col_levels)


def dequantize(acc: Tensor, rs: Tensor, cs: Optional[Tensor] = None, bias: Optional[Tensor] = None, *,
               dtype: torch.dtype = torch.float32) -> Tensor:
    """An int8 product back to floating point: ``y_rj = acc_rj (rs_r cs_j) + b_j`` for ``acc (R, n)`` int32
    (``torch._int_mm``'s), ``rs (R,)``, ``cs (n,)`` (None: 1), ``bias (n,)`` (None: 0), all float32; ``y`` in
    ``dtype`` (float32 or bfloat16)."""
    _native._need()
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    return _native._state["dequantize"](acc, rs, cs, bias, dtype == torch.bfloat16)


def int8_product(a: Tensor, b: Tensor, rs: Tensor, cs: Optional[Tensor] = None, bias: Optional[Tensor] = None, *,
                 dtype: torch.dtype = torch.float32, max_inner: int) -> Tensor:
    """``diag(rs) (a b) diag(cs) + bias`` for int8 ``a (M, K)``, ``b (K, N)`` (any strides): ``torch._int_mm``'s exact
    int32 sums rescaled by :func:`dequantize`, in parts of ``max_inner`` terms along K (each rescaled, the parts summed
    in float32) where a longer int32 sum could overflow. With AVX2 the product may be attnlab's own
    (``csrc/int8_gemm.h``, see :func:`int8_kernel`): the same int32 sums and rescaling, so the same bits."""
    _native._need()
    return _native._state["int8_product"](a, b, rs, cs, bias, dtype == torch.bfloat16, max_inner)


def int8_linear(x: Tensor, w: Tensor, b: Optional[Tensor], *, left: int, right: int, cols: bool, dtype: torch.dtype
                ) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """An int8 linear layer's training forward in one call (:mod:`attnlab.adapt.int8_training`): ``x (T, in)``
    contiguous float32 or bfloat16 by rows to ``±left``, ``w (out, in)`` float32 by rows to ``±right``, ``b (out,)``
    float32 or None::

        y = diag(s_x) (q(x) q(w)ᵀ) diag(s_w) + b          (in ``dtype``, float32 or bfloat16)

    Returns ``(y, qw, sw, qxt, sxc)``: with ``cols`` also ``x`` by columns to ``±right``, transposed (``qxt (in, T)``,
    ``sxc (in,)``: the weight gradient's operand; contiguous, or where that product will be ``csrc/int8_gemm.h``'s,
    which reads either layout, the ``(in, T)`` view of the rounding written as ``x`` lies: no transposing pass), else
    those two None."""
    _native._need()
    y, qw, sw, qxt, sxc = _native._state["int8_linear"](x, w, b, left, right, cols, dtype == torch.bfloat16)
    return (y, qw, sw, qxt, sxc) if cols else (y, qw, sw, None, None)


def int8_linear_train(x: Tensor, w: Tensor, b: Optional[Tensor], *, left: int, right: int, dtype: torch.dtype
                      ) -> Tensor:
    """An int8 linear layer for training as one autograd node: ``y = x wᵀ + b`` through :func:`int8_linear` (``x
    (..., in)`` float32 or bfloat16, any strides; ``w (out, in)`` float32; the output in ``dtype``), whose backward
    is :func:`int8_linear_backward` for whichever of ``x``, ``w``, ``b`` require a gradient (``∂L/∂x`` in ``x``'s
    dtype, the others float32; ``int8_linear``'s autograd, :mod:`attnlab._native_library`). ``w``'s columns are
    rounded for the weight gradient only where ``w`` requires one."""
    _native._need()
    x2 = x.reshape(-1, x.shape[-1])
    y = _native._state["int8_linear"](x2.contiguous(), w, b, left, right, w.requires_grad, dtype == torch.bfloat16)[0]
    return y.view(*x.shape[:-1], w.shape[0])


def gpt_block_train(x: Tensor, n1w: Tensor, n1b: Optional[Tensor], wqkv: Tensor, bqkv: Optional[Tensor], wo: Tensor,
                    bo: Optional[Tensor], n2w: Tensor, n2b: Optional[Tensor], w1: Tensor, b1: Optional[Tensor],
                    w2: Tensor, b2: Optional[Tensor], *, heads: int, scale: float, eps: tuple[float, float],
                    activation: str, left: int, right: int) -> Tensor:
    """A pre-norm GPT block's training forward as one autograd node (``csrc/gpt_block.cpp``'s ``gpt_block_train`` and
    its backward op, :mod:`attnlab._native_library`; the caller, :func:`attnlab.nn.layer_native.decoder_train`,
    checks that it applies), ``x (B, L, C)`` float32::

        h₁ = LN₁(x),  qkv = int8(h₁, W_qkv, b_qkv),  a = softmax(κ q kᵀ, causal) v,  x₃ = x + int8(a, W_o, b_o)
        h₂ = LN₂(x₃),  y = x₃ + int8(act(int8(h₂, W₁, b₁)), W₂, b₂)

    ``int8`` is :func:`int8_linear_train`'s layer at levels ``left``/``right``, the attention
    :func:`short_attention_packed`'s, the activation :func:`act_kept_train`'s: the same calls as those nodes, so the
    same bits, forward and backward. Raises RuntimeError "gpt_block_train: not finite" (no node recorded) where the
    projection or the attention's output is not finite."""
    _native._need()
    return _native._state["gpt_block_train"](x, n1w, n1b, wqkv, bqkv, wo, bo, n2w, n2b, w1, b1, w2, b2, heads, scale,
                                             eps[0], eps[1], ACTIVATIONS[activation], left, right)[0]


_INT8_TRAINING: dict[type, tuple[int, int]] = {}  # a class -> its levels (register_int8_training)


def register_int8_training(cls: type, left: int, right: int) -> None:
    """Declare that ``cls``'s training forward is exactly :func:`int8_linear_train` at levels ``left``/``right``, so
    that a layer whose four products are of this class may train as one node (:func:`gpt_block_train`;
    :func:`attnlab.backends.dispatch.plan_layer` reads it). The class itself, not its subclasses (which may
    compute otherwise)."""
    _INT8_TRAINING[cls] = (int(left), int(right))


def int8_training_levels(cls: type) -> Optional[tuple[int, int]]:
    """The levels ``(left, right)`` that :func:`register_int8_training` declared for exactly ``cls``, or None."""
    return _INT8_TRAINING.get(cls)


def int8_linear_backward(g: Tensor, qw: Tensor, sw: Tensor, qxt: Optional[Tensor], sxc: Optional[Tensor], *,
                         left: int, right: int, dx: bool, dw: bool, db: bool, dx_dtype: torch.dtype
                         ) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """:func:`int8_linear`'s gradients from ``g = ∂L/∂y (T, out)`` (contiguous float32 or bfloat16), each only where
    asked for (else None)::

        Z = g diag(s_w) ≈ diag(s_z) q_left(Z):   ∂L/∂x = diag(s_z) (q(Z) q(w))                (in ``dx_dtype``)
        g ≈ q_left(g) diag(s_g) by columns:       ∂L/∂w = diag(s_g) (q(g)ᵀ q(x)) diag(s_xc)    (float32)
        ∂L/∂b = Σ_t g_t                                                                        (float32)
    """
    _native._need()
    if qxt is None:  # a frozen layer's: the op takes empty tensors for them
        qxt, sxc = qw.new_empty(0), sw.new_empty(0)
    out = _native._state["int8_linear_backward"](g, qw, sw, qxt, sxc, left, right, dx, dw, db,
                                                 dx_dtype == torch.bfloat16)
    return tuple(t if want else None for t, want in zip(out, (dx, dw, db)))


INT8_KERNELS = {"auto": -1, "onednn": 0, "ours": 1}


def int8_kernel(kernel: Optional[str] = None) -> str:
    """Which int8 product :func:`int8_product` (and so the int8 layers) runs with AVX2 kernels (isa 1); returns the
    setting, and with ``kernel`` sets it and returns the one before.

    - ``"auto"`` (the default): ``csrc/int8_gemm.h`` where oneDNN has no VNNI instruction to use (a CPU without
      AVX-VNNI and AVX512-VNNI, or oneDNN capped by ``ONEDNN_MAX_CPU_ISA`` to AVX2 or below), else ``torch._int_mm``;
    - ``"ours"``: ``csrc/int8_gemm.h`` wherever its condition holds (``b`` within ±63; K is padded to a multiple of 8);
    - ``"onednn"``: ``torch._int_mm`` always.

    Either gives the same bits (the exact int32 sums, rescaled alike); only the time differs — by 50× or more on a CPU
    with AVX2 and no VNNI, where ``torch._int_mm`` is oneDNN's reference loop (see docs/performance.md):
    ``"onednn"`` is there for comparisons. AVX-512 (isa 2) and the portable set always take
    ``torch._int_mm``, as do the products ours does not take (``b`` beyond ±63: never the int8 layers').
    """
    _native._need()
    names = {v: k for k, v in INT8_KERNELS.items()}
    if kernel is None:
        return names[int(_native._state["int8_kernel"](-2))]
    if kernel not in INT8_KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(map(repr, INT8_KERNELS))}, got {kernel!r}")
    return names[int(_native._state["int8_kernel"](INT8_KERNELS[kernel]))]
