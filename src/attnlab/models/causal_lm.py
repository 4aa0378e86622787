"""What every decoder-only language model shares: the cache, the forward plumbing, ``generate``.

A family subclasses :class:`DecoderOnlyLM` and provides ``self.config`` (with ``vocab_size``),
``self.layers`` (decoder-only :class:`~attnlab.nn.block.DecoderLayer` s), ``embed(input_ids,
positions) -> (B, T, E)``, ``head(x) -> logits`` and ``max_positions`` (None when unbounded, e.g.
RoPE). Positions follow the attention mask as in Hugging Face: ``p = cumsum(mask) - 1``. A family whose layers
take per-token inputs besides ``x`` (Llama's value embeddings) returns them from ``layer_inputs(input_ids)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from attnlab._checks import non_negative_int
from attnlab.backends.dispatch import all_finite
from attnlab.modules.cache import _tracing
from attnlab.models.hub import PreTrainedMixin, check_token_inputs
from attnlab.nn.block import LayerCache
from attnlab.nn.inference import InferenceLayoutMixin


@dataclass
class CausalLMOutput:
    """``logits (B, T, V)``; ``past_key_values`` (one :class:`LayerCache` per layer) when caching;
    ``attentions``: per layer ``(B, H, T, S)`` weights with ``output_attentions``."""

    logits: Tensor
    past_key_values: Optional[list[LayerCache]] = None
    attentions: Optional[tuple[Tensor, ...]] = None


class DecoderOnlyLM(InferenceLayoutMixin, PreTrainedMixin, nn.Module):
    """Base of the decoder-only models (GPT-2, Llama): see the module docstring for the contract.

    ``optimize_for_inference(dtype=...)`` packs every linear layer for one-token decoding steps
    (:class:`~attnlab.nn.inference.InferenceLayoutMixin`).
    """

    packed_rows = 1  # a decode step multiplies one row per sequence
    accepts_logits_to_keep = True  # generate() asks for the last position's logits only

    max_positions: Optional[int] = None
    positions_field = "max_position_embeddings"  # the config field named in the too-long error

    def embed(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        raise NotImplementedError

    def head(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def layer_inputs(self, input_ids: Tensor) -> Optional[list[dict]]:
        """Keyword arguments for each layer computed from the tokens (e.g. ``value_embed``), or None (none)."""
        return None

    def new_cache(self, *, max_length: Optional[int] = None, window: Optional[int] = None) -> list[LayerCache]:
        """Empty per-layer caches; ``max_length`` preallocates them (a static cache); ``window`` makes each a ring
        buffer holding the keys a sliding window of that width still sees: O(window) memory however long the
        generation (every layer's self-attention must have a window ≤ it; see :attr:`attention_window`)."""
        return [LayerCache.create(max_length=max_length, cross_attention=False, window=window) for _ in self.layers]

    @property
    def attention_window(self) -> Optional[int]:
        """The sliding window shared by every layer's self-attention (``sliding_window(model, w)`` sets it), or
        None when some layer attends to the whole prefix."""
        windows = {layer.self_attn.window for layer in self.layers}
        return None if None in windows else max(windows)

    def forward(self, input_ids: Tensor, *, attention_mask: Optional[Tensor] = None,
                past_key_values: Optional[list[LayerCache]] = None, use_cache: bool = False,
                output_attentions: bool = False, logits_to_keep: int = 0) -> CausalLMOutput:
        """Logits of ``input_ids (B, T)`` continuing the cached prefix (if any).

        Args:
            attention_mask: ``(B, past + T)``, 1 = token, 0 = padding (left padding supported).
            past_key_values: caches from :meth:`new_cache` or a previous call; updated in place.
            use_cache: return the caches (new ones are made when ``past_key_values`` is None).
            output_attentions: also return each layer's weights ``(B, H, T, past + T)``.
            logits_to_keep: the head runs on the last this many positions only, ``logits (B, n, V)``
                (``transformers``' name; 0: all ``T``). Decoding needs the last one: a prompt's prefill then
                costs one row of the head, not ``T``.

        Raises:
            ValueError: ``input_ids`` is not a non-empty integer ``(B, T)`` tensor or an id is outside
                ``[0, vocab_size)``, past + T exceeds the model's positions, or ``attention_mask`` is
                not a 0/1 tensor of shape ``(B, past + T)`` (:func:`~attnlab.models.hub.check_token_inputs`).
        """
        if past_key_values is None and use_cache:
            past_key_values = self.new_cache()
        past = 0 if past_key_values is None else past_key_values[0].self_attn.length
        non_negative_int("logits_to_keep", logits_to_keep)
        B, T = check_token_inputs(input_ids, attention_mask, vocab_size=self.config.vocab_size,
                                  max_positions=self.max_positions, past=past, positions_name=self.positions_field)
        padding = None
        if attention_mask is None:
            pos = torch.arange(past, past + T, device=input_ids.device).unsqueeze(0)  # (1, T)
        else:
            pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:]  # (B, T)
            if not bool(attention_mask.all()):
                padding = attention_mask == 0  # (B, S), True = blocked
        if T == 1 and past_key_values is not None and padding is None and not output_attentions \
                and not self.training and not torch.is_grad_enabled() and not _tracing():  # (ONNX export: the pipeline)
            logits = self._step(input_ids, pos, past_key_values)
            if logits is not None:
                return CausalLMOutput(logits, past_key_values if use_cache else None)
        x = self.embed(input_ids, pos)  # (B, T, E)
        extra = self.layer_inputs(input_ids)
        weights = []
        for i, layer in enumerate(self.layers):
            # one query at the last position sees every key: no causal mask needed (bool(): the ONNX tracer
            # gives T as a tensor and records the example's branch, see attnlab.adapt.export)
            out = layer(x, tgt_key_padding_mask=padding, is_causal=bool(T > 1), need_weights=output_attentions,
                        cache=None if past_key_values is None else past_key_values[i], **(extra[i] if extra else {}))
            if output_attentions:
                x, w = out
                weights.append(w.self_attn)
            else:
                x = out
        if 0 < logits_to_keep < T:
            x = x[:, T - logits_to_keep:]
        return CausalLMOutput(self.head(x), past_key_values if use_cache else None,
                              tuple(weights) if output_attentions else None)

    def _step(self, input_ids: Tensor, pos: Tensor, caches: list[LayerCache]) -> Optional[Tensor]:
        """A decoding step (one new token per sequence, no padding, no gradients) through each layer's
        :meth:`~attnlab.nn.block.DecoderLayer.step`: logits ``(B, 1, V)``; None, with the caches as they were,
        when the logits are not finite (an overflow, a NaN weight), so that :meth:`forward`'s pipeline recomputes
        the step with its NaN/inf semantics and errors — one check per step instead of two per layer."""
        marks = [c.self_attn.mark() for c in caches]
        x = self.embed(input_ids, pos)  # (B, 1, E)
        extra = self.layer_inputs(input_ids)
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            x = layer.step(x, cache, **(extra[i] if extra else {}))
        logits = self.head(x)
        if all_finite(logits):
            return logits
        if any(c.self_attn.window is not None for c in caches):  # a ring cannot be rewound: report what it holds
            return logits
        for c, mark in zip(caches, marks):
            c.self_attn.rewind(mark)
        return None

    def generate(self, input_ids: Tensor, **kwargs) -> Tensor:
        """:func:`attnlab.generation.generate` on this model (same arguments)."""
        from attnlab.generation import generate
        return generate(self, input_ids, **kwargs)
