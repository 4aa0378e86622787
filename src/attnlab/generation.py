"""Autoregressive decoding on the KV cache: greedy, sampling (temperature, top-k, top-p), beam search.

Each step feeds only the newest token; the per-layer caches hold the keys and values of the prefix::

    greedy:  y_t = argmax_v p(v | y_<t)
    sample:  y_t ~ softmax(z_t / T), restricted to the top-k logits and then to the smallest set
             of tokens whose probability mass reaches top_p (nucleus, Holtzman et al. 2020)
    beam:    keep the num_beams prefixes of highest Σ log p; a finished hypothesis scores
             Σ log p / len^α (α = length_penalty = 1), len = number of generated tokens

The settings of a call form one :class:`GenerationConfig` (checked once, when built); ``generate`` takes
them as keywords, as ``config=``, or both (keywords win), and the loops read that one record.

The beam search follows Hugging Face ``transformers`` step for step (2·num_beams candidates per
step, ``early_stopping=False`` heuristic), so on the same weights it returns the same tokens.

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
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, replace
from types import SimpleNamespace
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab._checks import (boolean, int_at_least, is_real, non_negative_int, one_of, positive_int,
                             positive_number, real)
from attnlab.nn.block import LayerCache
from attnlab.modules.cache import KVCache

CACHES = ("dynamic", "static", "window")


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
        positive_number("temperature", self.temperature)
        positive_int("top_k", self.top_k, optional=True)
        if self.top_p is not None and not (is_real(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        int_at_least("num_beams", self.num_beams, 1)
        boolean("do_sample", self.do_sample)
        if self.do_sample and self.num_beams > 1:
            raise ValueError(f"num_beams must be 1 with do_sample=True (beam sampling is not supported), "
                             f"got {self.num_beams}")
        real("length_penalty", self.length_penalty)
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
            layer, O(w) memory however many tokens; the same tokens as the growing cache).
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
    config = _settings(config, dict(
        max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
        num_beams=num_beams, length_penalty=length_penalty, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        decoder_start_token_id=decoder_start_token_id, cache=cache))
    encoder_decoder = bool(getattr(model, "is_encoder_decoder", False))
    if not (hasattr(model, "generation_defaults") if encoder_decoder else hasattr(model, "new_cache")):
        raise ValueError(f"{type(model).__name__} cannot generate: it has no language-model head with a KV cache "
                         "(use e.g. GPT2LMHeadModel, LlamaForCausalLM, T5ForConditionalGeneration, "
                         "BartForConditionalGeneration or Seq2SeqTransformer)")
    if not encoder_decoder:
        _check_decoder_prompt(model, input_ids, attention_mask, config.max_new_tokens)
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
            return _beam_search(model, input_ids, attention_mask, past, config)
        return _decode(model, input_ids, attention_mask, past, config, generator, streamer)


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


def _next_logits(model, ids: Tensor, mask: Optional[Tensor], past) -> Tensor:
    """The logits ``(B, V)`` of the position after ``ids``, continuing the cached prefix ``past`` (updated)."""
    keep = {"logits_to_keep": 1} if getattr(model, "accepts_logits_to_keep", False) else {}
    return model(ids, attention_mask=mask, past_key_values=past, use_cache=True, **keep).logits[:, -1]


def _decode(model, input_ids, mask, past, config: GenerationConfig, generator, streamer=None) -> Tensor:
    """Greedy or sampled decoding, one token per step."""
    B, T0 = input_ids.shape
    max_new_tokens, eos, pad = config.max_new_tokens, config.eos_token_id, config.pad_token_id
    out = input_ids.new_full((B, T0 + max_new_tokens), 0 if pad is None else pad)
    out[:, :T0] = input_ids
    unfinished = torch.ones(B, dtype=torch.bool, device=input_ids.device)
    logits = _next_logits(model, input_ids, mask, past)
    for t in range(T0, T0 + max_new_tokens):
        logits = logits.float()  # (B, V)
        if config.do_sample:
            probs = F.softmax(filter_logits(logits, temperature=config.temperature, top_k=config.top_k,
                                            top_p=config.top_p), dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            nxt = logits.argmax(dim=-1)
        if eos is not None:
            nxt = torch.where(unfinished, nxt, pad)
            unfinished &= nxt != eos
        out[:, t] = nxt
        if streamer is not None:
            streamer(nxt)
        if t + 1 == T0 + max_new_tokens or (eos is not None and not bool(unfinished.any())):
            return out[:, :t + 1]
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1)
        logits = _next_logits(model, out[:, t:t + 1], mask, past)
    return out


def filter_logits(logits: Tensor, *, temperature: float = 1.0, top_k: Optional[int] = None,
                  top_p: Optional[float] = None) -> Tensor:
    """``z / T``, then -inf outside the ``top_k`` largest, then outside the nucleus of mass ``top_p``.

    The nucleus keeps the most probable tokens whose cumulative probability reaches ``top_p``
    (always at least one), as ``transformers``' ``TopPLogitsWarper``.
    """
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1)  # ascending
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - top_p
        drop[..., -1] = False  # keep the most probable token
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def _beam_search(model, input_ids, mask, past, config: GenerationConfig) -> Tensor:
    """Beam search with ``transformers``' vectorised bookkeeping (finished hypotheses kept per item)."""
    B, T0 = input_ids.shape
    max_new_tokens, nb, length_penalty = config.max_new_tokens, config.num_beams, config.length_penalty
    eos, pad = config.eos_token_id, config.pad_token_id
    dev = input_ids.device
    max_len = T0 + max_new_tokens
    K = 2 * nb  # candidates kept per step: max(2, 1 + #eos) · num_beams, as transformers
    is_top = torch.arange(K, device=dev) < nb  # only the top num_beams candidates may finish
    batch_offset = torch.arange(B, device=dev).unsqueeze(1) * nb  # (B, 1)

    running = input_ids.new_full((B, nb, max_len), pad if pad is not None else 0)
    running[:, :, :T0] = input_ids.unsqueeze(1)
    running_scores = torch.zeros(B, nb, device=dev)
    running_scores[:, 1:] = -1e9  # the beams start identical: expand only the first
    done = running.clone()  # finished hypotheses
    done_scores = torch.full((B, nb), -1e9, device=dev)
    done_lens = torch.zeros(B, nb, dtype=torch.long, device=dev)
    done_flag = torch.zeros(B, nb, dtype=torch.bool, device=dev)
    improvable = torch.ones(B, 1, dtype=torch.bool, device=dev)

    # prefill the B prompts once, then copy each row's cache to its beams
    logits = _next_logits(model, input_ids, mask, past)
    expand = torch.arange(B, device=dev).repeat_interleave(nb)
    reorder_cache(past, expand)
    logits = logits.index_select(0, expand)
    if mask is not None:
        mask = mask.index_select(0, expand)
    cur = T0
    while True:
        V = logits.shape[-1]
        logp = F.log_softmax(logits.float(), dim=-1).view(B, nb, V) + running_scores.unsqueeze(-1)
        top_logp, top_idx = torch.topk(logp.view(B, nb * V), K)  # (B, K)
        src, tok = top_idx // V, top_idx % V
        cand = torch.take_along_dim(running, src.unsqueeze(-1), dim=1)  # (B, K, max_len)
        cand[:, :, cur] = tok
        ends = torch.full_like(tok, cur + 1 >= max_len, dtype=torch.bool)
        if eos is not None:
            ends |= tok == eos
        # the best num_beams unfinished candidates run on
        run_logp = top_logp + ends.float() * -1e9
        keep = torch.topk(run_logp, nb)[1]  # (B, nb)
        running = torch.take_along_dim(cand, keep.unsqueeze(-1), dim=1)
        running_scores = torch.take_along_dim(run_logp, keep, dim=1)
        parent = torch.take_along_dim(src, keep, dim=1)
        # finished candidates among the top num_beams compete with the kept hypotheses
        fin = ends & is_top
        fin_scores = top_logp / ((cur + 1 - T0) ** length_penalty)
        fin_scores = fin_scores + (~improvable).float() * -1e9
        fin_scores = fin_scores + (~fin) * -1e9
        merged = torch.topk(torch.cat([done_scores, fin_scores], dim=1), nb)[1]
        done = torch.take_along_dim(torch.cat([done, cand], dim=1), merged.unsqueeze(-1), dim=1)
        done_scores = torch.take_along_dim(torch.cat([done_scores, fin_scores], dim=1), merged, dim=1)
        done_lens = torch.take_along_dim(torch.cat([done_lens, torch.full_like(tok, cur + 1 - T0)], dim=1),
                                         merged, dim=1)
        done_flag = torch.take_along_dim(torch.cat([done_flag, fin], dim=1), merged, dim=1)
        cur += 1
        # early_stopping=False heuristic: can the best running beam still beat the worst finished one?
        best_running = running_scores[:, :1] / ((cur - T0) ** length_penalty)
        worst_done = torch.where(done_flag, done_scores.min(dim=1, keepdim=True).values, -1e9)
        improvable = improvable & (best_running > worst_done).any(dim=-1, keepdim=True)
        if not bool(improvable.any()) or bool(ends.all()):
            break
        reorder_cache(past, (parent + batch_offset).flatten())
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(B * nb, 1)], dim=1)
        step_ids = running[:, :, cur - 1].reshape(B * nb, 1)
        logits = _next_logits(model, step_ids, mask, past)
    return done[:, 0, :T0 + int(done_lens[:, 0].max())]


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
        raise ValueError(f"max_new_tokens={max_new_tokens} with a {input_ids.shape[1]}-token prompt exceeds the "
                         f"model's {field}={limit}: at most {limit - input_ids.shape[1]} new tokens")


def _check_inputs(input_ids, attention_mask) -> None:
    """``input_ids`` is a non-empty ``(B, T)`` LongTensor; ``attention_mask`` (if any) has its shape."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError("input_ids must be a (B, T) LongTensor, got "
                         f"{tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be non-empty, got shape {tuple(input_ids.shape)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}, "
                         f"got {tuple(attention_mask.shape)}")
