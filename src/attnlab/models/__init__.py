"""Models built from attnlab's blocks, configured by dataclasses."""
from attnlab.models.config import TransformerConfig
from attnlab.models.transformer import (Seq2SeqTransformer, Transformer, TransformerDecoder,
                                        TransformerEncoder)

__all__ = ["TransformerConfig", "Seq2SeqTransformer", "Transformer", "TransformerDecoder", "TransformerEncoder"]
