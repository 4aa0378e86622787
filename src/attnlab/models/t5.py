"""T5 (Raffel et al. 2020): an encoder–decoder with a learned, bucketed relative position bias.

::

    h⁰ = E[x]                                                     (then dropout; no absolute positions)
    hˡ = hˡ⁻¹ + SelfAttn(RMSNorm(hˡ⁻¹));  decoder: hˡ += CrossAttn(RMSNorm(hˡ), enc)
    hˡ = hˡ + FFN(RMSNorm(hˡ))                                    (pre-norm, no biases anywhere)
    Attn(Q, K, V) = softmax(Q Kᵀ + B) V                           (no 1/sqrt(d) scaling: folded into W_Q)
    B[h, i, j] = W_rel[bucket(j - i), h]                          (bidirectional in the encoder, causal in the
                                                                   decoder; computed once per stack, shared by
                                                                   all its layers; none in cross-attention)
    FFN(x) = W_o relu(W_i x)   or   W_o (gelu_tanh(W_i0 x) ⊙ W_i1 x)        ("relu" / "gated-gelu", T5 v1.1)
    logits = RMSNorm(h_dec) · d^-0.5 · Eᵀ   (tied)   or   RMSNorm(h_dec) W_lmᵀ   (untied, T5 v1.1 / Flan-T5)

Attention runs through :func:`attnlab.attention` with ``scale=1.0`` and the bias as an additive float
mask. HF names (``encoder.block.{i}.layer.0.SelfAttention.q`` …) appear only in
:meth:`T5ForConditionalGeneration.to_hf_state_dict` / :meth:`~T5ForConditionalGeneration.from_hf_state_dict`.
"""
from __future__ import annotations

import dataclasses
import numbers
import re
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.functional.attention import attention
from attnlab.models.hub import PreTrainedMixin, register
from attnlab.nn.block import LayerCache
from attnlab.nn.cache import KVCache
from attnlab.nn.feedforward import ACTIVATIONS
from attnlab.nn.norms import RMSNorm
from attnlab.nn.positional import T5RelativeBias

FEED_FORWARD_PROJ = ("relu", "gated-gelu")


@dataclass
class T5Config:
    """T5 hyper-parameters with HF ``T5Config``'s names and defaults (t5-small).

    ``tie_word_embeddings=True`` is original T5 (LM head = shared embedding, decoder output scaled by
    ``d_model^-0.5``); ``False`` is T5 v1.1 / Flan-T5 (its own ``lm_head``, no scaling).
    ``num_decoder_layers`` defaults to ``num_layers``.
    """

    vocab_size: int = 32128
    d_model: int = 512
    d_kv: int = 64
    d_ff: int = 2048
    num_layers: int = 6
    num_decoder_layers: Optional[int] = None
    num_heads: int = 8
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    dropout_rate: float = 0.1
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "relu"
    tie_word_embeddings: bool = True
    pad_token_id: int = 0
    eos_token_id: int = 1
    decoder_start_token_id: int = 0

    def __post_init__(self) -> None:
        if self.num_decoder_layers is None:
            self.num_decoder_layers = self.num_layers
        for f in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers", "num_heads"):
            _check_int(f, getattr(self, f), minimum=1)
        _check_int("relative_attention_num_buckets", self.relative_attention_num_buckets, minimum=4)
        # the causal decoder's exact range is num_buckets // 2 (the encoder's is half that)
        _check_int("relative_attention_max_distance", self.relative_attention_max_distance,
                   minimum=self.relative_attention_num_buckets // 2 + 1)
        for f in ("pad_token_id", "eos_token_id", "decoder_start_token_id"):
            _check_int(f, getattr(self, f), minimum=0)
        if (isinstance(self.dropout_rate, bool) or not isinstance(self.dropout_rate, numbers.Real)
                or not 0.0 <= self.dropout_rate < 1.0):
            raise ValueError(f"dropout_rate must be a float in [0, 1), got {self.dropout_rate!r}")
        if (isinstance(self.layer_norm_epsilon, bool) or not isinstance(self.layer_norm_epsilon, numbers.Real)
                or not self.layer_norm_epsilon > 0):
            raise ValueError(f"layer_norm_epsilon must be a positive float, got {self.layer_norm_epsilon!r}")
        if self.feed_forward_proj not in FEED_FORWARD_PROJ:
            raise ValueError(f"feed_forward_proj must be one of {list(FEED_FORWARD_PROJ)}, got {self.feed_forward_proj!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}")

    @classmethod
    def from_hf(cls, d: dict) -> "T5Config":
        """From an HF ``config.json`` dict (unknown keys ignored).

        transformers 5 always writes ``tie_word_embeddings: true`` and records T5 v1.1's untied,
        unscaled head as ``scale_decoder_outputs: false``; both spellings are read.
        """
        tie, scale = d.get("tie_word_embeddings", True), d.get("scale_decoder_outputs")
        if scale is not None and not tie and scale:
            raise ValueError("scale_decoder_outputs=True with tie_word_embeddings=False is not supported")
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names and v is not None}
        kw["tie_word_embeddings"] = bool(tie) and scale is not False
        if isinstance(kw.get("eos_token_id"), list) and len(kw["eos_token_id"]) == 1:  # HF allows a list
            kw["eos_token_id"] = kw["eos_token_id"][0]
        return cls(**kw)

    def to_hf(self) -> dict:
        """An HF ``config.json`` dict that ``transformers.T5Config`` reads back to the same model."""
        return {**dataclasses.asdict(self), "model_type": "t5", "is_encoder_decoder": True,
                "scale_decoder_outputs": self.tie_word_embeddings}


def _check_int(name: str, v, *, minimum: int) -> None:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")


@dataclass
class Seq2SeqLMOutput:
    """``logits (B, T, V)``, ``encoder_last_hidden_state (B, S, E)``; ``loss`` with ``labels``;
    ``past_key_values`` (one :class:`LayerCache` per decoder layer) with ``use_cache``."""

    logits: Tensor
    encoder_last_hidden_state: Tensor
    loss: Optional[Tensor] = None
    past_key_values: Optional[list[LayerCache]] = None


class T5Attention(nn.Module):
    """``softmax(Q Kᵀ + mask) V`` over ``H`` heads of width ``d_kv`` (inner dim ``H·d_kv``, may differ
    from ``d_model``); projections ``q, k, v, o`` without bias; unscaled scores."""

    def __init__(self, d_model: int, num_heads: int, d_kv: int, *, dropout: float = 0.0) -> None:
        super().__init__()
        self.num_heads, self.d_kv, self.dropout = num_heads, d_kv, dropout
        inner = num_heads * d_kv
        self.q = nn.Linear(d_model, inner, bias=False)
        self.k = nn.Linear(d_model, inner, bias=False)
        self.v = nn.Linear(d_model, inner, bias=False)
        self.o = nn.Linear(inner, d_model, bias=False)

    def forward(self, x: Tensor, memory: Optional[Tensor] = None, *, mask: Optional[Tensor] = None,
                causal: bool = False, cache: Optional[KVCache] = None) -> Tensor:
        """``x (B, L, E)`` attends to itself or to ``memory (B, S, E)``; ``cache`` holds past keys/values."""
        B, L, _ = x.shape
        H, D = self.num_heads, self.d_kv
        q = self.q(x).view(B, L, H, D).transpose(1, 2)  # (B, H, L, D)
        if cache is not None and cache.static and cache.filled:
            k, v = cache.k, cache.v  # cross-attention: the memory was projected at the first step
        else:
            src = x if memory is None else memory
            k = self.k(src).view(B, -1, H, D).transpose(1, 2)  # (B, H, S, D)
            v = self.v(src).view(B, -1, H, D).transpose(1, 2)
            if cache is not None:
                k, v = cache.update(k, v)
        out = attention(q, k, v, mask=mask, causal=causal, scale=1.0,
                        dropout_p=self.dropout if self.training else 0.0)  # (B, H, L, D)
        return self.o(out.transpose(1, 2).reshape(B, L, H * D))  # (B, L, E)


class T5FeedForward(nn.Module):
    """``W_o relu(W_i x)`` or, gated, ``W_o (gelu_tanh(W_i0 x) ⊙ W_i1 x)``; no biases, HF's names."""

    def __init__(self, d_model: int, d_ff: int, *, gated: bool, dropout: float = 0.0) -> None:
        super().__init__()
        self.gated = gated
        if gated:
            self.wi_0 = nn.Linear(d_model, d_ff, bias=False)
            self.wi_1 = nn.Linear(d_model, d_ff, bias=False)
        else:
            self.wi = nn.Linear(d_model, d_ff, bias=False)
        self.wo = nn.Linear(d_ff, d_model, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = ACTIVATIONS["gelu_tanh"](self.wi_0(x)) * self.wi_1(x) if self.gated else F.relu(self.wi(x))
        return self.wo(self.dropout(h))  # (B, L, E)


class T5Layer(nn.Module):
    """Pre-norm residual sub-layers: self-attention, (decoder) cross-attention, feed-forward."""

    def __init__(self, config: T5Config, *, decoder: bool) -> None:
        super().__init__()
        c = config
        self.self_norm = RMSNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.self_attn = T5Attention(c.d_model, c.num_heads, c.d_kv, dropout=c.dropout_rate)
        if decoder:
            self.cross_norm = RMSNorm(c.d_model, eps=c.layer_norm_epsilon)
            self.cross_attn = T5Attention(c.d_model, c.num_heads, c.d_kv, dropout=c.dropout_rate)
        self.ffn_norm = RMSNorm(c.d_model, eps=c.layer_norm_epsilon)
        self.ffn = T5FeedForward(c.d_model, c.d_ff, gated=c.feed_forward_proj == "gated-gelu", dropout=c.dropout_rate)
        self.dropout = nn.Dropout(c.dropout_rate)

    def forward(self, x: Tensor, self_mask: Tensor, *, causal: bool = False, memory: Optional[Tensor] = None,
                memory_mask: Optional[Tensor] = None, cache: Optional[LayerCache] = None) -> Tensor:
        x = x + self.dropout(self.self_attn(self.self_norm(x), mask=self_mask, causal=causal,
                                            cache=None if cache is None else cache.self_attn))
        if memory is not None:
            x = x + self.dropout(self.cross_attn(self.cross_norm(x), memory, mask=memory_mask,
                                                 cache=None if cache is None else cache.cross_attn))
        return x + self.dropout(self.ffn(self.ffn_norm(x)))


class T5Stack(nn.Module):
    """Layers sharing one relative bias (HF keeps it in block 0), then the final RMSNorm and dropout."""

    def __init__(self, config: T5Config, *, decoder: bool) -> None:
        super().__init__()
        self.decoder = decoder
        self.relative_bias = T5RelativeBias(config.num_heads, bidirectional=not decoder,
                                            num_buckets=config.relative_attention_num_buckets,
                                            max_distance=config.relative_attention_max_distance)
        n = config.num_decoder_layers if decoder else config.num_layers
        self.layers = nn.ModuleList(T5Layer(config, decoder=decoder) for _ in range(n))
        self.final_norm = RMSNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, x: Tensor, key_mask: Optional[Tensor], *, memory: Optional[Tensor] = None,
                memory_mask: Optional[Tensor] = None, caches: Optional[list[LayerCache]] = None) -> Tensor:
        """``x (B, L, E)`` embeddings; ``key_mask (B, past + L)`` 1 = token, 0 = padding (or None)."""
        L = x.shape[1]
        past = 0 if caches is None else caches[0].self_attn.length
        pos = torch.arange(past + L, device=x.device)
        mask = self.relative_bias(pos[past:], pos).to(x.dtype)  # (1, H, L, past + L)
        if key_mask is not None:
            mask = mask.masked_fill(key_mask[:, None, None, :] == 0, float("-inf"))  # (B, H, L, past + L)
        mem_mask = None if memory_mask is None else memory_mask[:, None, None, :].bool()  # (B, 1, 1, S)
        x = self.dropout(x)
        for i, layer in enumerate(self.layers):
            x = layer(x, mask, causal=self.decoder and L > 1, memory=memory, memory_mask=mem_mask,
                      cache=None if caches is None else caches[i])
        return self.dropout(self.final_norm(x))


# our parameter name (without ".weight") -> HF's
_RULES = [
    (r"shared", "shared"),
    (r"lm_head", "lm_head"),
    (r"(encoder|decoder)\.relative_bias\.relative_attention_bias",
     r"\1.block.0.layer.0.SelfAttention.relative_attention_bias"),
    (r"(encoder|decoder)\.final_norm", r"\1.final_layer_norm"),
    (r"(encoder|decoder)\.layers\.(\d+)\.self_norm", r"\1.block.\2.layer.0.layer_norm"),
    (r"(encoder|decoder)\.layers\.(\d+)\.self_attn\.([qkvo])", r"\1.block.\2.layer.0.SelfAttention.\3"),
    (r"decoder\.layers\.(\d+)\.cross_norm", r"decoder.block.\1.layer.1.layer_norm"),
    (r"decoder\.layers\.(\d+)\.cross_attn\.([qkvo])", r"decoder.block.\1.layer.1.EncDecAttention.\2"),
    (r"encoder\.layers\.(\d+)\.ffn_norm", r"encoder.block.\1.layer.1.layer_norm"),
    (r"encoder\.layers\.(\d+)\.ffn\.(wi|wi_0|wi_1|wo)", r"encoder.block.\1.layer.1.DenseReluDense.\2"),
    (r"decoder\.layers\.(\d+)\.ffn_norm", r"decoder.block.\1.layer.2.layer_norm"),
    (r"decoder\.layers\.(\d+)\.ffn\.(wi|wi_0|wi_1|wo)", r"decoder.block.\1.layer.2.DenseReluDense.\2"),
]


def _hf_name(name: str) -> str:
    stem, _, suffix = name.rpartition(".")
    for pattern, repl in _RULES:
        if re.fullmatch(pattern, stem):
            return f"{re.sub(pattern, repl, stem)}.{suffix}"
    raise KeyError(f"no HF name for parameter {name!r}")


class T5ForConditionalGeneration(PreTrainedMixin, nn.Module):
    """T5 encoder–decoder with the LM head: HF ``T5ForConditionalGeneration``.

    ``from_pretrained`` / ``save_pretrained`` read and write HF-format directories (see
    :mod:`attnlab.models.hub`); :meth:`greedy` decodes on a KV cache.
    """

    hf_architecture = "T5ForConditionalGeneration"
    # tied copies of `shared` (and of lm_head when tied), an unused bias old checkpoints carry
    hf_ignored = (r"^(encoder|decoder)\.embed_tokens\.weight$", r"^lm_head\.weight$",
                  r"^decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight$")

    def __init__(self, config: T5Config) -> None:
        super().__init__()
        if not isinstance(config, T5Config):
            raise TypeError(f"config must be a T5Config, got {type(config).__name__}")
        c = self.config = config
        self.shared = nn.Embedding(c.vocab_size, c.d_model)
        self.encoder = T5Stack(c, decoder=False)
        self.decoder = T5Stack(c, decoder=True)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.d_model, c.vocab_size, bias=False)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        """HF's T5 init: N(0, 1) embeddings, N(0, fan_in^-½) projections (q: (d·d_kv)^-½), unit norms."""
        c = self.config
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=m.in_features ** -0.5)
        for m in self.modules():
            if isinstance(m, T5Attention):
                nn.init.normal_(m.q.weight, std=(c.d_model * c.d_kv) ** -0.5)
            elif isinstance(m, T5RelativeBias):
                nn.init.normal_(m.relative_attention_bias.weight, std=c.d_model ** -0.5)
        nn.init.normal_(self.shared.weight, std=1.0)
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head.weight, std=1.0)

    # ---- forward -------------------------------------------------------------------------

    def encode(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        """``input_ids (B, S)`` -> encoder output ``(B, S, E)``; ``attention_mask`` 1 = token, 0 = padding."""
        self._check_ids("input_ids", input_ids)
        self._check_mask("attention_mask", attention_mask, input_ids.shape)
        return self.encoder(self.shared(input_ids), attention_mask)

    def forward(self, input_ids: Optional[Tensor] = None, attention_mask: Optional[Tensor] = None,
                decoder_input_ids: Optional[Tensor] = None, decoder_attention_mask: Optional[Tensor] = None,
                labels: Optional[Tensor] = None, *, encoder_last_hidden_state: Optional[Tensor] = None,
                past_key_values: Optional[list[LayerCache]] = None, use_cache: bool = False) -> Seq2SeqLMOutput:
        """Logits of ``decoder_input_ids (B, T)`` given ``input_ids (B, S)``, as HF's forward.

        Args:
            attention_mask: ``(B, S)`` encoder padding (1 = token, 0 = padding); T5's relative positions
                do not depend on it, so both left and right padding work.
            decoder_input_ids: default ``labels`` shifted right behind ``decoder_start_token_id``
                (``-100`` replaced by ``pad_token_id``).
            decoder_attention_mask: ``(B, past + T)`` decoder padding.
            labels: ``(B, T)`` targets; ``loss`` is their mean cross-entropy, ``-100`` ignored.
            encoder_last_hidden_state: skip the encoder and use this ``(B, S, E)`` output.
            past_key_values: per-layer caches (:meth:`new_cache`), updated in place.
            use_cache: return the caches (new ones are made when ``past_key_values`` is None).

        Raises:
            ValueError: ids outside ``[0, vocab_size)``, missing decoder inputs, masks of the wrong shape.
        """
        if encoder_last_hidden_state is None:
            if input_ids is None:
                raise ValueError("input_ids (or encoder_last_hidden_state) is required")
            encoder_last_hidden_state = self.encode(input_ids, attention_mask)
        if decoder_input_ids is None:
            if labels is None:
                raise ValueError("decoder_input_ids or labels is required")
            decoder_input_ids = self.shift_right(labels)
        self._check_ids("decoder_input_ids", decoder_input_ids)
        if use_cache and past_key_values is None:
            past_key_values = self.new_cache()
        past = 0 if past_key_values is None else past_key_values[0].self_attn.length
        B, T = decoder_input_ids.shape
        self._check_mask("decoder_attention_mask", decoder_attention_mask, (B, past + T))
        h = self.decoder(self.shared(decoder_input_ids), decoder_attention_mask, memory=encoder_last_hidden_state,
                         memory_mask=attention_mask, caches=past_key_values)  # (B, T, E)
        if self.lm_head is None:
            logits = F.linear(h * self.config.d_model ** -0.5, self.shared.weight)  # (B, T, V)
        else:
            logits = self.lm_head(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        return Seq2SeqLMOutput(logits, encoder_last_hidden_state, loss, past_key_values if use_cache else None)

    def shift_right(self, labels: Tensor) -> Tensor:
        """``[decoder_start, y_0, …, y_{T-2}]`` with ``-100`` replaced by ``pad_token_id`` (HF's ``_shift_right``)."""
        out = labels.new_full(labels.shape, self.config.decoder_start_token_id)
        out[:, 1:] = labels[:, :-1]
        return out.masked_fill(out == -100, self.config.pad_token_id)

    def new_cache(self, *, max_length: Optional[int] = None) -> list[LayerCache]:
        """Empty per-decoder-layer caches (growing or preallocated self-attention, static cross-attention)."""
        return [LayerCache.create(max_length=max_length) for _ in self.decoder.layers]

    @torch.no_grad()
    def greedy(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None, *, max_new_tokens: int,
               eos_token_id: Optional[int] = None) -> Tensor:
        """Greedy decoding ``y_t = argmax p(y | y_<t, x)`` on the KV cache, as HF's greedy ``generate``.

        Returns ``(B, 1 + n)``: ``decoder_start_token_id`` then ``n <= max_new_tokens`` tokens; a
        sequence that emitted ``eos_token_id`` (default the config's) is padded with ``pad_token_id``;
        decoding stops when all have.

        Raises:
            ValueError: ``max_new_tokens`` is not a positive int, or an input is invalid (see :meth:`forward`).
        """
        _check_int("max_new_tokens", max_new_tokens, minimum=1)
        c = self.config
        eos = c.eos_token_id if eos_token_id is None else eos_token_id
        memory = self.encode(input_ids, attention_mask)
        B = input_ids.shape[0]
        out = input_ids.new_full((B, 1), c.decoder_start_token_id)
        unfinished = torch.ones(B, dtype=torch.bool, device=input_ids.device)
        cache = self.new_cache()
        for _ in range(max_new_tokens):
            logits = self(attention_mask=attention_mask, decoder_input_ids=out[:, -1:], encoder_last_hidden_state=memory,
                          past_key_values=cache, use_cache=True).logits[:, -1]  # (B, V)
            nxt = torch.where(unfinished, logits.argmax(dim=-1), c.pad_token_id)
            unfinished &= nxt != eos
            out = torch.cat([out, nxt[:, None]], dim=1)
            if not bool(unfinished.any()):
                break
        return out

    def _check_ids(self, name: str, ids) -> None:
        if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32) or 0 in ids.shape:
            raise ValueError(f"{name} must be a non-empty integer tensor (B, L), got "
                             f"{getattr(ids, 'dtype', type(ids).__name__)} {tuple(getattr(ids, 'shape', ()))}")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.config.vocab_size:
            raise ValueError(f"{name} must lie in [0, vocab_size={self.config.vocab_size}), got values in [{lo}, {hi}]")

    @staticmethod
    def _check_mask(name: str, mask, shape) -> None:
        if mask is None:
            return
        if not isinstance(mask, Tensor) or tuple(mask.shape) != tuple(shape):
            raise ValueError(f"{name} must be a tensor of shape {tuple(shape)}, got "
                             f"{tuple(getattr(mask, 'shape', ())) or type(mask).__name__}")
        if not ((mask == 0) | (mask == 1)).all():
            raise ValueError(f"{name} must hold only 1 (token) and 0 (padding)")

    # ---- HF names ------------------------------------------------------------------------

    def to_hf_state_dict(self) -> dict[str, Tensor]:
        """Our parameters under HF's names (the tied embedding stored once, as ``shared``)."""
        return {_hf_name(name): t for name, t in self.state_dict().items()}

    def from_hf_state_dict(self, hf: dict[str, Tensor]) -> dict[str, Tensor]:
        """The inverse of :meth:`to_hf_state_dict`: HF tensors under our names."""
        return {name: hf[_hf_name(name)] for name in self.state_dict()}


register("t5", config_from_hf=T5Config.from_hf, architectures={"T5ForConditionalGeneration": T5ForConditionalGeneration},
         default="T5ForConditionalGeneration")
