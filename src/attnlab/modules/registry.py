"""Attention modules by name, for configs (``attention="additive"``).

:data:`ATTENTION_REGISTRY` maps each name to the import path ``"module:Class"`` of its module
class; :func:`get_attention` imports it on first use, so the registry can be imported from
anywhere (including the modules it names) without import cycles. Adding a variant is one line.
"""
from __future__ import annotations

import importlib

ATTENTION_REGISTRY: dict[str, str] = {
    "additive": "attnlab.modules.additive:AdditiveAttention",
    "luong": "attnlab.modules.multiplicative:LuongAttention",
    "location": "attnlab.modules.location:LocationAwareAttention",
    "monotonic": "attnlab.modules.monotonic:MonotonicAttention",
    "performer": "attnlab.modules.linear:PerformerAttention",
    "linformer": "attnlab.modules.linear:LinformerAttention",
    "multihead": "attnlab.modules.multihead:MultiheadAttention",
}


def get_attention(name: str) -> type:
    """The attention module class registered as ``name``.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: ``name`` is not registered; the message lists the valid names.
    """
    if not isinstance(name, str):
        raise TypeError(f"attention name must be a str, got {type(name).__name__}")
    if name not in ATTENTION_REGISTRY:
        raise ValueError(f"unknown attention {name!r}; valid names: {sorted(ATTENTION_REGISTRY)}")
    module_name, _, class_name = ATTENTION_REGISTRY[name].partition(":")
    return getattr(importlib.import_module(module_name), class_name)
