"""Gradient (activation) checkpointing: trade recomputation in backward for activation memory."""
from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn

__all__ = ["enable_gradient_checkpointing"]


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute each layer's activations in backward instead of storing them.

    Uses ``model.gradient_checkpointing_enable()`` when the model has one; otherwise wraps the
    forward of every module in ``model.layers`` (an ``nn.ModuleList``) with non-reentrant
    ``torch.utils.checkpoint`` (RNG state preserved, so dropout masks match). Parameter names and
    the state dict are unchanged; without grad (evaluation, generation) layers run plainly.

    Raises:
        ValueError: the model has neither the method nor a ``layers`` ModuleList.
    """
    if callable(getattr(model, "gradient_checkpointing_enable", None)):
        model.gradient_checkpointing_enable()
        return
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"grad_checkpointing needs a model with gradient_checkpointing_enable() or a "
                         f"`layers` nn.ModuleList; {type(model).__name__} has neither")
    for layer in layers:
        plain = layer.forward

        def checkpointed(*args, _plain=plain, **kwargs):
            if torch.is_grad_enabled():
                return torch.utils.checkpoint.checkpoint(_plain, *args, use_reentrant=False, **kwargs)
            return _plain(*args, **kwargs)
        layer.forward = checkpointed

