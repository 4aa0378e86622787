"""The one attention pipeline and every choice of backend.

::

    scores  = score(q, k) * κ                    # κ = 1/sqrt(D) by default
    scores  = score_mod(scores, b, h, i, j)      # ALiBi, T5 bias, softcap, any function
    scores  = mask(scores, b, h, i, j)           # causal, window, bool/float mask, mask_mod
    weights = normalize(scores)                  # softmax, top-k softmax, hard, sparsemax
    out     = dropout(weights) @ v

Every backend in :data:`attnlab.backends.BACKENDS` computes exactly this. This module is the only place
that chooses among them: ``backend="auto"`` (:func:`select_backend`), an explicit name and its registered
fallback, ``return_lse`` (a backend that keeps the log-sum-exp), and whether a position bias goes in as a
dense additive mask or as a score_mod (:func:`position_bias_terms`).
"""
from __future__ import annotations

import logging
import math
from typing import Optional, Union

import torch
from torch import Tensor

from attnlab import _native, _native_train
from attnlab._checks import boolean
from attnlab.backends import AUTO_ORDER, BACKENDS, SPARSE_ORDER, short
from attnlab.backends.base import Backend, BackendUnavailable
from attnlab.backends.tiled import recover_weights
from attnlab.functional.masks import MaskMod
from attnlab.functional.request import ScoreMod, default_scale, indices, prepare

# A position bias larger than this many elements (H·L·S) is passed as a score_mod (computed block by block
# by the tiled backend, O(N) memory) instead of a dense additive mask.
DENSE_BIAS_LIMIT = 1 << 22


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Optional[Tensor] = None,
    causal: bool = False,
    window: Optional[int] = None,
    scale: Optional[float] = None,
    score_mod: Optional[ScoreMod] = None,
    mask_mod: Optional[MaskMod] = None,
    dropout_p: float = 0.0,
    normalize: str = "softmax",
    top_k: Optional[int] = None,
    return_weights: bool = False,
    return_lse: bool = False,
    backend: str = "auto",
) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """Scaled dot-product attention, ``normalize(κ Q Kᵀ + mods) V``, with every option of the pipeline.

    Args:
        q: queries ``(B, H, Lq, D)``.
        k: keys ``(B, Hkv, Lk, D)``; ``H % Hkv == 0`` (grouped-query / multi-query attention
            shares each key/value head among ``H // Hkv`` query heads).
        v: values ``(B, Hkv, Lk, Dv)``.
        mask: bool (True = may attend) or float (added to the scores), broadcastable to
            ``(B, H, Lq, Lk)``.
        causal: key ``j`` is visible to query ``i`` iff ``j <= Lk - Lq + i`` (bottom-right
            alignment: the last query is the last position, as when decoding with a cache).
        window: sliding window ``w``: key ``j`` is visible to the query at position ``p`` iff
            ``p - j < w`` (and ``j - p < w`` when not causal).
        scale: κ; default ``1 / sqrt(D)``.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, FlexAttention's
            signature, called with broadcastable index tensors and absolute positions. A mod
            whose output is ``score + bias(b, h, q_idx, kv_idx)`` may say so with
            ``score_mod.additive = True`` (ALiBi's and T5's do): the ``tiled`` backend then skips
            autograd inside its blocks when no tensor the mod reads needs a gradient.
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool``, FlexAttention's signature.
        dropout_p: dropout on the attention weights (pass 0 in eval mode).
        normalize: ``"softmax"``, ``"topk"`` (needs ``top_k``), ``"hard"`` (argmax forward,
            straight-through softmax gradient) or ``"sparsemax"``.
        top_k: number of scores kept per row with ``normalize="topk"``.
        return_weights: also return the weights ``(B, H, Lq, Lk)`` (before dropout).
        return_lse: also return the log-sum-exp ``LSE_i = log Σ_j e^(s_ij)`` ``(B, H, Lq)``
            (``-inf`` on empty rows), computed by the ``tiled`` backend in O(N) memory;
            :func:`attention_weights` recovers any rows' weights from it.
        backend: ``"auto"`` or a name in :data:`attnlab.backends.BACKENDS`.

    Returns:
        ``out (B, H, Lq, Dv)``, or ``(out, weights)`` with ``return_weights=True``, or
        ``(out, lse)`` with ``return_lse=True``. A query row that may attend to nothing gives
        zeros (and zero weights), never NaN.

    Raises:
        TypeError: a tensor argument is not a tensor, or a mod is not callable.
        ValueError: shapes, mask, window, top_k, dropout_p, normalize or backend are invalid.
    """
    request = prepare(q, k, v, mask=mask, causal=causal, window=window, scale=scale, score_mod=score_mod,
                      mask_mod=mask_mod, dropout_p=dropout_p, normalize=normalize, top_k=top_k,
                      return_weights=return_weights)
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    boolean("return_lse", return_lse)
    return attend(q, k, v, request, backend=backend, return_lse=return_lse)


def attend(q: Tensor, k: Tensor, v: Tensor, request: dict, *, backend: str = "auto", return_lse: bool = False,
           kv_finite: Optional[bool] = None, q_finite: Optional[bool] = None):
    """The pipeline after the checks, for callers inside attnlab that built ``request`` with
    :func:`~attnlab.functional.request.prepare` (``MultiheadAttention``): choose the backend, run it, and keep
    the NaN/inf semantics of :func:`attention`.

    ``kv_finite=True`` says the caller knows ``k`` and ``v`` hold no NaN or ±inf (a :class:`KVCache` that
    checked each entry as it was written), so only ``q`` is read for the check: a decode step then does not
    re-read the whole cache. ``q_finite`` says the same of ``q`` (``MultiheadAttention`` checks the one packed
    projection that q, k and v are cut from once per step). ``None`` checks them.
    """
    impl = choose(backend, q, k, v, request, return_lse=return_lse)
    _check_scale_overflow(q, k, request["scale"])

    def run(q, k, v):
        return _call(impl, q, k, v, request, return_lse)

    # the common case: one reduction per tensor (or q only, with kv_finite), then the backend as it is
    unknown = ([q] if q_finite is None else []) + ([k, v] if kv_finite is None else [])
    if q_finite is not False and kv_finite is not False and (not unknown or all_finite(*unknown)):
        out, extra = run(q, k, v)
        if not all_finite(out):  # finite inputs, non-finite output: the scores overflowed the dtype
            _check_scale_overflow(q, k, request["scale"], always=True)
    else:
        out, extra = _guarded(run, q, k, v, request)
    return (out, extra) if request["return_weights"] or return_lse else out


def attend_plain(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: Optional[float], backend: str,
                 packed: Optional[Tensor] = None) -> Optional[Tensor]:
    """:func:`attend` for a request of nothing but ``causal`` and ``scale`` (no mask, window, mod, dropout or weights;
    softmax) over q, k, v the caller has found finite, where it ends in the short backend's fused kernel
    (``backend="short"``, or ``"auto"`` taking it: training on a CPU, few keys, as many key/value as query heads):
    that kernel without building and validating the request, choosing among the backends and wrapping the call —
    the same call, so the same bits (``MultiheadAttention`` takes it in training, where the request's checks would
    cost more than the kernel at few tokens). None where any of that does not
    hold or the output is not finite: the caller then runs :func:`attend`, whose checks handle or explain it.

    ``packed``: the self-attention projection ``(B, L, 3 H D)`` that q, k, v ``(B, H, L, D)`` are views of, in that
    order (as many key/value as query heads). The kernel then runs on it as one node
    (:func:`~attnlab.backends.short.fused_short_attention_packed`) and the result is ``(B, L, H D)``, the heads
    merged: the same bits, and no split, views or concatenation of the three gradients in the backward."""
    if backend == "auto":
        if AUTO_ORDER[0] != "short" or not short.auto_when(q, k, v):
            return None
    elif backend != "short" or k.shape[1] != q.shape[1]:
        return None
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    if not (abs(scale) <= 1e3 and _native.trainable(q, k, v, contiguous=False) and short.fused_applies(q, k, v)):
        return None
    if packed is not None:
        out = short.fused_short_attention_packed(packed, q.shape[1], scale, causal, None)
    else:
        out = short.fused_short_attention(q, k, v, scale, causal, None)
    return out if all_finite(out) else None


def attend_step(q: Tensor, k: Tensor, v: Tensor, *, scale: Optional[float]) -> Tensor:
    """A decoding step's attention, ``softmax(κ q Kᵀ) V``: one query per sequence ``q (B, H, 1, D)`` over every
    cached key ``k, v (B, Hkv, S, D)`` (no mask: the last position sees them all), through the ``sdpa`` backend —
    what ``auto`` takes for it — without :func:`attend`'s per-call checks. The caller vouches for what they
    would establish: q, k, v finite, ``|scale| ≤ 1e3`` (:meth:`MultiheadAttention.step` checks the one
    projection q, k, v come from; the :class:`KVCache` checked each entry as it was written)."""
    return BACKENDS["sdpa"].fn(q, k, v, mask=None, causal=False, window=None, scale=scale, score_mod=None,
                               mask_mod=None, dropout_p=0.0, normalize="softmax", top_k=None, return_weights=False)[0]


def select_backend(q, k, v, **request) -> Backend:
    """The backend ``auto`` takes: the first in :data:`SPARSE_ORDER` when the request has a window, a
    mask_mod or a score_mod (else :data:`AUTO_ORDER`) whose ``auto_when`` holds (if it has one) and whose
    ``unsupported()`` is empty; with ``return_lse=True`` in the request, among backends that keep the LSE, and
    if none of those it prefers can, the first that can."""
    lse = request.get("return_lse", False)
    sparse = request.get("window") is not None or request.get("mask_mod") is not None \
        or request.get("score_mod") is not None
    order = SPARSE_ORDER if sparse else AUTO_ORDER
    for name in order:
        b = BACKENDS[name]
        if (lse and b.lse is None) or (b.auto_when is not None and not b.auto_when(q, k, v, **request)):
            continue
        if not b.unsupported(q, k, v, **request):
            return b
    for name in order if lse else ():  # auto_when is a preference: the LSE from whichever backend can give it
        b = BACKENDS[name]
        if b.lse is not None and not b.unsupported(q, k, v, **request):
            return b
    if lse:
        why = "; ".join(f"{n}: {b.unsupported(q, k, v, **request)}" for n, b in BACKENDS.items() if b.lse is not None)
        raise ValueError(f"return_lse=True: no backend that keeps the log-sum-exp can compute this request ({why})")
    raise RuntimeError("no backend can compute this request")  # unreachable: reference takes all


def keeps_lse(backend: str) -> bool:
    """Whether ``backend=`` (``"auto"`` or a registered name) can be asked for ``return_lse=True``."""
    return backend == "auto" or (backend in BACKENDS and BACKENDS[backend].lse is not None)


def choose(backend: str, q: Tensor, k: Tensor, v: Tensor, request: dict, *, return_lse: bool = False) -> Backend:
    """The backend for ``backend=`` (``"auto"`` or a registered name), refusing a request it cannot compute.

    With ``return_lse`` only backends that keep the log-sum-exp qualify (``auto`` takes the first of them).
    """
    asked = {**request, "return_lse": True} if return_lse else request
    if backend == "auto":
        return select_backend(q, k, v, **asked)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
    impl = BACKENDS[backend]
    if return_lse and impl.lse is None:
        keep = sorted(n for n, b in BACKENDS.items() if b.lse is not None)
        raise ValueError(f"return_lse=True is computed by the {' or '.join(repr(n) for n in keep)} backend, "
                         f"not backend={backend!r}")
    why = impl.unsupported(q, k, v, **asked)
    if why:
        raise ValueError(f"backend={backend!r} cannot compute this request: {why}")
    return impl


def _call(impl: Backend, q: Tensor, k: Tensor, v: Tensor, request: dict, return_lse: bool):
    """Run ``impl``; where it cannot run here and now (``unavailable``, or :class:`BackendUnavailable` raised
    while running) run its registered ``fallback`` instead, saying why at DEBUG on its logger."""
    why = impl.unavailable(q, k, v, **request) if impl.unavailable is not None else ""
    if not why:
        try:
            return impl.lse(q, k, v, **request) if return_lse else impl.fn(q, k, v, **request)
        except BackendUnavailable as e:
            if impl.fallback is None:
                raise
            why = str(e)
    if impl.fallback is None:
        raise ValueError(f"backend={impl.name!r} cannot run this request here: {why}")
    logging.getLogger(f"attnlab.backends.{impl.name}").debug("%s falls back to %s: %s", impl.name, impl.fallback, why)
    return _call(BACKENDS[impl.fallback], q, k, v, request, return_lse)


def position_bias_terms(position_bias, *, backend: str, heads: int, q_len: int, k_len: int, device,
                        dtype) -> tuple[Optional[Tensor], Optional[ScoreMod]]:
    """A position bias module (``ALiBi``, ``T5RelativeBias``: ``bias(q_positions, k_positions) -> (1, H, Lq, Lk)``
    and ``.score_mod()``) as ``(dense additive mask, None)`` or ``(None, score_mod)``.

    A score_mod when the backend computes score_mods block by block (``tiled``, ``flex``) or the dense bias
    would hold more than :data:`DENSE_BIAS_LIMIT` elements (``H·Lq·Lk``): then ``auto`` takes ``tiled``, in
    O(N) memory. Otherwise the dense bias over positions ``Lk - Lq .. Lk - 1`` (queries) and ``0 .. Lk - 1``
    (keys), which SDPA adds in its fused kernel.
    """
    if backend in ("tiled", "flex") or heads * q_len * k_len > DENSE_BIAS_LIMIT:
        return None, position_bias.score_mod()
    bias = position_bias(torch.arange(k_len - q_len, k_len, device=device), torch.arange(k_len, device=device))
    return bias.to(dtype), None


def all_finite(*tensors: Tensor) -> bool:
    """True when no entry is NaN or ±inf. On the CPU with the native kernels one pass each that makes no tensor
    (:func:`attnlab._native_train.all_finite`: the nanogpt-cpu step 0.993× the one with the sums as AVX2);
    else ``sum`` is finite iff every term is (or, rarely, finite terms overflow it, which only sends the request
    down the guarded path, still exact). fp16 is summed in fp32, whose range its sums cannot overflow as easily
    (65504 would send ordinary inputs down the guarded path).

    While ``torch.compile`` traces, True without reading the data: a graph cannot branch on it, so compiled code
    takes the unguarded paths, where a NaN or ±inf input still makes the rows it reaches NaN (the kernels propagate
    it) but a finite input whose scores overflow is not reported."""
    if torch.compiler.is_compiling():
        return True
    if tensors and all(t.device.type == "cpu" and _native.runs_on(t) for t in tensors):
        return _native_train.all_finite(tensors)
    sums = [t.detach().sum(dtype=torch.float32 if t.dtype == torch.float16 else None) for t in tensors]
    if sums and sums[0].device.type != "cpu":  # one device synchronisation for all of them, not one each
        return math.isfinite(float(torch.stack([s.float() for s in sums]).sum()))
    # on the CPU one Python float per tensor (2-3x cheaper than bool(torch.isfinite(...)) on a 0-d tensor)
    return math.isfinite(sum(float(s) for s in sums))


def _guarded(run, q: Tensor, k: Tensor, v: Tensor, request: dict):
    """Attention over inputs holding NaN or ±inf, with the semantics of the formula on every backend alike:

    - a key or value that a query may not see has no influence on it (a masked ``0 · NaN`` is 0), in values
      and in gradients;
    - a non-finite entry in a row's query, or in a key or value the row may see, makes that whole row NaN
      (in the output, the weights and the log-sum-exp), so a corrupted input never hides behind zeros.

    Non-finite entries are replaced by 0 for the computation; which rows may see a bad key comes from the
    same request run once more, without gradients, on zero queries and a value that marks the bad keys.
    """
    def clean(t: Tensor) -> Tensor:
        return torch.where(torch.isfinite(t), t, torch.zeros((), dtype=t.dtype, device=t.device))

    bad_q = ~torch.isfinite(q).all(-1)  # (B, H, Lq)
    bad_kv = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))  # (B, Hkv, Lk)
    out, extra = run(clean(q), clean(k), clean(v))
    bad_rows = bad_q
    if bool(bad_kv.any()):
        with torch.no_grad():
            marker = bad_kv.to(q.dtype).unsqueeze(-1)  # (B, Hkv, Lk, 1): 1 at a bad key
            probe = {**request, "dropout_p": 0.0, "normalize": "softmax", "top_k": None, "return_weights": False}
            zq, kk = torch.zeros_like(q), clean(k).detach()
            seen, _ = select_backend(zq, kk, marker, **probe).fn(zq, kk, marker, **probe)  # (B, H, Lq, 1)
        bad_rows = bad_rows | (seen.squeeze(-1) > 0)
    nan = torch.full((), float("nan"), dtype=out.dtype, device=out.device)
    out = torch.where(bad_rows.unsqueeze(-1), nan, out)
    if extra is not None:
        rows = bad_rows.unsqueeze(-1) if extra.dim() == 4 else bad_rows
        extra = torch.where(rows, torch.full((), float("nan"), dtype=extra.dtype, device=extra.device), extra)
    return out, extra


def _check_scale_overflow(q: Tensor, k: Tensor, scale: float, *, always: bool = False) -> None:
    """Refuse scores that overflow the dtype (the backends would answer NaN, each in its own rows): a score is
    at most ``|κ| · D · max|q| · max|k|``. Checked up front for unusual scales (|κ| > 1e3), and ``always``
    when finite inputs gave a non-finite output (huge q or k with a normal scale), so the common path pays
    nothing."""
    if abs(scale) <= 1e3 and not always:
        return
    with torch.no_grad():
        bound = abs(scale) * q.shape[-1] * float(q.abs().amax()) * float(k.abs().amax())
    limit = torch.finfo(q.dtype).max if q.is_floating_point() else float("inf")
    if math.isfinite(bound) and bound > limit / 16 or math.isinf(bound):
        raise ValueError(f"scale={scale!r} makes the scores overflow {q.dtype} (|scale| · D · max|q| · max|k| = "
                         f"{bound:.3g} > {limit / 16:.3g}): use a smaller scale, smaller q and k, or a wider dtype")
    if always:
        raise ValueError(f"attention over finite q, k, v overflowed {q.dtype} (|scale| · D · max|q| · max|k| = "
                         f"{bound:.3g}, or the values are too large): use smaller inputs or a wider dtype")


def attention_weights(
    q: Tensor,
    k: Tensor,
    *,
    lse: Optional[Tensor] = None,
    heads=None,
    rows=None,
    mask: Optional[Tensor] = None,
    causal: bool = False,
    window: Optional[int] = None,
    scale: Optional[float] = None,
    score_mod: Optional[ScoreMod] = None,
    mask_mod: Optional[MaskMod] = None,
) -> Tensor:
    """Exact softmax attention weights ``w_ij = e^(s_ij - LSE_i)`` for chosen heads and query rows.

    Visualising attention never needs the O(N²) path for the whole model: the fast backends keep
    only ``LSE`` per row, and any row's weights follow from it and that row's scores.

    Args:
        q, k: as in :func:`attention` (values are not needed).
        lse: ``(B, H, Lq)`` from ``attention(..., return_lse=True)``; computed here (one O(N)-memory
            pass) when omitted.
        heads, rows: head indices and query-row indices (int, sequence or LongTensor); all by default.
        mask, causal, window, scale, score_mod, mask_mod: the same request as the forward pass.

    Returns:
        ``(B, len(heads), len(rows), Lk)`` weights; each non-empty row sums to 1, empty rows are 0.
    """
    v = k.new_zeros(*k.shape[:3], 1)
    request = prepare(q, k, v, mask=mask, causal=causal, window=window, scale=scale, score_mod=score_mod,
                       mask_mod=mask_mod, dropout_p=0.0, normalize="softmax", top_k=None, return_weights=False)
    B, H, Lq, _ = q.shape
    if lse is None:
        _, lse = attention(q, k, v, mask=mask, causal=causal, window=window, scale=scale,
                           score_mod=score_mod, mask_mod=mask_mod, return_lse=True)
    elif not isinstance(lse, Tensor) or tuple(lse.shape) != (B, H, Lq):
        raise ValueError(f"lse must be a tensor of shape (B, H, Lq) = {(B, H, Lq)}, got "
                         f"{tuple(lse.shape) if isinstance(lse, Tensor) else type(lse).__name__}")
    w = recover_weights(q, k, lse.detach(), heads=indices("heads", heads, H, q.device),
                        rows=indices("rows", rows, Lq, q.device), mask=request["mask"],
                        causal=request["causal"], window=window, scale=request["scale"],
                        score_mod=score_mod, mask_mod=mask_mod)
    # a row's weights sum to 1 (0 for a row that sees nothing) only with the lse of this very request:
    # cheap to check, and an lse from another request (causal vs not, another mask) is refused
    sums = w.detach().sum(-1)
    finite = lse.detach()[torch.isfinite(lse.detach())]
    # exp(s - lse) carries ~|s|·ε relative error per weight, a sum of Lk of them ~sqrt(Lk)·ε more
    tol = 16 * torch.finfo(w.dtype).eps * (math.sqrt(k.shape[2]) + (float(finite.abs().max()) if finite.numel() else 0))
    ok = ((sums - 1).abs() <= tol) | (sums == 0) | sums.isnan()
    if not bool(ok.all()):
        worst = float((sums - 1).abs().masked_fill(ok, 0).max())
        raise ValueError(f"lse does not belong to this request: recovered rows sum to 1 ± {worst:.3g} (tolerance "
                         f"{tol:.1e}); pass the lse returned by attention(..., return_lse=True) with the same "
                         "mask, causal, window, scale and mods")
    return w




def plan_layer(layer, mode: str, *, norms: tuple, activation: Optional[str]) -> Optional[tuple]:
    """Which implementation computes a pre-norm decoder layer's call in ``mode``, and its fixed arguments: the one
    place that chooses between a layer's modules and the native layer ops. :class:`attnlab.nn.block.DecoderLayer`
    asks once per mode and structure (it caches the answer; :mod:`attnlab.nn.layer_native` runs it, adding the
    checks that depend on a call's tensors: grad mode, autocast, compiling, hooks, dtypes, lengths).

    ``mode``: ``"decode"`` (a decoding step, gradients off) or ``"train"`` (a training forward). ``norms``: each of
    the layer's two norms as ``(rms, eps, has_weight)`` where it is an RMSNorm or a LayerNorm over the last dim with
    float32 CPU parameters, else None; ``activation``: the FFN's activation where it is attnlab's ``FeedForward``,
    else None — what the layer knows of its own modules. Returns:

    - ``("decoder_step", {"rms", "eps", "activation"})``: the step in one call (:func:`attnlab._native.decoder_step`),
      for a decoder-only pre-norm layer with two norms of one kind and a ``FeedForward``;
    - ``("gpt_block_train", {"heads", "scale", "eps", "activation", "left", "right"})``: the training forward as
      one autograd node (:func:`attnlab._native_train.gpt_block_train`): two LayerNorms with weights, a plain
      activation, no dropout, a packed causal softmax self-attention that the short backend serves (``short``, or
      ``auto`` with short first) with no window, position bias, QK-norm, RoPE, grouped heads or top-k, and four
      int8 training products of one registered class (:func:`attnlab._native_train.int8_training_levels`);
    - None: the layer's modules (each choosing its backend per call, :func:`attend`).
    """
    if mode not in ("decode", "train"):
        raise ValueError(f"mode must be 'decode' or 'train', got {mode!r}")
    n1, n2 = norms
    if not layer.norm_first or layer.cross_attn is not None or n1 is None or n2 is None or activation is None:
        return None
    attn, ffn = layer.self_attn, layer.ffn
    if mode == "decode":
        if n1[0] != n2[0]:
            return None
        return "decoder_step", {"rms": n1[0], "eps": (n1[1], n2[1]), "activation": activation}
    products = (attn.in_proj, attn.out_proj, ffn.w1, ffn.w2)
    levels = {_native_train.int8_training_levels(type(m)) for m in products}
    scale = default_scale(attn.head_dim) if attn.scale is None else float(attn.scale)
    if not (not n1[0] and not n2[0] and n1[2] and n2[2] and ffn.w3 is None and activation in _native.ACTIVATIONS
            and attn.dropout == 0 and all(getattr(m, "p", 1.0) == 0 for m in (layer.dropout1, layer.dropout2,
                                                                                layer.drop_path, ffn.dropout))
            and attn.packed and attn.num_kv_heads == attn.num_heads and attn.q_norm is None and attn.k_norm is None
            and attn.rotary is None and attn.position_bias is None and attn.window is None
            and attn.normalize == "softmax" and attn.top_k is None and abs(scale) <= 1e3
            and (attn.backend == "short" or (attn.backend == "auto" and AUTO_ORDER[0] == "short"))
            and len(levels) == 1 and None not in levels):
        return None
    (left, right), = levels
    return "gpt_block_train", {"heads": attn.num_heads, "scale": scale, "eps": (n1[1], n2[1]),
                               "activation": activation, "left": left, "right": right}


def plan_fits(path: str, length: int) -> bool:
    """Whether a call of ``length`` positions fits a layer's planned ``path`` (:func:`plan_layer`), read per call:
    ``gpt_block_train``'s attention is the short backend's fused kernel, up to its ``FUSED_KEYS`` keys."""
    return path != "gpt_block_train" or 0 < length <= short.FUSED_KEYS
