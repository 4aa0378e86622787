"""attnlab: every attention mechanism and the Transformer family, exact and fast.

The one pipeline is :func:`attnlab.attention`; modules live in :mod:`attnlab.attention`,
blocks in :mod:`attnlab.nn`, models in :mod:`attnlab.models`.
"""
from attnlab.attention.multihead import MultiheadAttention
from attnlab.backends import BACKENDS
from attnlab.functional.attention import attention
from attnlab.nn.cache import KVCache

__version__ = "0.1.0"

__all__ = ["attention", "BACKENDS", "MultiheadAttention", "KVCache", "__version__"]
