"""Attention modules (batch-first ``(B, L, E)``), one file per family."""
from attnlab.modules.additive import AdditiveAttention
from attnlab.modules.linear import LinformerAttention, PerformerAttention
from attnlab.modules.location import LocationAwareAttention
from attnlab.modules.monotonic import MonotonicAttention
from attnlab.modules.multihead import MultiheadAttention
from attnlab.modules.multiplicative import LuongAttention
from attnlab.modules.registry import ATTENTION_REGISTRY, get_attention

__all__ = ["MultiheadAttention", "AdditiveAttention", "LuongAttention", "LocationAwareAttention",
           "MonotonicAttention", "PerformerAttention", "LinformerAttention", "ATTENTION_REGISTRY",
           "get_attention"]
