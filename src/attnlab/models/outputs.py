"""What the encoder–decoder models return, and how their attention weights are taken.

:class:`Seq2SeqLMOutput` is shared by T5, BART and :class:`~attnlab.models.transformer.Seq2SeqTransformer`
(Hugging Face's field names). Its attention fields come from the layers' forward with ``need_weights``
(:class:`~attnlab.nn.block.AttentionWeights`): each :class:`~attnlab.modules.multihead.MultiheadAttention`
recovers its weights from the rows' log-sum-exp, ``w_ij = e^(s_ij - LSE_i)``, so the forward keeps its fast
backend.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import Tensor

from attnlab.nn.block import LayerCache


@dataclass
class Seq2SeqLMOutput:
    """An encoder–decoder's output (Hugging Face's names).

    Attributes:
        logits: ``(B, T, V)``.
        encoder_last_hidden_state: ``(B, S, E)``.
        loss: mean cross-entropy of ``labels`` (``-100`` ignored), when labels are given.
        past_key_values: one :class:`LayerCache` per decoder layer, with ``use_cache``.
        encoder_attentions: per encoder layer ``(B, H, S, S)``, with ``output_attentions``.
        decoder_attentions: per decoder layer ``(B, H, T, past + T)``, with ``output_attentions``.
        cross_attentions: per decoder layer ``(B, H, T, S)``, with ``output_attentions``.
    """

    logits: Tensor
    encoder_last_hidden_state: Tensor
    loss: Optional[Tensor] = None
    past_key_values: Optional[list[LayerCache]] = None
    encoder_attentions: Optional[tuple[Tensor, ...]] = None
    decoder_attentions: Optional[tuple[Tensor, ...]] = None
    cross_attentions: Optional[tuple[Tensor, ...]] = None
