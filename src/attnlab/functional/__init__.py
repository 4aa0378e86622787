"""Pure tensor code: the attention pipeline, masks, normalisers, positional encodings."""
from attnlab.functional.attention import attention, attention_weights
from attnlab.functional.masks import (and_masks, causal_mod, document_mod, or_masks, padding_mask,
                                      prefix_lm_mod, sliding_window_mod)
from attnlab.functional.linear import FEATURE_MAPS, default_num_features, favor_projection, linear_attention
from attnlab.functional.normalize import NORMALIZERS

__all__ = ["attention", "attention_weights", "linear_attention", "favor_projection", "default_num_features",
           "FEATURE_MAPS", "NORMALIZERS", "and_masks", "or_masks", "causal_mod", "document_mod",
           "padding_mask", "prefix_lm_mod", "sliding_window_mod"]
