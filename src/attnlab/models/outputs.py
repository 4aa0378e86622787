"""What the encoder–decoder models return, and how their attention weights are taken.

:class:`Seq2SeqLMOutput` is shared by T5, BART and :class:`~attnlab.models.transformer.Seq2SeqTransformer`
(Hugging Face's field names). :func:`record_attention_weights` collects the per-head weights of
:class:`~attnlab.attention.multihead.MultiheadAttention` modules while a model runs on its fast backend:
each module's weights are recovered from its queries, keys and the rows' log-sum-exp
(:meth:`MultiheadAttention.attention_weights`, ``w_ij = e^(s_ij - LSE_i)``), so the forward pass
itself never switches to the materialising ``reference`` path.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

from torch import Tensor, nn

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


@contextmanager
def record_attention_weights(modules: Sequence[nn.Module]) -> Iterator[list[Optional[Tensor]]]:
    """Within the ``with`` block, ``weights[i]`` becomes the ``(B, H, L, S)`` weights of ``modules[i]``'s
    last call (a :class:`MultiheadAttention`, called as the layers call it; ``None`` if it did not run).

    The weights follow from the call's own ``query``, ``key`` and masks; a call continuing a
    non-empty self-attention KV cache is refused (its past keys are not among the inputs).

    Raises:
        ValueError: a recorded module attends over cached past positions.
    """
    weights: list[Optional[Tensor]] = [None] * len(modules)

    def hook(i: int, module: nn.Module, args, kwargs) -> None:
        call = inspect.signature(module.forward).bind(*args, **kwargs).arguments
        cache = call.get("cache")
        if cache is not None and not cache.static and cache.length > 0:
            raise ValueError("output_attentions needs the whole decoder input: the self-attention cache "
                             f"already holds {cache.length} positions (pass an empty past_key_values)")
        weights[i] = module.attention_weights(call["query"], call.get("key"),
                                              key_padding_mask=call.get("key_padding_mask"),
                                              attn_mask=call.get("attn_mask"),
                                              is_causal=call.get("is_causal", False))

    handles = [m.register_forward_pre_hook(lambda mod, a, kw, i=i: hook(i, mod, a, kw), with_kwargs=True)
               for i, m in enumerate(modules)]
    try:
        yield weights
    finally:
        for h in handles:
            h.remove()
