"""Building blocks: norms, feed-forward, positional encodings, Transformer layers, the KV cache.

(``attnlab.nn.block`` is imported directly, not here, to keep ``import attnlab.nn`` light.
``KVCache`` lives in :mod:`attnlab.modules.cache`, the layer below, and is re-exported here.)
"""
from attnlab.modules.cache import KVCache
from attnlab.nn.feedforward import FeedForward
from attnlab.nn.inference import InferenceLayoutMixin, PackedLinear, optimize_linears_
from attnlab.nn.norms import RMSNorm, make_norm
from attnlab.nn.positional import (ALiBi, LearnedPositionalEmbedding, RotaryEmbedding,
                                   SinusoidalPositionalEmbedding, T5RelativeBias)

__all__ = ["KVCache", "FeedForward", "RMSNorm", "make_norm", "ALiBi", "LearnedPositionalEmbedding",
           "RotaryEmbedding", "SinusoidalPositionalEmbedding", "T5RelativeBias", "InferenceLayoutMixin", "PackedLinear",
           "optimize_linears_"]
