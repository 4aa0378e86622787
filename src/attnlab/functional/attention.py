"""The one attention pipeline and its dispatch.

::

    scores  = score(q, k) * κ                    # κ = 1/sqrt(D) by default
    scores  = score_mod(scores, b, h, i, j)      # ALiBi, T5 bias, softcap, any function
    scores  = mask(scores, b, h, i, j)           # causal, window, bool/float mask, mask_mod
    weights = normalize(scores)                  # softmax, top-k softmax, hard, sparsemax
    out     = dropout(weights) @ v

Every backend in :mod:`attnlab.backends` computes exactly this; ``backend="auto"`` picks the
fastest one that can express the request.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch
from torch import Tensor

from attnlab._checks import boolean, is_int, one_of, positive_int, rate, real, tensor
from attnlab.functional.masks import MaskMod
from attnlab.functional.normalize import NORMALIZERS

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


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
            signature, called with broadcastable index tensors and absolute positions.
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
    from attnlab.backends import BACKENDS, select_backend

    request = _prepare(q, k, v, mask=mask, causal=causal, window=window, scale=scale, score_mod=score_mod,
                       mask_mod=mask_mod, dropout_p=dropout_p, normalize=normalize, top_k=top_k,
                       return_weights=return_weights)
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    boolean("return_lse", return_lse)
    if return_lse:
        if backend not in ("auto", "tiled"):
            raise ValueError(f"return_lse=True is computed by the 'tiled' backend, not backend={backend!r}")
        backend = "tiled"
    if backend == "auto":
        impl = select_backend(q, k, v, **request)
    elif backend in BACKENDS:
        impl = BACKENDS[backend]
        why = impl.unsupported(q, k, v, **request)
        if why:
            raise ValueError(f"backend={backend!r} cannot compute this request: {why}")
    else:
        raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")

    _check_scale_overflow(q, k, request["scale"])

    def run(q, k, v):
        if return_lse:
            from attnlab.backends.tiled import tiled_attention

            r = request
            return tiled_attention(q, k, v, mask=r["mask"], causal=r["causal"], window=r["window"],
                                   scale=r["scale"], score_mod=r["score_mod"], mask_mod=r["mask_mod"])
        return impl.fn(q, k, v, **request)

    if _all_finite(q, k, v):  # the common case: one reduction per tensor, then the backend as it is
        out, extra = run(q, k, v)
        if not _all_finite(out):  # finite inputs, non-finite output: the scores overflowed the dtype
            _check_scale_overflow(q, k, request["scale"], always=True)
    else:
        out, extra = _guarded(run, q, k, v, request, impl)
    return (out, extra) if return_weights or return_lse else out


def _all_finite(*tensors: Tensor) -> bool:
    """True when no entry is NaN or ±inf: ``sum`` is finite iff every term is (or, rarely, finite terms
    overflow it, which only sends the request down the guarded path, still exact)."""
    with torch.no_grad():
        return all(bool(torch.isfinite(t.sum())) for t in tensors)


def _guarded(run, q: Tensor, k: Tensor, v: Tensor, request: dict, impl):
    """Attention over inputs holding NaN or ±inf, with the semantics of the formula on every backend alike:

    - a key or value that a query may not see has no influence on it (a masked ``0 · NaN`` is 0), in values
      and in gradients;
    - a non-finite entry in a row's query, or in a key or value the row may see, makes that whole row NaN
      (in the output, the weights and the log-sum-exp), so a corrupted input never hides behind zeros.

    Non-finite entries are replaced by 0 for the computation; which rows may see a bad key comes from the
    same request run once more, without gradients, on zero queries and a value that marks the bad keys.
    """
    from attnlab.backends import select_backend

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
    request = _prepare(q, k, v, mask=mask, causal=causal, window=window, scale=scale, score_mod=score_mod,
                       mask_mod=mask_mod, dropout_p=0.0, normalize="softmax", top_k=None, return_weights=False)
    B, H, Lq, _ = q.shape
    if lse is None:
        _, lse = attention(q, k, v, mask=mask, causal=causal, window=window, scale=scale,
                           score_mod=score_mod, mask_mod=mask_mod, return_lse=True)
    elif not isinstance(lse, Tensor) or tuple(lse.shape) != (B, H, Lq):
        raise ValueError(f"lse must be a tensor of shape (B, H, Lq) = {(B, H, Lq)}, got "
                         f"{tuple(lse.shape) if isinstance(lse, Tensor) else type(lse).__name__}")
    from attnlab.backends.tiled import recover_weights

    w = recover_weights(q, k, lse.detach(), heads=_indices("heads", heads, H, q.device),
                        rows=_indices("rows", rows, Lq, q.device), mask=request["mask"],
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


def _indices(name: str, idx, n: int, device) -> Tensor:
    if idx is None:
        return torch.arange(n, device=device)
    t = torch.as_tensor([idx] if is_int(idx) else idx, device=device)
    if t.dim() != 1 or t.dtype not in (torch.int64, torch.int32) or t.numel() == 0:
        raise ValueError(f"{name} must be an int or a non-empty 1-D sequence of ints, got {idx!r}")
    if (t < 0).any() or (t >= n).any():
        raise ValueError(f"{name} must lie in [0, {n}), got {t.tolist()}")
    return t.long()


def _prepare(q, k, v, *, mask, causal, window, scale, score_mod, mask_mod, dropout_p, normalize, top_k,
             return_weights) -> dict:
    """Validate a request at the API boundary and return it normalised for the backends."""
    _check_qkv(q, k, v)
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    mask = _check_mask(mask, q, (B, H, Lq, Lk))
    positive_int("window", window, optional=True)
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    else:
        real("scale", scale)
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale!r}")
    boolean("causal", causal)
    boolean("return_weights", return_weights)
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
    rate("dropout_p", dropout_p)
    one_of("normalize", normalize, sorted(NORMALIZERS))
    if normalize == "topk":
        if not (is_int(top_k) and 1 <= top_k <= Lk):
            raise ValueError(f"top_k must be an int in [1, Lk={Lk}] with normalize='topk', got {top_k!r}")
    elif top_k is not None:
        raise ValueError(f"top_k is only used with normalize='topk' (normalize={normalize!r})")
    return dict(mask=mask, causal=causal, window=window, scale=float(scale), score_mod=score_mod,
                mask_mod=mask_mod, dropout_p=float(dropout_p), normalize=normalize, top_k=top_k,
                return_weights=return_weights)


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        tensor(name, t, kind="floating", ndim=4, shape="(B, H, L, D)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same number of heads, got {k.shape[1]} and {v.shape[1]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"query heads H={q.shape[1]} must be a multiple of key/value heads Hkv={k.shape[1]} (H % Hkv == 0)"
        )
    if q.shape[3] == 0 or k.shape[2] == 0:
        raise ValueError(f"need at least one key and a head dim D >= 1, got Lk={k.shape[2]}, D={q.shape[3]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same length, got Lk={k.shape[2]} and {v.shape[2]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have the same head dim D, got {q.shape[3]} and {k.shape[3]}")


def _check_mask(mask: Optional[Tensor], q: Tensor, target: tuple[int, int, int, int]) -> Optional[Tensor]:
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"mask must be bool (True = may attend) or floating (added), got {mask.dtype}")
    if mask.dim() > 4 or _broadcast(mask.shape, target) != target:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to (B, H, Lq, Lk) = {target}")
    if mask.device != q.device:
        raise ValueError(f"mask is on {mask.device} but q is on {q.device}")
    if mask.is_floating_point():
        top = mask.amax() if mask.numel() else None  # one pass; amax propagates NaN
        if top is not None and (torch.isnan(top) or torch.isposinf(top)):
            raise ValueError("a float mask must not contain NaN or +inf (use -inf to block a position)")
        if mask.dtype != q.dtype:
            mask = mask.to(q.dtype)
    if mask.dim() < 4:  # backends may rely on 4-D masks
        mask = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))
    return mask


def _broadcast(a, b):
    try:
        return tuple(torch.broadcast_shapes(tuple(a), tuple(b)))
    except RuntimeError:
        return None
