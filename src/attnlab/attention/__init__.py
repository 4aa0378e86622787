"""Attention modules (batch-first ``(B, L, E)``), one file per family."""
from attnlab.attention.multihead import MultiheadAttention

__all__ = ["MultiheadAttention"]
