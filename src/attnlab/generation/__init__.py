"""Autoregressive decoding on the KV cache: greedy, sampling (temperature, top-k, top-p), beam search (the loops
and their formulas: ``search.py``). Each step feeds only the newest token; the per-layer caches hold the keys and
values of the prefix.

The settings of a call form one :class:`GenerationConfig` (checked once, when built); ``generate`` takes
them as keywords, as ``config=``, or both (keywords win), and the loops read that one record.

The decoder protocol (what the decoding loops need) is small, so any decoder can adopt it:

- ``model(input_ids (B, T), attention_mask=None | (B, past + T), past_key_values=cache,
  use_cache=True)`` returns an object with ``.logits (B, T, V)``, updating ``cache`` in place (a model whose
  ``accepts_logits_to_keep`` is true is also given ``logits_to_keep=1`` and may return the last position only);
- ``model.new_cache(max_length=None)`` returns the empty cache: a list of
  :class:`attnlab.nn.block.LayerCache` (or of :class:`attnlab.modules.cache.KVCache`), or an
  :class:`EncoderDecoderCache`; beams are reordered by :func:`reorder_cache`.

An encoder–decoder (``is_encoder_decoder = True``: T5, BART, ``Seq2SeqTransformer``) provides instead

- ``encode(input_ids (B, S), attention_mask (B, S) | None) -> memory (B, S, E)``;
- ``decode(ids (B, T), memory, *, attention_mask=source mask, cache=list[LayerCache]) -> logits (B, T, V)``;
- ``new_cache(*, max_length=None)`` and ``generation_defaults`` (``decoder_start_token_id``,
  ``eos_token_id``, ``pad_token_id``, each may be None).

:class:`EncoderDecoderAsDecoder` presents it through the decoder protocol: the source is encoded once,
and the decoding state (:class:`EncoderDecoderCache`) carries the encoder output and the source mask
beside the self- and cross-attention caches, so all of them expand to the beams and reorder with them.
The one greedy/sampling loop and the one beam search serve both kinds of model.

Files: this one holds the settings (:class:`GenerationConfig`) and the entry :func:`generate` with its input
checks; ``search.py`` the two decoding loops and the sampling filter; ``state.py`` the decoding state (beam
reordering of every cache kind, the encoder–decoder adapter).
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, replace
from typing import Callable, Optional

import math

import torch
from torch import Tensor

from attnlab._checks import (boolean, int_at_least, is_int, is_real, non_negative_int, one_of, positive_int,
                             positive_number, real)
from attnlab._limits import SETTING_LIMITS
from attnlab.generation.state import CroppedContext, EncoderDecoderAsDecoder, EncoderDecoderCache, reorder_cache
from attnlab.generation.search import beam_search, decode, filter_logits
from attnlab.nn.inference import decode_view

__all__ = ["GenerationConfig", "generate", "filter_logits", "reorder_cache", "EncoderDecoderCache",
           "EncoderDecoderAsDecoder", "CACHES"]

CACHES = ("dynamic", "static", "window", "crop")
MAX_BEAMS = SETTING_LIMITS[("num_beams",)]
MAX_NEW_TOKENS = SETTING_LIMITS[("block_size", "max_len", "max_tokens", "window")]


@dataclass(frozen=True, kw_only=True)
class GenerationConfig:
    """The settings of one :func:`generate` call, checked once when built (Hugging Face's name and fields).

    Each field is :func:`generate`'s keyword of the same name, with the same default and meaning;
    ``generate(model, ids, config=c, top_k=5)`` decodes with ``c`` but ``top_k=5``. An encoder–decoder's
    token ids left None are filled by :meth:`for_model` from its ``generation_defaults``.

    Raises:
        ValueError: a field is out of range, or ``do_sample=True`` with ``num_beams > 1`` (the message
            names the field).
        TypeError: ``do_sample`` is not a bool, or ``length_penalty`` not a real number.
    """

    max_new_tokens: int
    do_sample: bool = False
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    num_beams: int = 1
    length_penalty: float = 1.0
    eos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None
    decoder_start_token_id: Optional[int] = None
    cache: str = "dynamic"

    def __post_init__(self) -> None:
        """Check every field (each message names it); ``dataclasses.replace`` checks the new record again."""
        positive_int("max_new_tokens", self.max_new_tokens)
        if self.max_new_tokens > MAX_NEW_TOKENS:  # an encoder–decoder has no position limit to stop it
            raise ValueError(f"max_new_tokens must be an int in [1, {MAX_NEW_TOKENS:,}], got {self.max_new_tokens!r}")
        positive_number("temperature", self.temperature, finite=True)
        positive_int("top_k", self.top_k, optional=True)
        if self.top_p is not None and not (is_real(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        int_at_least("num_beams", self.num_beams, 1)
        if self.num_beams > MAX_BEAMS:
            raise ValueError(f"num_beams must be an int in [1, {MAX_BEAMS}], got {self.num_beams!r}")
        boolean("do_sample", self.do_sample)
        if self.do_sample and self.num_beams > 1:
            raise ValueError(f"num_beams must be 1 with do_sample=True (beam sampling is not supported), "
                             f"got {self.num_beams}")
        real("length_penalty", self.length_penalty)
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        for name in ("eos_token_id", "pad_token_id", "decoder_start_token_id"):
            non_negative_int(name, getattr(self, name), optional=True)
        one_of("cache", self.cache, CACHES)

    def for_model(self, model) -> GenerationConfig:
        """The finished settings for ``model``: an encoder–decoder's ``generation_defaults`` fill the token ids
        left None; then ``pad_token_id`` defaults to ``eos_token_id`` (for every model).

        Raises:
            ValueError: an encoder–decoder has no start token (none given, no default), or a decoder-only
                model was given ``decoder_start_token_id``.
        """
        eos, pad, start = self.eos_token_id, self.pad_token_id, self.decoder_start_token_id
        if getattr(model, "is_encoder_decoder", False):
            defaults = model.generation_defaults
            eos = defaults["eos_token_id"] if eos is None else eos
            pad = defaults["pad_token_id"] if pad is None else pad
            start = defaults["decoder_start_token_id"] if start is None else start
            if start is None:
                raise ValueError(f"decoder_start_token_id is required: {type(model).__name__} has no default")
        elif start is not None:
            raise ValueError("decoder_start_token_id is only for encoder–decoder models, "
                             f"got {start} for {type(model).__name__}")
        return replace(self, eos_token_id=eos, pad_token_id=eos if pad is None else pad, decoder_start_token_id=start)


class _Unset:
    """The default of each :func:`generate` setting: "not given: the config's value". It prints as
    :class:`GenerationConfig`'s default, so ``help(generate)`` shows the defaults, kept in one place."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        default = GenerationConfig.__dataclass_fields__[self.name].default
        return "<required>" if default is MISSING else repr(default)


def generate(model, input_ids: Tensor, *, attention_mask: Optional[Tensor] = None,
             max_new_tokens: int = _Unset("max_new_tokens"), do_sample: bool = _Unset("do_sample"),
             temperature: float = _Unset("temperature"), top_k: Optional[int] = _Unset("top_k"),
             top_p: Optional[float] = _Unset("top_p"), num_beams: int = _Unset("num_beams"),
             length_penalty: float = _Unset("length_penalty"), eos_token_id: Optional[int] = _Unset("eos_token_id"),
             pad_token_id: Optional[int] = _Unset("pad_token_id"),
             decoder_start_token_id: Optional[int] = _Unset("decoder_start_token_id"),
             generator: Optional[torch.Generator] = None, cache: str = _Unset("cache"),
             config: Optional[GenerationConfig] = None, streamer: Optional[Callable[[Tensor], None]] = None) -> Tensor:
    """Continue ``input_ids (B, T)`` by up to ``max_new_tokens`` tokens (call ``model.eval()`` first).

    A decoder in eval mode decodes on attnlab's kernels without an ``optimize_for_inference`` call: its float32
    linear layers are read in place by the matrix–vector kernel (:func:`attnlab.nn.inference.decode_view`: no
    weight copied, kept per model and rebuilt when a weight, a mode or a hook changes), the same tokens up to
    float32 summation order.

    The settings (``max_new_tokens`` ... ``cache``, all but ``generator``) are :class:`GenerationConfig`'s
    fields, with its defaults: give them as keywords, or as ``config``, or both (a keyword given overrides
    the config's field, as ``transformers``' ``generate(**kwargs)``). ``max_new_tokens`` is required
    unless ``config`` gives it.

    Args:
        model: a decoder or an encoder–decoder following the protocols in this module's docstring
            (e.g. ``GPT2LMHeadModel``, ``T5ForConditionalGeneration``).
        input_ids: the prompt; for an encoder–decoder the source ``(B, S)``.
        attention_mask: ``(B, T)``, 1 = token, 0 = padding; prompts of different lengths are
            **left**-padded. For an encoder–decoder, the source mask (any padding side); when omitted
            it is inferred as ``input_ids != pad_token_id`` if the source holds that token and it
            differs from ``eos_token_id`` (as ``transformers`` does).
        max_new_tokens: the most tokens to add.
        do_sample: sample instead of taking the argmax (``num_beams`` must be 1).
        temperature, top_k, top_p: sampling filters, applied in this order (as ``transformers``).
        num_beams: beam search when > 1; ``length_penalty`` is its exponent α.
        eos_token_id: a sequence ends at this token; later positions are filled with
            ``pad_token_id`` (default ``eos_token_id``). Generation stops when every sequence ended.
            For an encoder–decoder, None means its ``generation_defaults`` (as for ``pad_token_id``).
        decoder_start_token_id: encoder–decoders only: the first decoder token (default: the model's).
        generator: a seeded ``torch.Generator`` makes sampling reproducible.
        cache: ``"dynamic"`` (grows by concatenation) or ``"static"`` (preallocated to
            ``T + max_new_tokens`` positions; for an encoder–decoder ``1 + max_new_tokens``) or ``"window"``
            (a decoder-only model whose self-attention has a sliding window ``w``, e.g. under
            :func:`attnlab.adapt.deploy.sliding_window`: a ring buffer of the ``w`` newest keys and values per
            layer, O(w) memory however many tokens; the same tokens as the growing cache) or ``"crop"`` (a
            decoder-only model with a position limit, decoding past it as nanoGPT's ``sample.py``: each next token
            is predicted from the last ``max_positions`` tokens — the growing cache while they fit, then the
            cropped context recomputed each step; greedy or sampling, unpadded prompts).
        config: a :class:`GenerationConfig` holding the settings (None: the keywords and defaults alone).
        streamer: called with each step's new tokens ``(B,)`` as soon as they are chosen (greedy and sampling;
            a finished sequence gets ``pad_token_id``), e.g. to print text as it comes.

    Returns:
        ``(B, T + n)`` ids: the prompt, then the ``n <= max_new_tokens`` new tokens (as ``transformers``);
        for an encoder–decoder ``(B, 1 + n)``: ``decoder_start_token_id`` then the new tokens.

    Raises:
        ValueError: an argument is out of range, or an encoder–decoder has no start token (the message
            names the argument).
        TypeError: ``config`` is not a GenerationConfig, ``max_new_tokens`` is given by neither the keyword
            nor ``config``, or a setting has the wrong type (see :class:`GenerationConfig`).
    """
    _check_inputs(input_ids, attention_mask)
    if streamer is not None and not callable(streamer):
        raise TypeError(f"streamer must be callable, got {type(streamer).__name__}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    config = _settings(config, dict(
        max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
        num_beams=num_beams, length_penalty=length_penalty, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        decoder_start_token_id=decoder_start_token_id, cache=cache))
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    for name in ("eos_token_id", "pad_token_id", "decoder_start_token_id"):  # the ids given here (not the defaults)
        if is_int(vocab) and getattr(config, name) is not None and getattr(config, name) >= vocab:
            raise ValueError(f"{name} must be a token id in [0, {vocab}) (the model's vocab_size), "
                             f"got {getattr(config, name)}")
    encoder_decoder = bool(getattr(model, "is_encoder_decoder", False))
    if not (hasattr(model, "generation_defaults") if encoder_decoder else hasattr(model, "new_cache")):
        raise ValueError(f"{type(model).__name__} cannot generate: it has no language-model head with a KV cache "
                         "(use e.g. GPT2LMHeadModel, LlamaForCausalLM, T5ForConditionalGeneration, "
                         "BartForConditionalGeneration or Seq2SeqTransformer)")
    if config.cache != "crop" and not encoder_decoder:  # the prompt's own limits first: they name the prompt
        _check_decoder_prompt(model, input_ids, attention_mask, config.max_new_tokens)
    plain = model
    if not encoder_decoder:  # a decoder's float32 linear layers on attnlab's kernels, its weights read in place
        model = decode_view(model)
    if config.cache == "crop":
        model = _cropped(model, attention_mask, config)
    _check_memory(plain, input_ids, config)  # the caches of every row and beam, before the encoder runs
    config = config.for_model(model)
    pad = config.pad_token_id
    if (encoder_decoder and attention_mask is None and pad is not None and pad != config.eos_token_id
            and bool((input_ids == pad).any())):
        attention_mask = (input_ids != pad).long()
    with torch.inference_mode():
        if encoder_decoder:
            model = EncoderDecoderAsDecoder(model, input_ids, attention_mask)
            input_ids = input_ids.new_full((input_ids.shape[0], 1), config.decoder_start_token_id)
            attention_mask = None
        past = _new_cache(model, input_ids.shape[1] + config.max_new_tokens, config.cache)
        if config.num_beams > 1:
            if streamer is not None:
                raise ValueError("streamer is for greedy decoding and sampling: beam search knows its tokens only "
                                 "at the end (num_beams must be 1)")
            return beam_search(model, input_ids, attention_mask, past, config)
        return decode(model, input_ids, attention_mask, past, config, generator, streamer)


def generation_bytes(model, input_ids: Tensor, *, max_new_tokens: int, num_beams: int = 1,
                     cache: str = "dynamic") -> int:
    """The memory a :func:`generate` call of ``model`` on ``input_ids (B, T)`` holds when it has made every token,
    to compare with free memory before anything is allocated. With ``R = B · num_beams`` rows, ``L`` the positions
    each self-attention cache holds (prompt and new tokens; an encoder–decoder's ``1 + max_new_tokens``; with
    ``cache="crop"`` at most ``max_positions``, with ``"window"`` the ring buffer's ``2·w``), ``S`` the source's
    ``T`` tokens (encoder–decoders), ``v`` the bytes of one of the weights' values and ``V`` the vocabulary::

        v · R · (L · Σ_self 2·Hkv·D + S · Σ_cross 2·Hkv·D + S · E)   keys and values cached, the encoder's output
        + forward_bytes(B rows of S, or of the prompt)               the encoder's (or the prompt's) activations
        + 8 · R · (L + 1) · (7 with beams, else 1)                   token ids (beam search keeps 2·beams candidates
                                                                     and the finished hypotheses beside the beams)
        + 4 · 3 · R · V                                              one step's logits and log-probabilities

    the sums over the decoder layers' self- and cross-attention (``Hkv`` key/value heads of ``D`` values). Memory
    freed before the cache is full (the encoder's activations) is counted too, so this is a bound a little above
    the peak; a model outside the layer classes here counts no cache."""
    from torch import nn

    from attnlab._limits import forward_bytes
    from attnlab.nn.block import DecoderLayer

    batch, tokens = input_ids.shape
    rows = batch * num_beams
    encoder_decoder = bool(getattr(model, "is_encoder_decoder", False))
    modules = list(model.modules()) if isinstance(model, nn.Module) else []
    layers = [m for m in modules if isinstance(m, DecoderLayer)]
    self_kv = sum(2 * m.self_attn.num_kv_heads * m.self_attn.head_dim for m in layers)
    cross_kv = sum(2 * m.cross_attn.num_kv_heads * m.cross_attn.head_dim for m in layers if m.cross_attn is not None)
    width = layers[0].self_attn.embed_dim if layers else 0
    value = next((p.element_size() for p in model.parameters() if p.is_floating_point()), 4) if modules else 4
    source = tokens if encoder_decoder else 0
    length = (1 if encoder_decoder else tokens) + max_new_tokens
    block, window = getattr(model, "max_positions", None), getattr(model, "attention_window", None)
    prefill = tokens
    if cache == "crop" and isinstance(block, int):
        length = prefill = min(length, block)  # past the block each step runs the last block tokens afresh
    elif cache == "window" and is_int(window):
        length = min(length, 2 * window)
    config = getattr(model, "config", None)
    vocab = next((getattr(config, n) for n in ("vocab_size", "tgt_vocab_size") if is_int(getattr(config, n, None))), 0)
    caches = value * rows * (length * self_kv + source * (cross_kv + (width if encoder_decoder else 0)))
    activations = forward_bytes(config, batch=batch, seq=prefill, bytes_per_value=value) if config else None
    ids = 8 * rows * (length + 1) * (7 if num_beams > 1 else 1)
    return int(caches + (activations or 0) + ids + 4 * 3 * rows * vocab)


def _check_memory(model, input_ids: Tensor, config: GenerationConfig) -> None:
    """Refuse a call whose :func:`generation_bytes` exceed the free memory of ``input_ids``' device, naming
    ``max_new_tokens``, ``num_beams`` and the batch, before the encoder runs or a cache is made."""
    from attnlab._limits import check_memory

    batch, tokens = input_ids.shape
    side = "source" if getattr(model, "is_encoder_decoder", False) else "prompt"
    check_memory(f"max_new_tokens={config.max_new_tokens} with num_beams={config.num_beams} and a batch of {batch} "
                 f"({tokens}-token {side}s)",
                 generation_bytes(model, input_ids, max_new_tokens=config.max_new_tokens, num_beams=config.num_beams,
                                  cache=config.cache), device=input_ids.device)


def _cropped(model, attention_mask: Optional[Tensor], config: GenerationConfig) -> CroppedContext:
    """``model`` decoding with ``cache="crop"`` (see :func:`generate`), after checking it can."""
    block = getattr(model, "max_positions", None)
    if getattr(model, "is_encoder_decoder", False) or not isinstance(block, int):
        raise ValueError(f"cache='crop' is for a decoder-only model with a position limit (max_positions), "
                         f"got {type(model).__name__}")
    if config.num_beams > 1:
        raise ValueError(f"cache='crop' decodes greedily or by sampling: num_beams must be 1, got {config.num_beams}")
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError("cache='crop' takes unpadded prompts: decode padded prompts one at a time")
    return CroppedContext(model, block)


def _new_cache(model, total: int, kind: str):
    """The empty cache of ``kind``: growing, preallocated to ``total`` positions, or a ring buffer of the model's
    sliding window (O(window) memory for any length)."""
    if kind == "static":
        return model.new_cache(max_length=total)
    if kind == "window":
        window = getattr(model, "attention_window", None)
        if window is None:
            raise ValueError(f"cache='window' needs a decoder-only model whose every self-attention has a sliding "
                             f"window ({type(model).__name__} has none): attnlab.adapt.deploy.sliding_window(model, w)")
        return model.new_cache(window=window)
    return model.new_cache()


def _settings(config: Optional[GenerationConfig], keywords: dict) -> GenerationConfig:
    """``config`` (or the defaults) with the keywords :func:`generate` was given in place of its fields."""
    given = {name: value for name, value in keywords.items() if not isinstance(value, _Unset)}
    if config is None:
        if "max_new_tokens" not in given:
            raise TypeError("generate() missing 1 required keyword-only argument: 'max_new_tokens' "
                            "(or config=GenerationConfig(max_new_tokens=...))")
        return GenerationConfig(**given)
    if not isinstance(config, GenerationConfig):
        raise TypeError(f"config must be a GenerationConfig or None, got {type(config).__name__}")
    return replace(config, **given) if given else config


def _check_decoder_prompt(model, input_ids: Tensor, attention_mask: Optional[Tensor], max_new_tokens: int) -> None:
    """A decoder continues each row from its last position, so prompts must be left-padded; and the prompt plus
    ``max_new_tokens`` must fit the model's position table (refused before any token is generated)."""
    if attention_mask is not None:
        m = attention_mask.bool()
        if bool((~m.any(1)).any()):
            raise ValueError("attention_mask has a row with no token: every prompt needs at least one")
        if not bool(m[:, -1].all()):  # padding at the end: the row would continue from a pad token
            row = int((~m[:, -1]).nonzero()[0])
            raise ValueError(f"attention_mask row {row} ends with padding (right padding): generation "
                             "continues each row from its last position, so left-pad the prompts (padding first, "
                             "as tokenizers do with padding_side='left')")
    limit = getattr(model, "max_positions", None)
    if isinstance(limit, int) and input_ids.shape[1] + max_new_tokens > limit:
        field = getattr(model, "positions_field", "max_positions")
        if input_ids.shape[1] >= limit:  # no room for even one token: the prompt is what is too long
            raise ValueError(f"the prompt has {input_ids.shape[1]} tokens, but the model's context ({field}) holds "
                             f"{limit}: shorten the prompt to at most {limit - 1} tokens")
        raise ValueError(f"max_new_tokens={max_new_tokens} with a {input_ids.shape[1]}-token prompt exceeds the "
                         f"model's {field}={limit}: at most {limit - input_ids.shape[1]} new tokens")


def _check_inputs(input_ids, attention_mask) -> None:
    """``input_ids`` is a non-empty ``(B, T)`` LongTensor; ``attention_mask`` (if any) has its shape."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError("input_ids must be a (B, T) LongTensor, got "
                         f"{tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be non-empty, got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        return
    if not isinstance(attention_mask, Tensor) or attention_mask.shape != input_ids.shape:
        got = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must be a tensor of input_ids' shape {tuple(input_ids.shape)}, got {got}")
