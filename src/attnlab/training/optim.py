"""Optimisers with weight-decay groups: AdamW (Loshchilov & Hutter 2019) and Adafactor (Shazeer & Stern 2018).

Weight-decay rule (GPT-2 / nanoGPT's): every trainable parameter with ``dim >= 2`` is decayed —
the weight matrices of linear layers and the embedding tables — and every parameter with
``dim < 2`` is not: biases and the gains/offsets of LayerNorm/RMSNorm. A tied parameter (the LM
head sharing the token embedding) is counted once.

AdamW's decoupled update with decay ``λ``::

    m ← β₁ m + (1 − β₁) g;   v ← β₂ v + (1 − β₂) g²
    θ ← θ − lr · (λ θ + m̂ / (√v̂ + ε))        (m̂, v̂ bias-corrected)
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from attnlab._checks import is_real, non_negative_number, one_of

__all__ = ["OPTIMIZERS", "param_groups", "build_optimizer"]

OPTIMIZERS = ("adamw", "adafactor")


def param_groups(model: nn.Module, *, weight_decay: float) -> list[dict]:
    """Two groups of ``model``'s trainable parameters: ``dim >= 2`` with ``weight_decay``, the rest with 0.

    Empty groups are left out. Raises ValueError if the model has no trainable parameter.
    """
    decay, no_decay = [], []
    for _, p in model.named_parameters():  # tied parameters appear once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    if not decay and not no_decay:
        raise ValueError("model has no trainable parameters")
    groups = [{"params": decay, "weight_decay": float(weight_decay)},
              {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, *, name: str = "adamw", lr: float, betas: tuple[float, float] = (0.9, 0.999),
                    eps: float = 1e-8, weight_decay: float = 0.0,
                    fused: Optional[bool] = None) -> torch.optim.Optimizer:
    """An optimiser over :func:`param_groups` of ``model``.

    Args:
        model: the module whose trainable parameters are optimised.
        name: ``"adamw"`` (``torch.optim.AdamW``) or ``"adafactor"`` (``torch.optim.Adafactor``, with
            its own defaults for β₂-decay and ε; ``betas``/``eps`` apply to AdamW only).
        lr: the (initial) learning rate; a schedule overwrites each group's ``lr`` every step.
        betas, eps: AdamW's moment coefficients and denominator ε.
        weight_decay: decoupled decay λ of the ``dim >= 2`` group.
        fused: AdamW's single-kernel implementation; ``None`` = fused when every parameter is a
            float tensor on CPU or CUDA (the fastest choice there), else the foreach one.

    Raises:
        ValueError: unknown ``name`` or an out-of-range hyper-parameter (the message names it).
    """
    one_of("optimizer", name, OPTIMIZERS)
    for arg, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        non_negative_number(arg, value)
    if (not isinstance(betas, (tuple, list)) or len(betas) != 2
            or not all(is_real(b) and 0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    groups = param_groups(model, weight_decay=weight_decay)
    if name == "adafactor":
        return torch.optim.Adafactor(groups, lr=lr, weight_decay=weight_decay)
    if fused is None:
        params = [p for g in groups for p in g["params"]]
        fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                             fused=bool(fused), foreach=None if fused else True)
