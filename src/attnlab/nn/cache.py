"""The key/value cache, :class:`attnlab.modules.cache.KVCache`, under the name it first had here.

It lives with the attention modules that fill it, so that ``attention/`` never imports ``nn/``
(``nn/`` sits above it: its layers are built from ``MultiheadAttention``).
"""
from attnlab.modules.cache import KVCache

__all__ = ["KVCache"]
