"""Pure tensor code: masks, normalisers, positional encodings, linear attention, request checks.

The pipeline :func:`attnlab.attention` itself lives in :mod:`attnlab.backends.dispatch` (it chooses the
backend); import it from ``attnlab``.
"""
from attnlab.functional.masks import (and_masks, causal_mod, document_mod, or_masks, padding_mask,
                                      prefix_lm_mod, sliding_window_mod)
from attnlab.functional.linear import FEATURE_MAPS, default_num_features, favor_projection, linear_attention
from attnlab.functional.normalize import NORMALIZERS

__all__ = ["linear_attention", "favor_projection", "default_num_features",
           "FEATURE_MAPS", "NORMALIZERS", "and_masks", "or_masks", "causal_mod", "document_mod",
           "padding_mask", "prefix_lm_mod", "sliding_window_mod"]

