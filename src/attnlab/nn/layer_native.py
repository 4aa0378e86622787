"""A decoder layer's native paths: a decoding step in one C++ call (:func:`decoder_step`) and a training step as one
autograd node of C++ ops (:func:`decoder_train`). Whether a layer's call may take one is the dispatcher's choice
(:func:`attnlab.backends.dispatch.plan_layer`), made once per mode and structure and cached on the layer
(:func:`plan`); here the layer describes its parts to it, and the chosen path runs after the checks that depend on
the call (grad mode, autocast, compiling, hooks, the input's dtype and length). Each path computes exactly what the
layer's modules would — the same calls, the same bits — and returns None where it does not apply, so
:class:`attnlab.nn.block.DecoderLayer` runs its modules."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _module

from attnlab import _native, _native_train
from attnlab.backends import dispatch
from attnlab.modules.cache import KVCache
from attnlab.nn.feedforward import FeedForward
from attnlab.nn.norms import RMSNorm


def hooked(*modules: Optional[nn.Module]) -> bool:
    """Whether a hook watches a call of any of ``modules`` (None entries skipped) — its own forward, forward-pre,
    backward or backward-pre hooks, or a global one (``torch.nn.modules.module.register_module_forward_hook`` and
    the like): a native path would skip the calls it watches."""
    return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks or _module._global_backward_hooks
                or _module._global_backward_pre_hooks) or any(
        m is not None and (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)
        for m in modules)


def _norm_kind(norm: nn.Module) -> Optional[tuple]:
    """``(rms, eps, has_weight)`` of an RMSNorm or a LayerNorm over the last dim with float32 CPU parameters (what the
    native layer ops compute); None for any other norm."""
    if type(norm) is RMSNorm:
        w, b, rms = norm.weight, None, True
    elif type(norm) is nn.LayerNorm and len(norm.normalized_shape) == 1:
        w, b, rms = norm.weight, norm.bias, False
    else:
        return None
    if any(t is not None and (t.dtype != torch.float32 or t.device.type != "cpu") for t in (w, b)):
        return None
    return rms, norm.eps, w is not None


def plan(layer, mode: str) -> Optional[tuple]:
    """The dispatcher's plan for ``layer`` in ``mode`` (``"decode"`` or ``"train"``;
    :func:`attnlab.backends.dispatch.plan_layer`): ``(path, arguments)`` or None (the modules). Cached on the layer
    (``layer._plans``, which :class:`~attnlab.nn.block.DecoderLayer` empties on ``train()``/``eval()`` and when its
    parameters change dtype or device) under the types of the modules the plan reads, the backend and the dropout
    rates: a module swapped in place (``int8_training``, ``optimize_for_inference``) or a rate changed makes a new
    plan."""
    m = layer._modules
    attn, ffn = m["self_attn"], m["ffn"]
    a, f = attn._modules, ffn._modules
    key = (mode, attn.backend, type(m["norm1"]), type(m["norm2"]), type(ffn), type(a["in_proj"]),
           type(a["out_proj"]), *(type(v) for v in f.values()), *(getattr(v, "p", None) for v in f.values()),
           getattr(m["dropout1"], "p", None), getattr(m["dropout2"], "p", None), getattr(m["drop_path"], "p", None))
    plans = layer.__dict__.setdefault("_plans", {})
    if key not in plans:
        norms = _norm_kind(m["norm1"]), _norm_kind(m["norm2"])
        plans[key] = dispatch.plan_layer(layer, mode, norms=norms,
                                         activation=ffn.activation if type(ffn) is FeedForward else None)
    return plans[key]


def _norm_tensors(norm: nn.Module) -> tuple:
    """A planned norm's ``(weight, bias)`` for :func:`attnlab._native.decoder_step` (None where absent)."""
    w, b = norm.weight, getattr(norm, "bias", None)
    return None if w is None else w.detach().contiguous(), None if b is None else b.detach().contiguous()


def decoder_step(layer, x: Tensor, cache: KVCache) -> Optional[Tensor]:
    """``layer.step(x, cache)`` (:meth:`attnlab.nn.block.DecoderLayer.step`) in one C++ call
    (:func:`attnlab._native.decoder_step`: both norms, the five products, RoPE, the cache write and the attention)
    where the layer's plan for decoding is that call (:func:`plan`) and this call fits it: gradients off, float32 on
    the CPU with the kernels built, the attention's :meth:`~attnlab.modules.multihead.MultiheadAttention.steps` and
    ``native_step``, each linear layer served by attnlab's matvec at this many rows (inference layouts or int8:
    ``matvec_args``), no hooks on the modules the step calls, not compiled. Else None (also where the projection is
    not finite: the caller's step then reruns the layer through the pipeline; a compiled graph cannot branch on that,
    so it runs the modules, whose own ops it records)."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling() or not _native.usable(x):
        return None  # (with gradients on, the norms' parameters would want theirs: no backward here)
    chosen = plan(layer, "decode")
    attn, ffn = layer.self_attn, layer.ffn
    if chosen is None or not attn.steps(x, cache) or hooked(layer.norm1, layer.norm2, ffn, attn.in_proj,
                                                             attn.out_proj, ffn.w1, ffn.w3, ffn.w2):
        return None
    products = []
    for lin in (attn.in_proj, attn.out_proj, ffn.w1, ffn.w3, ffn.w2):
        args = (None, None, None) if lin is None else getattr(lin, "matvec_args", lambda _: None)(x)
        if args is None:
            return None
        products.append(args)
    step = attn.native_step(cache)
    if step is None:
        return None
    _, how = chosen
    k_cache, v_cache, position, heads, kv_heads, cos, sin, interleaved, scale = step
    (qkv, o, w1, w3, w2), (w_1, b_1), (w_2, b_2) = products, _norm_tensors(layer.norm1), _norm_tensors(layer.norm2)
    tensors = [w_1, b_1, *qkv, *o, w_2, b_2, *w1, *w3, *w2, k_cache, v_cache, cos, sin]
    out = _native.decoder_step(x.contiguous(), tensors, rms=how["rms"], eps=how["eps"], heads=heads,
                               kv_heads=kv_heads, position=position, interleaved=interleaved, scale=scale,
                               activation=how["activation"])
    if out.numel() == 0:
        return None
    cache.advance(1, finite=True)
    return out


def decoder_train(layer, x: Tensor) -> Optional[Tensor]:
    """A decoder layer's training forward as one autograd node (:func:`attnlab._native_train.gpt_block_train`:
    both LayerNorms, the four int8 products, the short backend's causal attention, the activation with its
    derivative kept, both residuals — the calls the modules would make, in their order, so the same bits forward
    and backward) where the layer's plan for training is that node (:func:`plan`) and this call is one the modules
    would make so: grad mode on, float32 ``x (B, L, C)`` needing a gradient on the CPU with ``L`` the plan fits
    (:func:`attnlab.backends.dispatch.plan_fits`), no autocast, the four products in training mode with every parameter
    needing a gradient, no module hooks, not compiled (the fallback below branches on the data, which a graph
    cannot: compiled, the modules run, each through its own op). Else None; also where the projection or the
    attention's output is not finite (the modules then run, whose pipeline handles or explains it). Why: the
    layer's ten nodes and ~100 Python-level operations are per-operation overhead at nanogpt-cpu's sizes."""
    if not (torch.is_grad_enabled() and x.requires_grad and x.dtype == torch.float32 and x.dim() == 3
            and x.device.type == "cpu" and not torch.compiler.is_compiling()
            and not torch.is_autocast_enabled("cpu")):
        return None
    chosen = plan(layer, "train")
    if chosen is None:
        return None
    # (submodules and parameters read from their dicts: Module.__getattr__ would be ~26 lookups a call)
    mods = layer._modules
    attn, ffn, n1, n2 = mods["self_attn"], mods["ffn"], mods["norm1"], mods["norm2"]
    layers = (attn._modules["in_proj"], attn._modules["out_proj"], ffn._modules["w1"], ffn._modules["w2"])
    if not (dispatch.plan_fits(chosen[0], x.shape[1]) and x.shape[-1] == attn.embed_dim
            and n1.normalized_shape == n2.normalized_shape == x.shape[-1:] and _native.runs_on(x)
            and all(m.training for m in layers)) or hooked(
                attn, ffn, n1, n2, ffn._modules["dropout"], *layers):  # (the FFN calls its dropout even at p = 0)
        return None
    params = [t for m in (n1, layers[0], layers[1], n2, layers[2], layers[3])
              for t in (m._parameters["weight"], m._parameters.get("bias"))]
    if any(p is not None and (p.dtype != torch.float32 or not p.requires_grad) for p in params):
        return None
    _, how = chosen
    try:
        return _native_train.gpt_block_train(x, *params, **how)
    except RuntimeError as e:
        if "gpt_block_train: not finite" in str(e):
            return None
        raise
