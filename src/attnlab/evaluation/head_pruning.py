"""Pruning attention heads without changing the model (Michel et al. 2019): head ``h``'s output is scaled (0 =
pruned) before the output projection, ``MHA(X) = Concat(m_1 head_1, …, m_H head_H) W_O``, by a forward pre-hook on
each self-attention's ``out_proj``; and the loss change of pruning each head alone."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from attnlab.modules.multihead import MultiheadAttention


def self_attention_modules(model: nn.Module) -> list[MultiheadAttention]:
    """The model's self-attention modules (``…self_attn`` :class:`MultiheadAttention`), in layer order;
    a bare :class:`MultiheadAttention` is its own one layer.

    Raises:
        ValueError: the model holds no such module.
    """
    if isinstance(model, MultiheadAttention):
        return [model]
    mods = [m for name, m in model.named_modules() if name.endswith("self_attn") and isinstance(m, MultiheadAttention)]
    if not mods:
        raise ValueError(f"{type(model).__name__} has no attnlab MultiheadAttention self-attention modules")
    return mods


@contextlib.contextmanager
def head_mask(model: nn.Module, mask: Tensor, *, modules: Optional[Sequence[MultiheadAttention]] = None
              ) -> Iterator[None]:
    """Within the block, head ``h`` of layer ``l`` outputs ``mask[l, h] · head_h`` (0 = pruned).

    ``MHA(X) = Concat(m_1 head_1, …, m_H head_H) W_O``: a forward pre-hook on each module's
    ``out_proj`` scales the ``h``-th ``head_dim`` slice of its input. The hooks are removed on exit.

    Args:
        model: the model (its modules are found by :func:`self_attention_modules`).
        mask: ``(layers, H)`` float or bool.
        modules: the attention modules the rows of ``mask`` refer to (default: all self-attentions).

    Raises:
        ValueError: ``mask`` does not match ``(len(modules), num_heads)``.
    """
    mods = list(modules) if modules is not None else self_attention_modules(model)
    H = mods[0].num_heads
    if not isinstance(mask, Tensor) or mask.shape != (len(mods), H) or any(m.num_heads != H for m in mods):
        raise ValueError(f"mask must be a (layers, heads) = {(len(mods), H)} tensor, "
                         f"got {tuple(getattr(mask, 'shape', ())) or type(mask).__name__}")
    handles = []

    def make_hook(row: Tensor, head_dim: int):
        def hook(_module, inputs):
            x = inputs[0]  # (B, L, H·Dh)
            return (x * row.to(x.dtype).repeat_interleave(head_dim),) + tuple(inputs[1:])
        return hook

    try:
        for mod, row in zip(mods, mask):
            handles.append(mod.out_proj.register_forward_pre_hook(make_hook(row, mod.head_dim)))
        yield
    finally:
        for h in handles:
            h.remove()


def prune_heads(model: nn.Module, heads: dict[int, Sequence[int]]):
    """Context manager: ``heads = {layer: [head, …]}`` pruned (outputs zeroed), see :func:`head_mask`.

    Raises:
        ValueError: a layer or head index out of range.
    """
    mods = self_attention_modules(model)
    mask = torch.ones(len(mods), mods[0].num_heads)
    for layer, hs in heads.items():
        for h in hs:
            if not (0 <= layer < len(mods) and 0 <= h < mods[0].num_heads):
                raise ValueError(f"heads: (layer {layer}, head {h}) out of range "
                                 f"({len(mods)} layers × {mods[0].num_heads} heads)")
            mask[layer, h] = 0.0
    return head_mask(model, mask, modules=mods)


def pruning_effect(model: nn.Module, loss: Callable[[], float]) -> tuple[float, Tensor]:
    """``(base, Δ (layers, H))``: ``Δ[l, h] = loss(head h of layer l pruned) − loss()``."""
    mods = self_attention_modules(model)
    base = loss()
    delta = torch.zeros(len(mods), mods[0].num_heads, dtype=torch.float64)
    for layer in range(delta.shape[0]):
        for h in range(delta.shape[1]):
            with prune_heads(model, {layer: [h]}):
                delta[layer, h] = loss() - base
    return base, delta
