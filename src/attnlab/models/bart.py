"""BART (Lewis et al. 2020) from attnlab's blocks, loading and saving Hugging Face checkpoints.

::

    enc⁰ = LN_emb(s · E[x] + P_enc[i + 2])          s = sqrt(d_model) if scale_embedding else 1
    encˡ = EncoderLayer(encˡ⁻¹)                     post-norm: LN(x + Attn(x)), LN(x + W₂ gelu(W₁ x))
    dec⁰ = LN_emb(s · E[y] + P_dec[t + 2])
    decˡ = DecoderLayer(decˡ⁻¹, enc)                post-norm causal self-attention, cross-attention, FFN
    logits = dec E_wᵀ + b_final                     (LM head tied to the shared embedding E)

The position tables have ``max_position_embeddings + 2`` rows and position ``i`` reads row ``i + 2``
(fairseq's offset, HF's ``BartLearnedPositionalEmbedding``); positions do not follow the padding.
Module names are ours (``self_attn.in_proj`` packs HF's q_proj/k_proj/v_proj, ``cross_attn`` is
HF's ``encoder_attn``, ``norm1..3`` and ``ffn.w1/w2`` its layer norms and fc1/fc2); the HF names
appear only in :data:`WEIGHT_MAP`, which :meth:`~BartForConditionalGeneration.to_hf_state_dict` /
``from_hf_state_dict`` read.
With ``output_attentions`` the per-head weights are recovered from each attention's q, k and
log-sum-exp by each attention's forward (:class:`~attnlab.modules.multihead.MultiheadAttention`), which keeps its fast backend.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from attnlab._checks import boolean, check_int, check_rate, one_of
from attnlab._limits import check_model_sizes
from attnlab.models.hub import (PreTrainedMixin, WeightMap, check_attention_mask, check_encoder_outputs,
                                check_token_inputs, pack, register, rename)
from attnlab.models.outputs import Seq2SeqLMOutput
from attnlab.nn.block import DecoderLayer, EncoderLayer, LayerCache, LayerSpec
from attnlab.nn.dropout import Dropout

# HF activation_function -> our FeedForward activation ("gelu_new" is the tanh approximation).
HF_ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
POSITION_OFFSET = 2  # BART's learned positions start at row 2 of the table


@dataclass
class BartConfig:
    """BART hyper-parameters with HF ``BartConfig``'s field names and defaults (bart-large).

    ``dropout`` acts on the embeddings and residual branches, ``attention_dropout`` on the attention
    weights, ``activation_dropout`` on the feed-forward hidden layer (all in training only).
    """

    vocab_size: int = 50265
    max_position_embeddings: int = 1024
    d_model: int = 1024
    encoder_layers: int = 12
    decoder_layers: int = 12
    encoder_attention_heads: int = 16
    decoder_attention_heads: int = 16
    encoder_ffn_dim: int = 4096
    decoder_ffn_dim: int = 4096
    activation_function: str = "gelu"
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    init_std: float = 0.02
    scale_embedding: bool = False
    pad_token_id: int = 1
    bos_token_id: Optional[int] = 0
    eos_token_id: Optional[int] = 2
    decoder_start_token_id: int = 2

    def __post_init__(self) -> None:
        check_model_sizes(self)
        for f in ("vocab_size", "max_position_embeddings", "d_model", "encoder_layers", "decoder_layers",
                  "encoder_attention_heads", "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim"):
            check_int(f, getattr(self, f), minimum=1)
        for f in ("encoder_attention_heads", "decoder_attention_heads"):
            if self.d_model % getattr(self, f):
                raise ValueError(f"d_model={self.d_model} must be divisible by {f}={getattr(self, f)}")
        one_of("activation_function", self.activation_function, sorted(HF_ACTIVATIONS))
        for f in ("dropout", "attention_dropout", "activation_dropout"):
            check_rate(f, getattr(self, f))
        boolean("scale_embedding", self.scale_embedding)
        for f in ("pad_token_id", "decoder_start_token_id", "bos_token_id", "eos_token_id"):
            v = getattr(self, f)
            if v is None and f in ("bos_token_id", "eos_token_id"):
                continue
            check_int(f, v, minimum=0)
            if v >= self.vocab_size:
                raise ValueError(f"{f} must be < vocab_size={self.vocab_size}, got {v}")

    @classmethod
    def from_hf(cls, d: dict) -> "BartConfig":
        """From an HF ``config.json`` dict (unknown keys ignored; variants we cannot run rejected)."""
        for flag in ("normalize_before", "add_final_layer_norm", "add_bias_logits", "static_position_embeddings",
                     "is_decoder"):
            if d.get(flag):
                raise ValueError(f"{flag}=True is not supported by attnlab's BART")
        if not d.get("normalize_embedding", True):
            raise ValueError("normalize_embedding=False is not supported by attnlab's BART")
        for f in ("encoder_layerdrop", "decoder_layerdrop"):
            if d.get(f, 0.0):
                raise ValueError(f"{f} must be 0 (LayerDrop is not implemented), got {d[f]!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_hf(self) -> dict:
        """An HF ``config.json`` dict that ``transformers.BartConfig`` reads back unchanged."""
        return {**dataclasses.asdict(self), "model_type": "bart", "is_encoder_decoder": True,
                "tie_word_embeddings": True, "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0}


class BartLearnedPositionalEmbedding(nn.Embedding):
    """``PE(i) = W[i + 2]``, ``W (max_positions + 2, dim)``: HF's table layout, offset included."""

    def __init__(self, max_positions: int, dim: int) -> None:
        super().__init__(max_positions + POSITION_OFFSET, dim)
        self.max_positions = max_positions

    def forward(self, positions: Tensor) -> Tensor:
        """Integer ``positions`` in ``[0, max_positions)`` of any shape ``S`` -> ``(*S, dim)``."""
        return super().forward(positions + POSITION_OFFSET)


class _BartStack(nn.Module):
    """One side of BART: positions, ``layernorm_embedding`` and its post-norm layers."""

    def __init__(self, config: BartConfig, layers: list[nn.Module]) -> None:
        super().__init__()
        self.embed_positions = BartLearnedPositionalEmbedding(config.max_position_embeddings, config.d_model)
        self.layernorm_embedding = nn.LayerNorm(config.d_model)
        self.dropout = Dropout(config.dropout)
        self.layers = nn.ModuleList(layers)
        for layer in self.layers:  # HF's activation_dropout, separate from the residual dropout
            layer.ffn.dropout = Dropout(config.activation_dropout)

    def embed(self, tokens: Tensor, past: int = 0) -> Tensor:
        """``LN_emb(tokens + P[past .. past + T - 1])`` then dropout, for embedded ``tokens (B, T, E)``."""
        pos = torch.arange(past, past + tokens.shape[1], device=tokens.device)
        return self.dropout(self.layernorm_embedding(tokens + self.embed_positions(pos)))  # (B, T, E)


def _layer_spec(config: BartConfig, heads: int, ffn_dim: int) -> LayerSpec:
    """The options of one BART encoder or decoder layer (post-norm, LayerNorm ε = 1e-5)."""
    return LayerSpec(config.d_model, heads, ffn_dim=ffn_dim, activation=HF_ACTIVATIONS[config.activation_function],
                     dropout=config.dropout, attn_dropout=config.attention_dropout, norm_first=False, norm_eps=1e-5)


class BartForConditionalGeneration(PreTrainedMixin, nn.Module):
    """BART encoder–decoder with the tied LM head: HF ``BartForConditionalGeneration``.

    ``from_pretrained`` / ``save_pretrained`` read and write HF-format directories
    (see :mod:`attnlab.models.hub`); :meth:`generate` decodes (greedy, sampling, beam search) on a KV cache.
    """

    hf_architecture = "BartForConditionalGeneration"
    is_encoder_decoder = True  # attnlab.generation encodes the source once

    def __init__(self, config: BartConfig) -> None:
        super().__init__()
        if not isinstance(config, BartConfig):
            raise TypeError(f"config must be a BartConfig, got {type(config).__name__}")
        c = self.config = config
        self.embed_scale = math.sqrt(c.d_model) if c.scale_embedding else 1.0
        self.shared = nn.Embedding(c.vocab_size, c.d_model, padding_idx=c.pad_token_id)
        enc = _layer_spec(c, c.encoder_attention_heads, c.encoder_ffn_dim)
        dec = _layer_spec(c, c.decoder_attention_heads, c.decoder_ffn_dim)
        self.encoder = _BartStack(c, [EncoderLayer.from_spec(enc) for _ in range(c.encoder_layers)])
        self.decoder = _BartStack(c, [DecoderLayer.from_spec(dec) for _ in range(c.decoder_layers)])
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.register_buffer("final_logits_bias", torch.zeros(1, c.vocab_size))
        self._init_weights()
        self.lm_head.weight = self.shared.weight  # tied

    def _init_weights(self) -> None:
        """HF's init: N(0, init_std) linear and embedding weights (padding row zero), zero biases."""
        for mod in self.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                nn.init.normal_(mod.weight, std=self.config.init_std)
            if isinstance(mod, nn.Linear) and mod.bias is not None:
                nn.init.zeros_(mod.bias)
            if isinstance(mod, nn.Embedding) and mod.padding_idx is not None:
                nn.init.zeros_(mod.weight[mod.padding_idx])

    # ---- forward -------------------------------------------------------------------------

    def encode(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        """``input_ids (B, S)`` -> encoder states ``(B, S, E)``; ``attention_mask`` 1 = token, 0 = padding.

        Raises:
            ValueError: bad ids (outside the vocabulary, longer than ``max_position_embeddings``) or mask.
        """
        return self._encode(input_ids, attention_mask, False)[0]

    def _encode(self, input_ids: Tensor, attention_mask: Optional[Tensor], need_weights: bool):
        check_token_inputs(input_ids, attention_mask, vocab_size=self.config.vocab_size,
                           max_positions=self.config.max_position_embeddings)
        pad = _padding(attention_mask)
        x = self.encoder.embed(self.shared(input_ids) * self.embed_scale)  # (B, S, E)
        attns = []
        for layer in self.encoder.layers:
            x = layer(x, key_padding_mask=pad, need_weights=need_weights)
            if need_weights:
                x, w = x
                attns.append(w.self_attn)
        return x, tuple(attns) if need_weights else None

    def new_cache(self, *, max_length: Optional[int] = None) -> list[LayerCache]:
        """Empty per-decoder-layer caches; ``max_length`` preallocates the self-attention ones."""
        return [LayerCache.create(max_length=max_length) for _ in self.decoder.layers]

    def decode(self, decoder_input_ids: Tensor, encoder_hidden_states: Tensor, *,
               attention_mask: Optional[Tensor] = None, decoder_attention_mask: Optional[Tensor] = None,
               cache: Optional[list[LayerCache]] = None) -> Tensor:
        """Logits ``(B, T, V)`` of ``decoder_input_ids (B, T)`` on the encoder states ``(B, S, E)``.

        With ``cache`` (from :meth:`new_cache`, updated in place) the ids continue the cached
        prefix: positions start at its length and ``decoder_attention_mask`` covers ``past + T``.
        ``attention_mask`` is the encoder's ``(B, S)`` mask.
        """
        return self._decode(decoder_input_ids, encoder_hidden_states, attention_mask, decoder_attention_mask,
                            cache, False)[0]

    def _decode(self, ids: Tensor, memory: Tensor, attention_mask, decoder_attention_mask, cache, need_weights):
        x, self_w, cross_w = self._decoder_states(ids, memory, attention_mask, decoder_attention_mask, cache,
                                                  need_weights)
        return self.lm_head(x) + self.final_logits_bias, self_w, cross_w  # (B, T, V)

    def _decoder_states(self, ids: Tensor, memory: Tensor, attention_mask, decoder_attention_mask, cache,
                        need_weights):
        """The last decoder layer's output ``(B, T, E)`` (+ per-layer self / cross weights with ``need_weights``)."""
        past = 0 if cache is None else cache[0].self_attn.length
        check_token_inputs(ids, decoder_attention_mask, vocab_size=self.config.vocab_size, past=past,
                           max_positions=self.config.max_position_embeddings, name="decoder_input_ids",
                           mask_name="decoder_attention_mask")
        check_encoder_outputs(memory, self.config.d_model)
        check_attention_mask(attention_mask, memory.shape[:2])
        tgt_pad, mem_pad = _padding(decoder_attention_mask), _padding(attention_mask)
        x = self.decoder.embed(self.shared(ids) * self.embed_scale, past)  # (B, T, E)
        layers = self.decoder.layers
        weights = []
        for i, layer in enumerate(layers):
            x = layer(x, memory, tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=mem_pad,
                      is_causal=True, cache=None if cache is None else cache[i], need_weights=need_weights)
            if need_weights:
                x, w = x
                weights.append(w)
        if not need_weights:
            return x, None, None
        return x, tuple(w.self_attn for w in weights), tuple(w.cross_attn for w in weights)

    def forward(self, input_ids: Optional[Tensor] = None, attention_mask: Optional[Tensor] = None,
                decoder_input_ids: Optional[Tensor] = None, decoder_attention_mask: Optional[Tensor] = None,
                *, encoder_outputs: Optional[Tensor] = None, past_key_values: Optional[list[LayerCache]] = None,
                use_cache: bool = False, output_attentions: bool = False) -> Seq2SeqLMOutput:
        """Teacher-forced logits, with HF's argument names.

        Args:
            input_ids: source ``(B, S)``; not needed when ``encoder_outputs`` (the encoder states
                ``(B, S, E)`` of an earlier call) is given.
            attention_mask: source ``(B, S)``, 1 = token, 0 = padding.
            decoder_input_ids: target ``(B, T)``; default: ``input_ids`` shifted right behind
                ``decoder_start_token_id`` (BART's denoising setup, as HF).
            decoder_attention_mask: ``(B, past + T)``, 1 = token, 0 = padding (on top of causality).
            past_key_values, use_cache: as :meth:`decode`'s ``cache``; ``use_cache`` makes new
                caches when none are given and returns them.
            output_attentions: also return ``encoder_attentions`` (unless ``encoder_outputs`` is given),
                ``decoder_attentions`` and ``cross_attentions``: per layer ``(B, H, Lq, Lk)``. The
                decoder's self-attention cache must then be empty (its past inputs are gone).

        Raises:
            ValueError: neither ``input_ids`` nor ``encoder_outputs``; an id outside the vocabulary;
                a sequence longer than ``max_position_embeddings``; a mask of the wrong shape or values;
                ``output_attentions`` with a non-empty cache.
        """
        enc_w = None
        if encoder_outputs is None:
            if input_ids is None:
                raise ValueError("input_ids is required unless encoder_outputs is given")
            encoder_outputs, enc_w = self._encode(input_ids, attention_mask, output_attentions)
        if decoder_input_ids is None:
            if input_ids is None:
                raise ValueError("decoder_input_ids is required when input_ids is not given")
            decoder_input_ids = shift_tokens_right(input_ids, self.config.decoder_start_token_id)
        if past_key_values is None and use_cache:
            past_key_values = self.new_cache()
        logits, self_w, cross_w = self._decode(decoder_input_ids, encoder_outputs, attention_mask,
                                               decoder_attention_mask, past_key_values, output_attentions)
        return Seq2SeqLMOutput(logits, encoder_outputs, past_key_values=past_key_values if use_cache else None,
                               encoder_attentions=enc_w, decoder_attentions=self_w, cross_attentions=cross_w)

    # ---- generation ----------------------------------------------------------------------

    @property
    def generation_defaults(self) -> dict[str, Optional[int]]:
        """The config's ``decoder_start_token_id``, ``eos_token_id`` and ``pad_token_id``."""
        c = self.config
        return dict(decoder_start_token_id=c.decoder_start_token_id, eos_token_id=c.eos_token_id,
                    pad_token_id=c.pad_token_id)

    def generate(self, input_ids: Tensor, **kwargs) -> Tensor:
        """:func:`attnlab.generation.generate` with ``input_ids (B, S)`` as the source (same arguments).

        Returns the decoder ids ``(B, 1 + n)``, starting with ``decoder_start_token_id``, as
        ``transformers`` does (without its BART-specific forced BOS/EOS tokens); the token ids default
        to :attr:`generation_defaults`.
        """
        from attnlab.generation import generate
        return generate(self, input_ids, **kwargs)

    def hf_weight_map(self) -> WeightMap:
        """:data:`WEIGHT_MAP`: packed q/k/v split, the tied ``lm_head`` stored once (as ``shared``)."""
        return WEIGHT_MAP


_STACK, _LAYER = "{stack:encoder|decoder}", "model.{stack}.layers.{i}"
# Our names <-> HF BartForConditionalGeneration's. In encoder layers norm2 is the FFN's norm; in decoder
# layers norm2 follows cross-attention (HF's encoder_attn) and norm3 the FFN.
WEIGHT_MAP = WeightMap("BART", [
    rename("shared.weight", "model.shared.weight"),
    rename("final_logits_bias", "final_logits_bias"),
    rename(f"{_STACK}.{{m:embed_positions|layernorm_embedding}}.{{p}}", "model.{stack}.{m}.{p}"),
    pack(f"{_STACK}.layers.{{i}}.self_attn.in_proj.{{p}}", *(f"{_LAYER}.self_attn.{x}_proj.{{p}}" for x in "qkv")),
    rename(f"{_STACK}.layers.{{i}}.self_attn.out_proj.{{p}}", f"{_LAYER}.self_attn.out_proj.{{p}}"),
    rename(f"{_STACK}.layers.{{i}}.norm1.{{p}}", f"{_LAYER}.self_attn_layer_norm.{{p}}"),
    rename(f"{_STACK}.layers.{{i}}.ffn.w{{n:1|2}}.{{p}}", f"{_LAYER}.fc{{n}}.{{p}}"),
    rename("encoder.layers.{i}.norm2.{p}", "model.encoder.layers.{i}.final_layer_norm.{p}"),
    pack("decoder.layers.{i}.cross_attn.in_proj.{p}",
         *(f"model.decoder.layers.{{i}}.encoder_attn.{x}_proj.{{p}}" for x in "qkv")),
    rename("decoder.layers.{i}.cross_attn.out_proj.{p}", "model.decoder.layers.{i}.encoder_attn.out_proj.{p}"),
    rename("decoder.layers.{i}.norm2.{p}", "model.decoder.layers.{i}.encoder_attn_layer_norm.{p}"),
    rename("decoder.layers.{i}.norm3.{p}", "model.decoder.layers.{i}.final_layer_norm.{p}"),
], tied={"lm_head.weight": "shared.weight"},
    ignore=(r"^model\.(encoder|decoder)\.embed_tokens\.weight$", r"^lm_head\.weight$",  # tied copies
            r"^model\.(encoder|decoder)\.version$"),
    optional=("final_logits_bias",))  # an all-zero buffer some exports drop


def shift_tokens_right(input_ids: Tensor, decoder_start_token_id: int) -> Tensor:
    """``[start, x_0, …, x_{L-2}]``: the decoder input BART derives from ``input_ids (B, L)``."""
    return torch.cat([input_ids.new_full((input_ids.shape[0], 1), decoder_start_token_id), input_ids[:, :-1]], 1)


def _padding(mask: Optional[Tensor]) -> Optional[Tensor]:
    """A checked 1/0 attention mask -> key padding mask (True = padding), or None when nothing is padded."""
    return None if mask is None or bool(mask.all()) else mask == 0


register("bart", config_from_hf=BartConfig.from_hf, architectures={"BartForConditionalGeneration":
                                                                   BartForConditionalGeneration},
         default="BartForConditionalGeneration")
