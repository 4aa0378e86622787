"""attnlab: every attention mechanism and the Transformer family, exact and fast.

The one pipeline is :func:`attnlab.attention`; modules live in :mod:`attnlab.modules`,
blocks in :mod:`attnlab.nn`, models in :mod:`attnlab.models`.
"""
from attnlab.modules import (AdditiveAttention, LinformerAttention, LocationAwareAttention, LuongAttention,
                             MonotonicAttention, MultiheadAttention, PerformerAttention, get_attention)
from attnlab.backends import BACKENDS
from attnlab.backends.dispatch import attention, attention_weights
from attnlab.functional.linear import favor_projection, linear_attention
from attnlab.functional.masks import (and_masks, bigbird_layout, bigbird_mod, causal_mod, document_mod, fixed_mod,
                                      or_masks, prefix_lm_mod, sliding_window_mod, softcap_score_mod, strided_mod)
from attnlab.functional.positional import (alibi_score_mod, alibi_slopes, apply_rope, rope_frequencies,
                                           sinusoidal_table, t5_relative_buckets)
from attnlab.modules.cache import KVCache
from attnlab.nn.positional import (ALiBi, LearnedPositionalEmbedding, RotaryEmbedding,
                                   SinusoidalPositionalEmbedding, T5RelativeBias)

__version__ = "0.2.0.dev0"

__all__ = [
    "attention", "attention_weights", "BACKENDS", "MultiheadAttention", "AdditiveAttention", "LuongAttention",
    "LocationAwareAttention", "MonotonicAttention", "get_attention", "PerformerAttention", "LinformerAttention",
    "linear_attention", "favor_projection", "KVCache", "__version__",
    "sinusoidal_table", "rope_frequencies", "apply_rope", "alibi_slopes", "alibi_score_mod",
    "t5_relative_buckets", "SinusoidalPositionalEmbedding", "LearnedPositionalEmbedding",
    "RotaryEmbedding", "ALiBi", "T5RelativeBias",
    "causal_mod", "sliding_window_mod", "prefix_lm_mod", "document_mod", "and_masks", "or_masks",
    "strided_mod", "fixed_mod", "bigbird_mod", "bigbird_layout", "softcap_score_mod",
]

# blocks and models (after the attention imports: attnlab.nn.block imports MultiheadAttention)
from attnlab.nn.norms import RMSNorm, make_norm  # noqa: E402
from attnlab.nn.feedforward import FeedForward  # noqa: E402
from attnlab.nn.block import (AttentionWeights, DecoderLayer, DropPath, EncoderLayer, LayerCache,  # noqa: E402
                              LayerSpec)
from attnlab.models.config import TransformerConfig  # noqa: E402
from attnlab.models.transformer import (Seq2SeqTransformer, Transformer, TransformerDecoder,  # noqa: E402
                                        TransformerEncoder)

__all__ += ["RMSNorm", "make_norm", "FeedForward", "AttentionWeights", "DecoderLayer", "DropPath",
            "EncoderLayer", "LayerCache", "LayerSpec", "TransformerConfig", "Seq2SeqTransformer", "Transformer",
            "TransformerDecoder", "TransformerEncoder"]
from attnlab.models.bert import BertConfig, BertForMaskedLM, BertForPreTraining, BertModel  # noqa: E402
from attnlab.models.hub import from_pretrained, save_pretrained  # noqa: E402

__all__ += ["BertConfig", "BertModel", "BertForMaskedLM", "BertForPreTraining", "from_pretrained", "save_pretrained"]
from attnlab.generation import GenerationConfig, generate  # noqa: E402
from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel  # noqa: E402

__all__ += ["generate", "GenerationConfig", "GPT2Config", "GPT2LMHeadModel"]
from attnlab.models.llama import LlamaConfig, LlamaForCausalLM  # noqa: E402

__all__ += ["LlamaConfig", "LlamaForCausalLM"]
from attnlab.models.t5 import T5Config, T5ForConditionalGeneration  # noqa: E402

__all__ += ["T5Config", "T5ForConditionalGeneration"]
from attnlab.models.bart import BartConfig, BartForConditionalGeneration  # noqa: E402

__all__ += ["BartConfig", "BartForConditionalGeneration"]
from attnlab.models.vit import ViTConfig, ViTForImageClassification, ViTModel  # noqa: E402
from attnlab.models.clip import CLIPConfig, CLIPModel  # noqa: E402

__all__ += ["ViTConfig", "ViTModel", "ViTForImageClassification", "CLIPConfig", "CLIPModel"]
