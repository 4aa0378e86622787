"""The decoding state of :mod:`attnlab.generation`: beam reordering of every cache kind, and an encoder–decoder
presented through the decoder protocol (its source encoded once, its memory and mask carried in the cache)."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

from torch import Tensor

from attnlab.modules.cache import KVCache
from attnlab.nn.block import LayerCache


def reorder_cache(cache, index: Tensor) -> None:
    """Select batch rows of every :class:`KVCache` in ``cache`` (a KVCache, LayerCache, list of them or
    :class:`EncoderDecoderCache`, whose memory and source mask follow)."""
    if isinstance(cache, (KVCache, EncoderDecoderCache)):
        cache.reorder(index)
    elif isinstance(cache, LayerCache):
        for c in (cache.self_attn, cache.cross_attn):
            if c is not None:
                c.reorder(index)
    elif isinstance(cache, (list, tuple)):
        for c in cache:
            reorder_cache(c, index)
    else:
        raise TypeError("cache must be a KVCache, LayerCache, a list of them or an EncoderDecoderCache, "
                        f"got {type(cache).__name__}")


@dataclass
class EncoderDecoderCache:
    """An encoder–decoder's decoding state: per-layer caches, the encoder output ``memory (B, S, E)`` and
    the source mask ``(B, S)`` (or None). :meth:`reorder` selects the same rows of all of them."""

    layers: list
    memory: Tensor
    memory_mask: Optional[Tensor] = None

    def reorder(self, index: Tensor) -> None:
        reorder_cache(self.layers, index)
        self.memory = self.memory.index_select(0, index)
        if self.memory_mask is not None:
            self.memory_mask = self.memory_mask.index_select(0, index)


class EncoderDecoderAsDecoder:
    """An encoder–decoder seen through the decoder protocol: ``input_ids (B, S)`` is encoded once,
    then each call decodes the new target tokens on the memory its :class:`EncoderDecoderCache` carries."""

    def __init__(self, model, input_ids: Tensor, attention_mask: Optional[Tensor]) -> None:
        self.model = model
        self.memory, self.memory_mask = model.encode(input_ids, attention_mask), attention_mask  # (B, S, E)

    def new_cache(self, *, max_length: Optional[int] = None) -> EncoderDecoderCache:
        return EncoderDecoderCache(self.model.new_cache(max_length=max_length), self.memory, self.memory_mask)

    def __call__(self, input_ids: Tensor, *, attention_mask: Optional[Tensor] = None,
                 past_key_values: EncoderDecoderCache, use_cache: bool = True) -> SimpleNamespace:
        """Logits ``(B, T, V)`` of the target tokens ``input_ids`` continuing the cached prefix
        (``attention_mask`` would be the target's: encoder–decoder prompts are unpadded)."""
        s = past_key_values
        return SimpleNamespace(logits=self.model.decode(input_ids, s.memory, attention_mask=s.memory_mask,
                                                        cache=s.layers))


@dataclass
class CropCache:
    """:class:`CroppedContext`'s decoding state: every token so far ``ids (B, n)``, and the model's own cache
    while the sequence still fits its positions (None once it has been cropped)."""

    inner: Optional[list]
    ids: Optional[Tensor] = None


class CroppedContext:
    """A decoder with a position limit ``block`` seen through the decoder protocol with no limit, as nanoGPT's
    ``sample.py`` decodes: each next token is predicted from the last ``block`` tokens. While the sequence fits,
    the model's KV cache continues it (the same logits as a full forward); past the block each step runs the
    model on the last ``block`` tokens afresh (positions 0 … block-1), ``block`` rows a token."""

    def __init__(self, model, block: int) -> None:
        self.model, self.block = model, block
        self.accepts_logits_to_keep = getattr(model, "accepts_logits_to_keep", False)

    def new_cache(self, *, max_length: Optional[int] = None) -> CropCache:
        return CropCache(self.model.new_cache())

    def __call__(self, input_ids: Tensor, *, attention_mask: Optional[Tensor] = None, past_key_values: CropCache,
                 use_cache: bool = True, **keep) -> SimpleNamespace:
        """Logits of the position after ``input_ids`` continuing the tokens in ``past_key_values`` (updated);
        prompts are unpadded (``attention_mask`` is None)."""
        import torch

        s = past_key_values
        s.ids = input_ids if s.ids is None else torch.cat([s.ids, input_ids], dim=1)  # (B, n)
        if s.inner is not None and s.ids.shape[1] <= self.block:
            return self.model(input_ids, past_key_values=s.inner, use_cache=True, **keep)
        s.inner = None  # cropped: positions restart at 0 for the last block tokens, no cache can continue them
        return self.model(s.ids[:, -self.block:], use_cache=False, **keep)
