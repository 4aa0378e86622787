"""Pure tensor code: masks, normalisers, positional encodings, linear attention, request checks.

The pipeline :func:`attnlab.attention` itself lives in :mod:`attnlab.backends.dispatch` (it chooses the
backend); ``attnlab.functional.attention`` and ``attention_weights`` still resolve to it, lazily.
"""
from attnlab.functional.masks import (and_masks, causal_mod, document_mod, or_masks, padding_mask,
                                      prefix_lm_mod, sliding_window_mod)
from attnlab.functional.linear import FEATURE_MAPS, default_num_features, favor_projection, linear_attention
from attnlab.functional.normalize import NORMALIZERS

__all__ = ["attention", "attention_weights", "linear_attention", "favor_projection", "default_num_features",
           "FEATURE_MAPS", "NORMALIZERS", "and_masks", "or_masks", "causal_mod", "document_mod",
           "padding_mask", "prefix_lm_mod", "sliding_window_mod"]


def __getattr__(name: str):
    if name in ("attention", "attention_weights"):
        from attnlab.backends import dispatch

        return getattr(dispatch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
