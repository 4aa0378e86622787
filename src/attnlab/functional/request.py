"""An attention request, checked once at the API boundary: the arguments of :func:`attnlab.attention`.

Pure argument code (no backend is imported here): :func:`prepare` validates q, k, v, the mask and every
option and returns the request the backends receive (``scale`` resolved to ``1/sqrt(D)``, masks 4-D).
"""
from __future__ import annotations

import math
import weakref
from typing import Callable, Optional

import torch
from torch import Tensor

from attnlab._checks import boolean, is_int, one_of, positive_int, rate, real, tensor
from attnlab.functional.masks import call_mask_mod, call_score_mod
from attnlab.functional.normalize import NORMALIZERS

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def indices(name: str, idx, n: int, device) -> Tensor:
    """``idx`` (None = all of ``range(n)``, an int, or a 1-D sequence of ints in ``[0, n)``) as a LongTensor."""
    if idx is None:
        return torch.arange(n, device=device)
    t = torch.as_tensor([idx] if is_int(idx) else idx, device=device)
    if t.dim() != 1 or t.dtype not in (torch.int64, torch.int32) or t.numel() == 0:
        raise ValueError(f"{name} must be an int or a non-empty 1-D sequence of ints, got {idx!r}")
    if (t < 0).any() or (t >= n).any():
        raise ValueError(f"{name} must lie in [0, {n}), got {t.tolist()}")
    return t.long()


def default_scale(head_dim: int) -> float:
    """The score scale κ when none is given: ``1 / √D`` (Vaswani et al. 2017), computed one way everywhere, so every
    path that fills it in gives the same bits."""
    return 1.0 / math.sqrt(head_dim)


def prepare(q, k, v, *, mask, causal, window, scale, score_mod, mask_mod, dropout_p, normalize, top_k,
             return_weights) -> dict:
    """Validate a request at the API boundary and return it normalised for the backends."""
    check_qkv(q, k, v)
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    mask = check_mask(mask, q, (B, H, Lq, Lk))
    positive_int("window", window, optional=True)
    if scale is None:
        scale = default_scale(D)
    else:
        real("scale", scale)
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale!r}")
    boolean("causal", causal)
    boolean("return_weights", return_weights)
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
    _check_mod_sizes(score_mod, mask_mod, H, Lq, Lk)
    _probe_mods(score_mod, mask_mod, q, Lq, Lk)
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


def _check_mod_sizes(score_mod, mask_mod, H: int, Lq: int, Lk: int) -> None:
    """The sizes a built-in mod was made for cover the request: ALiBi's slopes one per query head, a BigBird
    layout every position (an index past them would be an IndexError deep inside a backend)."""
    alibi = getattr(score_mod, "alibi", None)
    if alibi is not None and alibi[0].numel() != H:
        raise ValueError(f"score_mod holds ALiBi slopes for {alibi[0].numel()} heads, but q has H={H} heads: "
                         f"build them with alibi_slopes({H})")
    layout = getattr(mask_mod, "block_layout", None)
    if layout is not None:
        covered = layout[0].shape[0] * layout[1]
        if max(Lq, Lk) > covered:
            raise ValueError(f"mask_mod is a block layout of {covered} positions (seq_len), but the request has "
                             f"Lq={Lq}, Lk={Lk}: build it with seq_len >= {max(Lq, Lk)}")


_PROBED = weakref.WeakSet()  # mods already called once on a probe grid


def _probe_mods(score_mod, mask_mod, q: Tensor, Lq: int, Lk: int) -> None:
    """Call each mod once on a small grid of the request's positions (its last ≤ 2 queries, first ≤ 3 keys) and check
    what it returns (:func:`~attnlab.functional.masks.call_score_mod`: the scores' shape and dtype;
    :func:`~attnlab.functional.masks.call_mask_mod`: a bool tensor broadcastable to the grid). A mod that raises, or
    returns the wrong thing, is then reported here by every backend alike, in the user's own words — not inside a
    compiled FlexAttention kernel, nor silently cast. Once per mod object (a new closure per call is probed per
    call: a few small tensor operations)."""
    if torch.compiler.is_compiling():
        return
    nq, nk = min(Lq, Lk, 2), min(Lk, 3)
    for fn in (score_mod, mask_mod):
        if fn is None or nq == 0:
            continue
        try:
            if fn in _PROBED:
                continue
        except TypeError:  # not weakly referable: probed every call
            pass
        long = dict(dtype=torch.long, device=q.device)
        b = h = torch.zeros(1, 1, 1, 1, **long)
        i = torch.arange(Lk - nq, Lk, **long).view(1, 1, nq, 1)  # absolute positions, as the backends pass them
        j = torch.arange(nk, **long).view(1, 1, 1, nk)
        with torch.no_grad():
            try:
                if fn is score_mod:
                    call_score_mod(fn, torch.zeros(1, 1, nq, nk, dtype=torch.promote_types(q.dtype, torch.float32),
                                                   device=q.device), b, h, i, j)
                else:
                    call_mask_mod(fn, b, h, i, j)
            except ValueError as e:
                if not str(e).startswith(("score_mod must", "mask_mod must", "mask_mod returned")):
                    raise  # the mod's own error
                raise ValueError(f"{e} (called on a probe grid of the request's last {nq} queries and first {nk} "
                                 f"keys, b = h = 0)") from None
        try:
            _PROBED.add(fn)
        except TypeError:
            pass


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    """q ``(B, H, Lq, D)``, k ``(B, Hkv, Lk, D)``, v ``(B, Hkv, Lk, Dv)``: floating, one dtype and device, ``H % Hkv == 0``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        tensor(name, t, kind="floating", ndim=4, shape="(B, H, L, D)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type == "meta":
        raise ValueError("q, k, v are meta tensors (shapes without values): attention needs real ones; materialise "
                         "the model first (model.to_empty(device='cpu'), then load its weights)")
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


def check_mask(mask: Optional[Tensor], q: Tensor, target: tuple[int, int, int, int]) -> Optional[Tensor]:
    """A bool (True = may attend) or float (added) mask broadcastable to ``target``, returned 4-D, in q's dtype."""
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
