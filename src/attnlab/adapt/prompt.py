"""Prompt tuning (Lester et al. 2021) and prefix tuning (Li & Liang 2021) for decoder-only LMs.

Both learn ``n`` virtual tokens in front of every input while the language model stays frozen:

- **prompt tuning**: a soft prompt ``P ∈ R^{n×E}`` is the layer-0 input at positions ``0..n-1``;
  the decoder reads ``[P; Embed(x)]`` and the real tokens sit at positions ``n, n+1, …``.
- **prefix tuning**: each layer ``l`` gets learned keys and values ``K_l, V_l ∈ R^{Hkv×n×D}``
  prepended to its self-attention keys/values: ``Attn(q, [K_l; k], [V_l; v])``.

Both run through the model's KV cache (:class:`attnlab.nn.block.LayerCache`): because the decoder
is causal, the virtual tokens' keys/values do not depend on the real tokens, so the wrapper fills
the cache with them (prompt tuning: one pass of ``P`` through the layers; prefix tuning: the
parameters themselves) and then runs the frozen model on the real tokens with ``attention_mask``
extended by ``n`` ones in front. Gradients reach ``P`` (or ``K_l, V_l``) through the cache.
The wrappers follow :mod:`attnlab.generation`'s protocol, so ``generate`` works unchanged.

Prompt vectors are layer-0 *inputs*: for learned absolute positions (GPT-2) they already include
their position embedding (``init_ids`` initialises ``P = Embed(init_ids) at positions 0..n-1``,
which makes the wrapper compute exactly ``model(cat(init_ids, x))``). Encoder models are not
supported (they would need an ``inputs_embeds`` argument on their forward).
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor, nn

from attnlab._checks import positive_int
from attnlab._limits import check_seed
from attnlab.models.causal_lm import CausalLMOutput, DecoderOnlyLM
from attnlab.nn.block import LayerCache

IdsLike = Union[Tensor, Sequence[int]]


class _VirtualTokensLM(nn.Module):
    """Shared plumbing: a frozen decoder-only LM whose cache starts with ``num_tokens`` virtual tokens."""

    kind = ""

    def __init__(self, model: DecoderOnlyLM, num_tokens: int) -> None:
        super().__init__()
        if not isinstance(model, DecoderOnlyLM):
            raise TypeError(f"model must be a decoder-only LM (attnlab.models.causal_lm.DecoderOnlyLM: GPT-2, "
                            f"Llama), got {type(model).__name__}")
        positive_int("num_tokens", num_tokens)
        if model.max_positions is not None and num_tokens >= model.max_positions:
            raise ValueError(f"num_tokens={num_tokens} leaves no room in the model's {model.max_positions} positions")
        self.model, self.num_tokens = model, int(num_tokens)
        for p in model.parameters():
            p.requires_grad_(False)

    @property
    def config(self):
        return self.model.config

    def _init_ids(self, init_ids: Optional[IdsLike], seed: int) -> Tensor:
        """``init_ids`` checked, or ``num_tokens`` ids drawn uniformly from the vocabulary."""
        n, vocab = self.num_tokens, self.model.config.vocab_size
        check_seed("seed", seed)
        if init_ids is None:
            return torch.randint(vocab, (n,), generator=torch.Generator().manual_seed(seed))
        ids = torch.as_tensor(init_ids, dtype=torch.long).flatten().cpu()
        if ids.numel() != n or (ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab)):
            raise ValueError(f"init_ids must be {n} ids in [0, vocab_size={vocab}), got {ids.tolist()}")
        return ids

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def new_cache(self, *, max_length: Optional[int] = None) -> list[LayerCache]:
        """Empty caches with room for the virtual tokens; they are filled on the first forward."""
        return self.model.new_cache(max_length=None if max_length is None else max_length + self.num_tokens)

    def _fill(self, cache: list[LayerCache], batch_size: int) -> None:
        raise NotImplementedError

    def forward(self, input_ids: Tensor, *, attention_mask: Optional[Tensor] = None,
                past_key_values: Optional[list[LayerCache]] = None, use_cache: bool = False,
                output_attentions: bool = False) -> CausalLMOutput:
        """Logits ``(B, T, V)`` of the real tokens ``input_ids (B, T)`` after the virtual tokens.

        Args:
            attention_mask: ``(B, past + T)`` over the *real* tokens only (1 = token, 0 = padding);
                ``num_tokens`` ones are put in front of it.
            past_key_values: caches from :meth:`new_cache` (or a previous call); empty ones are
                filled with the virtual tokens first. Default: fresh caches.
            use_cache, output_attentions: as :meth:`DecoderOnlyLM.forward` (weights include the
                virtual-token columns).

        Raises:
            ValueError: ``input_ids`` is not ``(B, T)``, or as :meth:`DecoderOnlyLM.forward`.
        """
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be a (B, T) tensor, got {getattr(input_ids, 'shape', input_ids)!r}")
        B = input_ids.shape[0]
        if past_key_values is None:
            past_key_values = self.new_cache()
        if past_key_values[0].self_attn.length == 0:
            self._fill(past_key_values, B)
        if attention_mask is not None:
            attention_mask = torch.cat([attention_mask.new_ones(B, self.num_tokens), attention_mask], dim=1)
        return self.model(input_ids, attention_mask=attention_mask, past_key_values=past_key_values,
                          use_cache=use_cache, output_attentions=output_attentions)

    def generate(self, input_ids: Tensor, **kwargs) -> Tensor:
        """:func:`attnlab.generation.generate` with the virtual tokens in front (same arguments)."""
        from attnlab.generation import generate
        return generate(self, input_ids, **kwargs)

    def adapter_named_parameters(self):
        """The learned virtual-token parameters (not the frozen model's)."""
        for name, p in self.named_parameters():
            if not name.startswith("model."):
                yield name, p

    def adapter_config(self) -> dict:
        return {"num_tokens": self.num_tokens}


class PromptTuningLM(_VirtualTokensLM):
    """A frozen decoder-only LM reading a learned soft prompt ``P (n, E)`` before every input.

    Args:
        model: :class:`~attnlab.models.causal_lm.DecoderOnlyLM` (GPT-2, Llama); its parameters are frozen.
        num_tokens: ``n``, the number of virtual tokens.
        init_ids: ``n`` token ids; ``P`` starts as their input embeddings at positions ``0..n-1`` (so the
            wrapper first computes ``model(cat(init_ids, x))``). Default: ``n`` ids drawn uniformly from
            the vocabulary with ``seed`` (Lester et al.'s sampled-vocabulary initialisation).

    Parameters:
        prompt: ``(n, E)``.

    Raises:
        TypeError: ``model`` is not a decoder-only LM.
        ValueError: ``num_tokens`` or ``init_ids`` is invalid.
    """

    kind = "prompt"

    def __init__(self, model: DecoderOnlyLM, *, num_tokens: int, init_ids: Optional[IdsLike] = None,
                 seed: int = 0) -> None:
        super().__init__(model, num_tokens)
        ids = self._init_ids(init_ids, seed).to(self._device())
        was_training = model.training
        model.eval()  # no embedding dropout in the initial prompt
        with torch.no_grad():
            prompt = model.embed(ids[None], torch.arange(self.num_tokens, device=ids.device)[None])[0]  # (n, E)
        model.train(was_training)
        self.prompt = nn.Parameter(prompt.detach().clone())

    def _fill(self, cache: list[LayerCache], batch_size: int) -> None:
        """One causal pass of ``P`` through the layers leaves each layer's prompt keys/values in ``cache``."""
        x = self.prompt.unsqueeze(0).expand(batch_size, -1, -1)  # (B, n, E)
        for layer, c in zip(self.model.layers, cache):
            x = layer(x, is_causal=self.num_tokens > 1, cache=c)


class PrefixTuningLM(_VirtualTokensLM):
    """A frozen decoder-only LM whose every self-attention layer also attends to learned prefix keys/values.

    Args:
        model: :class:`~attnlab.models.causal_lm.DecoderOnlyLM`; its parameters are frozen.
        num_tokens: ``n``, the prefix length.
        init_ids: ``n`` token ids; the prefixes start as the keys/values the model computes for them
            (so the wrapper first computes ``model(cat(init_ids, x))``). Default: ``n`` ids drawn
            uniformly from the vocabulary with ``seed`` (Li & Liang initialise from real words' activations).

    Parameters:
        prefix_keys: ``(num_layers, Hkv, n, D)``; prefix_values: ``(num_layers, Hkv, n, Dv)``
        (keys as stored in the cache: after any rotary embedding).
    """

    kind = "prefix"

    def __init__(self, model: DecoderOnlyLM, *, num_tokens: int, init_ids: Optional[IdsLike] = None,
                 seed: int = 0) -> None:
        super().__init__(model, num_tokens)
        ids = self._init_ids(init_ids, seed).to(self._device())
        was_training = model.training
        model.eval()
        with torch.no_grad():
            cache = model(ids[None], use_cache=True).past_key_values
        model.train(was_training)
        self.prefix_keys = nn.Parameter(torch.stack([c.self_attn.k[0] for c in cache]).clone())  # (Lyr, Hkv, n, D)
        self.prefix_values = nn.Parameter(torch.stack([c.self_attn.v[0] for c in cache]).clone())

    def _fill(self, cache: list[LayerCache], batch_size: int) -> None:
        for i, c in enumerate(cache):
            k = self.prefix_keys[i].unsqueeze(0).expand(batch_size, -1, -1, -1)  # (B, Hkv, n, D)
            v = self.prefix_values[i].unsqueeze(0).expand(batch_size, -1, -1, -1)
            c.self_attn.update(k, v)


PROMPT_KINDS = {cls.kind: cls for cls in (PromptTuningLM, PrefixTuningLM)}
