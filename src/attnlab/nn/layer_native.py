"""A decoder layer's native paths: a decoding step in one C++ call (:func:`decoder_step`) and a training step as one
autograd node of C++ ops (:func:`decoder_train`). Each is taken only where the layer's modules would make exactly its
calls — the same bits — and returns None otherwise, so :class:`attnlab.nn.block.DecoderLayer` runs its modules."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _module

from attnlab import _native, _native_train
from attnlab.backends import AUTO_ORDER, short
from attnlab.functional.request import default_scale
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


def _native_norm(norm: nn.Module) -> Optional[tuple]:
    """``(rms, weight, bias, eps)`` of an RMSNorm or a LayerNorm over the last dim with float32 CPU parameters, for
    :func:`attnlab._native.decoder_step`; None for any other norm."""
    if type(norm) is RMSNorm:
        w, b, rms = norm.weight, None, True
    elif type(norm) is nn.LayerNorm and len(norm.normalized_shape) == 1:
        w, b, rms = norm.weight, norm.bias, False
    else:
        return None
    if any(t is not None and (t.dtype != torch.float32 or t.device.type != "cpu") for t in (w, b)):
        return None
    return rms, None if w is None else w.detach().contiguous(), None if b is None else b.detach().contiguous(), norm.eps


def decoder_step(layer, x: Tensor, cache: KVCache) -> Optional[Tensor]:
    """``layer.step(x, cache)`` (:meth:`attnlab.nn.block.DecoderLayer.step`) in one C++ call
    (:func:`attnlab._native.decoder_step`: both norms, the five products, RoPE, the cache write and the attention)
    where every part is one it computes: gradients off, float32 on the CPU with the kernels built, the attention's
    :meth:`~attnlab.modules.multihead.MultiheadAttention.steps` and ``native_step``, RMSNorm or LayerNorm, a
    :class:`FeedForward`, each linear layer served by attnlab's matvec (inference layouts or int8:
    ``matvec_args``), no hooks on the modules the step calls, not compiled. Else None (also where the projection is
    not finite: the caller's step then reruns the layer through the pipeline; a compiled graph cannot branch on that,
    so it runs the modules, whose own ops it records)."""
    attn, ffn = layer.self_attn, layer.ffn
    if torch.is_grad_enabled() or torch.compiler.is_compiling() or not (
            type(ffn) is FeedForward and _native.usable(x) and attn.steps(x, cache)):
        return None  # (with gradients on, the norms' parameters would want theirs: no backward here)
    norms = _native_norm(layer.norm1), _native_norm(layer.norm2)
    if norms[0] is None or norms[1] is None or norms[0][0] != norms[1][0]:
        return None
    if hooked(layer.norm1, layer.norm2, ffn, attn.in_proj, attn.out_proj, ffn.w1, ffn.w3, ffn.w2):
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
    k_cache, v_cache, position, heads, kv_heads, cos, sin, interleaved, scale = step
    (qkv, o, w1, w3, w2), (rms, w_1, b_1, eps1), (_, w_2, b_2, eps2) = products, *norms
    tensors = [w_1, b_1, *qkv, *o, w_2, b_2, *w1, *w3, *w2, k_cache, v_cache, cos, sin]
    out = _native.decoder_step(x.contiguous(), tensors, rms=rms, eps=(eps1, eps2), heads=heads,
                               kv_heads=kv_heads, position=position, interleaved=interleaved, scale=scale,
                               activation=ffn.activation)
    if out.numel() == 0:
        return None
    cache.advance(1, finite=True)
    return out


def decoder_train(layer, x: Tensor) -> Optional[Tensor]:
    """A decoder layer's training forward as one autograd node (:func:`attnlab._native_train.gpt_block_train`:
    both LayerNorms, the four int8 products, the short backend's causal attention, the activation with its
    derivative kept, both residuals — the calls the modules would make, in their order, so the same bits forward
    and backward) where the modules would take exactly those calls: a pre-norm decoder-only layer in training,
    float32 ``x`` needing a gradient on the CPU, no autocast, LayerNorms with a weight, int8 training products
    (a class declaring ``int8_levels``: :class:`attnlab.adapt.int8_training.Int8TrainingLinear`) in training
    mode whose parameters all need gradients, a packed causal softmax self-attention the short backend serves
    (``auto`` or ``short``; no window, position bias, QK-norm, RoPE or grouped heads; at most ``SHORT_KEYS``
    keys), a plain activation, no dropout, no module hooks, not compiled (the fallback below branches on the data,
    which a graph cannot: compiled, the modules run, each through its own op). Else None; also where the projection
    or the attention's output is not finite (the modules then run, whose pipeline handles or explains it). Why: the
    layer's ten nodes and ~100 Python-level operations cost ~2 ms of nanogpt-cpu's ~40 ms step on 2 cores (the per-operation
    overhead, not the arithmetic)."""
    # (submodules and parameters read from their dicts: Module.__getattr__ would be ~26 lookups a call)
    mods = layer._modules
    attn, ffn, n1, n2 = mods["self_attn"], mods["ffn"], mods["norm1"], mods["norm2"]
    if not (layer.training and torch.is_grad_enabled() and not torch.compiler.is_compiling() and layer.norm_first
            and layer.cross_attn is None
            and x.dtype == torch.float32 and x.dim() == 3 and x.requires_grad and x.device.type == "cpu"
            and type(ffn) is FeedForward and type(n1) is nn.LayerNorm and type(n2) is nn.LayerNorm
            and attn.packed and ffn.w3 is None and attn.dropout == 0 and ffn._modules["dropout"].p == 0
            and mods["dropout1"].p == 0 and mods["dropout2"].p == 0 and mods["drop_path"].p == 0
            and attn.num_kv_heads == attn.num_heads and attn.q_norm is None and attn.k_norm is None
            and attn.rotary is None and attn.position_bias is None and attn.window is None
            and attn.normalize == "softmax" and attn.top_k is None and ffn.activation in _native.ACTIVATIONS
            and (attn.backend == "short" or (attn.backend == "auto" and AUTO_ORDER[0] == "short"))
            and 0 < x.shape[1] <= short.FUSED_KEYS and x.shape[-1] == attn.embed_dim
            and n1.normalized_shape == n2.normalized_shape == x.shape[-1:] and not torch.is_autocast_enabled("cpu")
            and _native.runs_on(x)):
        return None
    layers = (attn._modules["in_proj"], attn._modules["out_proj"], ffn._modules["w1"], ffn._modules["w2"])
    # an int8 training layer's class declares its levels in its own body (adapt.int8_training.Int8TrainingLinear;
    # a subclass, which may compute otherwise, does not: the modules then run)
    levels = {type(m).__dict__.get("int8_levels") for m in layers}
    if len(levels) != 1 or None in levels or not all(m.training for m in layers) or hooked(
            attn, ffn, n1, n2, ffn._modules["dropout"], *layers):  # (the FFN calls its dropout even at p = 0)
        return None
    params = [t for m in (n1, layers[0], layers[1], n2, layers[2], layers[3])
              for t in (m._parameters["weight"], m._parameters.get("bias"))]
    if params[0] is None or params[6] is None or any(  # (the norms' weights)
            p is not None and (p.dtype != torch.float32 or not p.requires_grad) for p in params):
        return None
    scale = default_scale(attn.head_dim) if attn.scale is None else float(attn.scale)
    if not abs(scale) <= 1e3:
        return None
    try:
        (left, right), = levels
        return _native_train.gpt_block_train(x, *params, heads=attn.num_heads, scale=scale, eps=(n1.eps, n2.eps),
                                             activation=ffn.activation, left=left, right=right)
    except RuntimeError as e:
        if "gpt_block_train: not finite" in str(e):
            return None
        raise
