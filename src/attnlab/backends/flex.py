"""The flex backend: PyTorch FlexAttention (``torch.nn.attention.flex_attention``).

``softmax(score_mod(κ Q Kᵀ) + bias, masked by a BlockMask) V`` by a kernel that ``torch.compile``
generates from the mods; key blocks the mask empties are skipped. A request is translated:

- causal / window / bool ``mask`` / ``mask_mod`` → one mask_mod → ``create_block_mask``, cached per
  mask and shape (a ``mask_mod`` by identity — it is taken to be pure —, a mask tensor by its
  memory and version counter);
- ``score_mod`` and a float ``mask`` (an additive bias) → one score_mod;
- our positions are absolute (query ``i`` at ``Lk - Lq + i``, bottom-right) while FlexAttention's
  ``q_idx`` runs over ``0..Lq-1``: the user's mods are called with ``q_idx + (Lk - Lq)``;
- GQA → ``enable_gqa=True``. Rows with nothing to attend to come back as zeros (FlexAttention
  returns 0 with ``lse = -inf`` there, checked by the tests).

Compilation: ``flex_attention`` is wrapped in ``torch.compile(dynamic=False)`` once, lazily, on
the first call; each new shape or mod then compiles once (seconds on CPU). Static shapes because
Inductor's CPU FlexAttention template (torch 2.13) emits C++ that does not compile for some mods
once sequence lengths turn symbolic (``cur_qSplitSize8 was not declared``): so flex suits fixed
shapes (training, prefill), not decoding over a growing cache. Set ``ATTNLAB_FLEX_COMPILE=0`` in
the environment, or call :func:`set_compile` ``(False)``, to run it eagerly instead — unfused, it
materialises the scores: for tests and debugging.

Cannot run, and the dispatcher runs its registered fallback ``tiled`` instead (saying why at DEBUG on
``attnlab.backends.flex``; :func:`unavailable` and :class:`~attnlab.backends.base.BackendUnavailable`), when

- grad mode is on, the device is CPU (or MPS) and q, k, v, a float mask or a tensor a mod reads
  requires grad: FlexAttention has no backward there in torch 2.13 (it rejects q/k/v that require
  grad; compiled, a captured tensor that requires grad fails in Inductor);
- compiled on CPU with float64 inputs: the CPU kernel takes float32, float16 and bfloat16 only;
- ``torch.compile`` could not build the kernel (``BackendCompilerFailed``, e.g. no C++ compiler)
  on this device type, now or before (remembered until :func:`set_compile`);
- the request has a new shape after ``torch._dynamo.config.recompile_limit`` (8) others were
  compiled: Dynamo would run FlexAttention unfused from then on.
"""
from __future__ import annotations

import functools
import logging
import os
import warnings
from collections import OrderedDict
from typing import Optional

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from attnlab._checks import boolean
from attnlab.backends.base import BackendUnavailable
from attnlab.functional.masks import captured_tensors
from attnlab.functional.masks import causal_mod, sliding_window_mod, split_mask

log = logging.getLogger("attnlab.backends.flex")

BLOCK_MASK_CACHE_SIZE = 32  # block masks kept (least recently used dropped first)

_compile: bool = os.environ.get("ATTNLAB_FLEX_COMPILE", "1").strip().lower() not in ("0", "false", "no", "off")
_compiled_flex = None                   # torch.compile(flex_attention), made on first use
_compile_errors: dict[str, str] = {}    # device type -> why torch.compile failed there
_compiled_signatures: set = set()       # requests compiled so far (see _signature)
_block_masks: OrderedDict = OrderedDict()  # key -> (BlockMask, objects the key's ids refer to)
_NO_CPU_BACKWARD = ("cpu", "mps")


def set_compile(enabled: bool) -> bool:
    """Run FlexAttention compiled (``True``, the default) or eagerly; returns the previous setting.

    Also forgets remembered ``torch.compile`` failures, so the next call tries again.
    """
    global _compile
    boolean("enabled", enabled)
    previous, _compile = _compile, enabled
    _compile_errors.clear()
    return previous


def unsupported(q, k, v, *, normalize, dropout_p, return_weights, **_) -> str:
    if normalize != "softmax":
        return f"normalize={normalize!r} (FlexAttention computes softmax only)"
    if dropout_p > 0:
        return "dropout_p > 0 (FlexAttention has no dropout)"
    if return_weights:
        return "return_weights=True (FlexAttention does not materialise the weights)"
    return ""


def attention(q, k, v, *, mask, causal, window, scale, score_mod, mask_mod, dropout_p, normalize,
              top_k, return_weights):
    """``softmax(score_mod(κ Q Kᵀ) + M) V`` by FlexAttention.

    Raises:
        BackendUnavailable: ``torch.compile`` could not build the kernel on this device type (remembered,
            so :func:`unavailable` answers at once next time).
    """
    from torch._dynamo.exc import BackendCompilerFailed  # here: importing torch._dynamo costs ~1 s

    try:
        out = _flex(q, k, v, mask=mask, causal=causal, window=window, scale=scale,
                    score_mod=score_mod, mask_mod=mask_mod)
    except BackendCompilerFailed as e:
        # Inductor could not build the kernel (errors in the user's mods are raised earlier,
        # while tracing, as other exceptions, and reach the caller)
        if not _compile:
            raise
        inner = getattr(e, "inner_exception", None) or e
        first_line = (str(inner).strip().splitlines() or [""])[0]
        why = f"torch.compile(flex_attention) failed on {q.device.type}: {type(inner).__name__}: {first_line}"
        _compile_errors[q.device.type] = why
        raise BackendUnavailable(why) from e
    if _compile:
        _compiled_signatures.add(_signature(q, k, v, mask=mask, causal=causal, window=window, scale=scale,
                                            score_mod=score_mod, mask_mod=mask_mod))
    return out, None


AUTO_MIN_QUERIES = 128  # auto takes flex on CUDA from this many queries (training, prefill); decode steps go elsewhere


def auto_when(q: Tensor, k: Tensor, v: Tensor, **request) -> bool:
    """``auto`` takes flex for sparse requests on CUDA, compiled, with at least :data:`AUTO_MIN_QUERIES` queries.

    On CUDA it is tens of times faster than ``tiled`` (a CPU design, many small products per block) and than SDPA
    with a dense mask (see docs/performance.md). Not on CPU (no FlexAttention backward there, and ``tiled`` is the
    fast path), not uncompiled (it materialises the scores), not for a few queries: each new cache length compiles
    again (seconds).
    """
    return (q.device.type == "cuda" and _compile and q.shape[-2] >= AUTO_MIN_QUERIES
            and not unavailable(q, k, v, **request))


def unavailable(q: Tensor, k: Tensor, v: Tensor, *, mask, score_mod, mask_mod, **request) -> str:
    """Why FlexAttention cannot run this request here and now ("" when it can): the cases in the module
    docstring except a compile failure not seen before."""
    signature = _signature(q, k, v, mask=mask, score_mod=score_mod, mask_mod=mask_mod, **request)
    return _fallback_reason(q, k, v, mask, score_mod, mask_mod, signature)


def _fallback_reason(q: Tensor, k: Tensor, v: Tensor, mask, score_mod, mask_mod, signature) -> str:
    device = q.device.type
    if q.numel() == 0 or v.shape[-1] == 0:  # compiled on CPU, an empty B, H, Lq or Dv divides by zero (SIGFPE)
        return f"an empty dimension (q {tuple(q.shape)}, v {tuple(v.shape)})"
    if device in _NO_CPU_BACKWARD and torch.is_grad_enabled():
        if q.requires_grad or k.requires_grad or v.requires_grad:
            return f"inputs require grad and FlexAttention has no backward on {device}"
        if (mask is not None and mask.requires_grad) or any(
                captured_tensors(fn) for fn in (score_mod, mask_mod) if fn is not None):
            return f"a tensor the mods read requires grad and FlexAttention has no backward on {device}"
    if _compile:
        if device == "cpu" and q.dtype == torch.float64:
            return "compiled FlexAttention on CPU takes float32, float16 or bfloat16, not float64"
        if device in _compile_errors:
            return _compile_errors[device]
        limit = torch._dynamo.config.recompile_limit
        if signature not in _compiled_signatures and len(_compiled_signatures) >= limit:
            return (f"FlexAttention is already compiled for {limit} request shapes (torch._dynamo's "
                    f"recompile_limit); a new one would run unfused")
    return ""


def _signature(q: Tensor, k: Tensor, v: Tensor, *, mask, causal, window, scale, score_mod, mask_mod, **_) -> tuple:
    """What a compiled kernel is specialised on, approximately: shapes, dtype, device, constants and
    the mods' code (mods of one code with other captured constants recompile without counting)."""
    def code(fn):
        return None if fn is None else getattr(fn, "__code__", type(fn))

    mask_key = None if mask is None else (mask.dtype, tuple(mask.shape))
    return (tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, str(q.device), mask_key, causal,
            window, scale, code(score_mod), code(mask_mod))


def _flex(q: Tensor, k: Tensor, v: Tensor, *, mask, causal, window, scale, score_mod, mask_mod) -> Tensor:
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    off = Lk - Lq  # absolute position of query row 0
    bool_mask, bias = split_mask(mask)
    block_mask = _block_mask(B, H, Lq, Lk, q.device, bool_mask, causal, window, mask_mod)
    if not torch.is_grad_enabled():  # FlexAttention rejects inputs that require grad even then
        q, k, v = q.detach(), k.detach(), v.detach()
    kwargs = dict(score_mod=_score_mod(score_mod, bias, off, (B, H, Lq, Lk)), block_mask=block_mask,
                  scale=scale, enable_gqa=k.shape[1] != H)
    if _compile:
        return _compiled()(q, k, v, **kwargs)
    with warnings.catch_warnings():  # "called without torch.compile()": eager is the point here
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(q, k, v, **kwargs)


def _compiled():
    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def _shifted(mod, off: int):
    """``mod`` seeing absolute query positions: FlexAttention's ``q_idx`` plus ``off``."""
    if off == 0:
        return mod
    return lambda b, h, q_idx, kv_idx: mod(b, h, q_idx + off, kv_idx)


def _both(first, second):
    return lambda b, h, q_idx, kv_idx: first(b, h, q_idx, kv_idx) & second(b, h, q_idx, kv_idx)


def _score_mod(score_mod, bias: Optional[Tensor], off: int, shape: tuple[int, int, int, int]):
    """One FlexAttention score_mod: the user's (at absolute positions), then ``+ bias[b, h, i, j]``."""
    if bias is None:
        if score_mod is None or off == 0:
            return score_mod
        return lambda score, b, h, q_idx, kv_idx: score_mod(score, b, h, q_idx + off, kv_idx)
    bias = bias.expand(shape)  # (B, H, Lq, Lk), a view

    def mod(score, b, h, q_idx, kv_idx):
        if score_mod is not None:
            score = score_mod(score, b, h, q_idx + off, kv_idx)
        return score + bias[b, h, q_idx, kv_idx]

    return mod


def _block_mask(B: int, H: int, Lq: int, Lk: int, device, bool_mask: Optional[Tensor], causal: bool,
                window: Optional[int], mask_mod) -> Optional[BlockMask]:
    """The BlockMask of every boolean constraint, or None; cached per (mask objects, shapes)."""
    if bool_mask is None and mask_mod is None and window is None and not causal:
        return None
    # dims the mask does not depend on stay 1 (FlexAttention broadcasts them)
    mB = B if mask_mod is not None or (bool_mask is not None and bool_mask.shape[0] > 1) else 1
    mH = H if mask_mod is not None or (bool_mask is not None and bool_mask.shape[1] > 1) else 1
    # a mask tensor by its memory and version (views made per call still hit), a mod by identity;
    # the entry holds both, so neither address nor id can be reused while it lives
    tensor_key = None if bool_mask is None else (bool_mask.data_ptr(), bool_mask.shape, bool_mask.stride(),
                                                 bool_mask._version)
    # a mod over a tensor (document_mod) says what of it the mask reflects: refilled ids give a new BlockMask
    mod_key = (id(mask_mod), getattr(mask_mod, "cache_key", lambda: None)())
    key = (mod_key, tensor_key, causal, window, B, H, mB, mH, Lq, Lk, str(device))
    hit = _block_masks.get(key)
    if hit is not None:
        _block_masks.move_to_end(key)
        return hit[0]
    off = Lk - Lq
    mods = []
    if window is not None:
        mods.append(_shifted(sliding_window_mod(window, causal=causal), off))
    elif causal:
        mods.append(_shifted(causal_mod(), off))
    if mask_mod is not None:
        mods.append(_shifted(mask_mod, off))
    if bool_mask is not None:
        allowed = bool_mask.expand(B, H, Lq, Lk)  # a view; the kernel indexes it with the full b, h
        mods.append(lambda b, h, q_idx, kv_idx: allowed[b, h, q_idx, kv_idx])

    # nested pairs rather than a loop over a list: with dynamic shapes, Inductor (torch 2.13, CPU)
    # emitted C++ that does not compile for a mask_mod looping over a captured list
    combined = functools.reduce(_both, mods)
    block_mask = create_block_mask(combined, mB, mH, Lq, Lk, device=device)
    _block_masks[key] = (block_mask, (mask_mod, bool_mask))  # keeps the ids in the key valid
    if len(_block_masks) > BLOCK_MASK_CACHE_SIZE:
        _block_masks.popitem(last=False)
    return block_mask
