"""Attention modules (batch-first ``(B, L, E)``), one file per family."""
from attnlab.attention.additive import AdditiveAttention
from attnlab.attention.linear import LinformerAttention, PerformerAttention
from attnlab.attention.location import LocationAwareAttention
from attnlab.attention.monotonic import MonotonicAttention
from attnlab.attention.multihead import MultiheadAttention
from attnlab.attention.multiplicative import LuongAttention
from attnlab.attention.registry import ATTENTION_REGISTRY, get_attention

__all__ = ["MultiheadAttention", "AdditiveAttention", "LuongAttention", "LocationAwareAttention",
           "MonotonicAttention", "PerformerAttention", "LinformerAttention", "ATTENTION_REGISTRY",
           "get_attention"]
