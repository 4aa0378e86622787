"""Building blocks: norms, feed-forward, positional encodings, Transformer layers, the KV cache.

(``attnlab.nn.block`` is imported directly, not here: it needs ``MultiheadAttention``, which
itself imports ``attnlab.nn.cache``.)
"""
from attnlab.nn.cache import KVCache
from attnlab.nn.feedforward import FeedForward
from attnlab.nn.inference import InferenceLayoutMixin, PackedLinear, optimize_linears_
from attnlab.nn.norms import RMSNorm, make_norm
from attnlab.nn.positional import (ALiBi, LearnedPositionalEmbedding, RotaryEmbedding,
                                   SinusoidalPositionalEmbedding, T5RelativeBias)

__all__ = ["KVCache", "FeedForward", "RMSNorm", "make_norm", "ALiBi", "LearnedPositionalEmbedding",
           "RotaryEmbedding", "SinusoidalPositionalEmbedding", "T5RelativeBias", "InferenceLayoutMixin", "PackedLinear",
           "optimize_linears_"]
