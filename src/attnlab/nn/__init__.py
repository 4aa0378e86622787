"""Building blocks: norms, feed-forward, positional encodings, Transformer layers, the KV cache."""
from attnlab.nn.cache import KVCache

__all__ = ["KVCache"]
