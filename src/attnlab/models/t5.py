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
    logits = s · RMSNorm(h_dec) Wᵀ        W = E (tied) or W_lm (untied, T5 v1.1 / Flan-T5);
                                          s = d^-0.5 (scale_decoder_outputs: original T5) or 1

The stacks (:mod:`attnlab.models.t5_layers`) are the shared pre-norm :class:`~attnlab.nn.block.EncoderLayer`
/ :class:`~attnlab.nn.block.DecoderLayer` with ``scale=1``, ``head_dim=d_kv`` and the stack's relative bias
as the self-attentions' ``position_bias`` (a dense bias, or for long inputs a score_mod); q, k and v are
packed in ``in_proj``. HF names (``encoder.block.{i}.layer.0.SelfAttention.q`` …) appear only in
:func:`weight_map`, which :meth:`T5ForConditionalGeneration.to_hf_state_dict` /
:meth:`~T5ForConditionalGeneration.from_hf_state_dict` read.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab._checks import check_int, check_positive_float, check_rate, one_of
from attnlab._limits import check_model_sizes
from attnlab.models.hub import (PreTrainedMixin, WeightMap, check_attention_mask, check_encoder_outputs,
                               check_token_inputs, pack, register, rename)
from attnlab.models.outputs import Seq2SeqLMOutput
from attnlab.models.t5_layers import T5Stack
from attnlab.modules.multihead import MultiheadAttention
from attnlab.nn.block import LayerCache, LayerSpec
from attnlab.nn.positional import T5RelativeBias

FEED_FORWARD_PROJ = ("relu", "gated-gelu")


@dataclass
class T5Config:
    """T5 hyper-parameters with HF ``T5Config``'s names and defaults (t5-small).

    ``tie_word_embeddings``: the LM head is the shared embedding (else its own ``lm_head``);
    ``scale_decoder_outputs``: the decoder output is scaled by ``d_model^-0.5`` before the head
    (default: ``tie_word_embeddings``, i.e. original T5 ties and scales, T5 v1.1 / Flan-T5 do neither).
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
    scale_decoder_outputs: Optional[bool] = None
    pad_token_id: int = 0
    eos_token_id: int = 1
    decoder_start_token_id: int = 0

    def __post_init__(self) -> None:
        check_model_sizes(self)
        if self.num_decoder_layers is None:
            self.num_decoder_layers = self.num_layers
        if self.scale_decoder_outputs is None:
            self.scale_decoder_outputs = self.tie_word_embeddings
        for f in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers", "num_heads"):
            check_int(f, getattr(self, f), minimum=1)
        check_int("relative_attention_num_buckets", self.relative_attention_num_buckets, minimum=4)
        # the causal decoder's exact range is num_buckets // 2 (the encoder's is half that)
        check_int("relative_attention_max_distance", self.relative_attention_max_distance,
                   minimum=self.relative_attention_num_buckets // 2 + 1)
        for f in ("pad_token_id", "eos_token_id", "decoder_start_token_id"):
            check_int(f, getattr(self, f), minimum=0)
        check_rate("dropout_rate", self.dropout_rate)
        check_positive_float("layer_norm_epsilon", self.layer_norm_epsilon)
        one_of("feed_forward_proj", self.feed_forward_proj, FEED_FORWARD_PROJ)
        for f in ("tie_word_embeddings", "scale_decoder_outputs"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"{f} must be a bool, got {getattr(self, f)!r}")

    @classmethod
    def from_hf(cls, d: dict) -> "T5Config":
        """From an HF ``config.json`` dict (unknown keys ignored).

        transformers 4 wrote ``tie_word_embeddings: false`` for T5 v1.1 (untied and unscaled);
        transformers 5 always writes ``tie_word_embeddings: true`` with ``scale_decoder_outputs`` and
        unties the head only when the checkpoint holds its own ``lm_head.weight`` — which
        :meth:`T5ForConditionalGeneration.adapt_hf_checkpoint` settles from the tensors.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names and v is not None}
        if isinstance(kw.get("eos_token_id"), list) and len(kw["eos_token_id"]) == 1:  # HF allows a list
            kw["eos_token_id"] = kw["eos_token_id"][0]
        return cls(**kw)

    def to_hf(self) -> dict:
        """An HF ``config.json`` dict that ``transformers.T5Config`` reads back to the same model."""
        return {**dataclasses.asdict(self), "model_type": "t5", "is_encoder_decoder": True}


_BLOCK = "{stack}.block.{i}.layer"
_STACK = "{stack:encoder|decoder}"


def weight_map(config: "T5Config") -> WeightMap:
    """Our names <-> HF ``T5ForConditionalGeneration``'s (no biases anywhere). HF's block ``i`` holds
    ``layer.0`` self-attention, in the decoder ``layer.1`` cross-attention, then the feed-forward
    (``DenseReluDense``: ``wi``, or gated ``wi_0`` (activated) and ``wi_1``; ``wo``); our layers pack
    q/k/v into ``in_proj`` and number their norms ``norm1..3`` in the same order. The relative bias table
    lives in HF's block 0. With tied embeddings HF's stacks and head hold copies of ``shared`` (ignored);
    an untied head is ``lm_head``."""
    gated = config.feed_forward_proj == "gated-gelu"
    ffn = {"w1": "wi_0", "w3": "wi_1", "w2": "wo"} if gated else {"w1": "wi", "w2": "wo"}
    rules = [
        rename("shared.weight", "shared.weight"),
        *([] if config.tie_word_embeddings else [rename("lm_head.weight", "lm_head.weight")]),
        rename(f"{_STACK}.relative_bias.relative_attention_bias.weight",
               "{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
        rename(f"{_STACK}.final_norm.weight", "{stack}.final_layer_norm.weight"),
        rename(f"{_STACK}.layers.{{i}}.norm1.weight", f"{_BLOCK}.0.layer_norm.weight"),
        pack(f"{_STACK}.layers.{{i}}.self_attn.in_proj.weight",
             *(f"{_BLOCK}.0.SelfAttention.{x}.weight" for x in "qkv")),
        rename(f"{_STACK}.layers.{{i}}.self_attn.out_proj.weight", f"{_BLOCK}.0.SelfAttention.o.weight"),
        rename("decoder.layers.{i}.norm2.weight", "decoder.block.{i}.layer.1.layer_norm.weight"),
        pack("decoder.layers.{i}.cross_attn.in_proj.weight",
             *(f"decoder.block.{{i}}.layer.1.EncDecAttention.{x}.weight" for x in "qkv")),
        rename("decoder.layers.{i}.cross_attn.out_proj.weight", "decoder.block.{i}.layer.1.EncDecAttention.o.weight"),
        rename("encoder.layers.{i}.norm2.weight", "encoder.block.{i}.layer.1.layer_norm.weight"),
        rename("decoder.layers.{i}.norm3.weight", "decoder.block.{i}.layer.2.layer_norm.weight"),
    ]
    for stack, sub in (("encoder", 1), ("decoder", 2)):
        rules += [rename(f"{stack}.layers.{{i}}.ffn.{ours}.weight",
                         f"{stack}.block.{{i}}.layer.{sub}.DenseReluDense.{hf}.weight") for ours, hf in ffn.items()]
    # tied copies of `shared` (and of lm_head when tied), an unused bias old checkpoints carry
    return WeightMap("T5", rules, ignore=(
        r"^(encoder|decoder)\.embed_tokens\.weight$", r"^lm_head\.weight$",
        r"^decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight$"))


class T5ForConditionalGeneration(PreTrainedMixin, nn.Module):
    """T5 encoder–decoder with the LM head: HF ``T5ForConditionalGeneration``.

    ``from_pretrained`` / ``save_pretrained`` read and write HF-format directories (see
    :mod:`attnlab.models.hub`); :meth:`generate` decodes (greedy, sampling, beam search) on a KV cache.
    """

    hf_architecture = "T5ForConditionalGeneration"
    is_encoder_decoder = True  # attnlab.generation encodes the source once

    def __init__(self, config: T5Config) -> None:
        super().__init__()
        if not isinstance(config, T5Config):
            raise TypeError(f"config must be a T5Config, got {type(config).__name__}")
        c = self.config = config
        self.shared = nn.Embedding(c.vocab_size, c.d_model)
        spec = LayerSpec(c.d_model, c.num_heads, ffn_dim=c.d_ff,
                         activation="geglu_tanh" if c.feed_forward_proj == "gated-gelu" else "relu",
                         dropout=c.dropout_rate, norm_first=True, norm="rmsnorm", norm_eps=c.layer_norm_epsilon,
                         bias=False, head_dim=c.d_kv, scale=1.0)
        buckets = dict(num_buckets=c.relative_attention_num_buckets, max_distance=c.relative_attention_max_distance)
        self.encoder = T5Stack(spec, c.num_layers, decoder=False, **buckets)
        self.decoder = T5Stack(spec, c.num_decoder_layers, decoder=True, **buckets)
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
            if isinstance(m, MultiheadAttention):  # q: the first H·d_kv rows of the packed projection
                nn.init.normal_(m.in_proj.weight[:c.num_heads * c.d_kv], std=(c.d_model * c.d_kv) ** -0.5)
            elif isinstance(m, T5RelativeBias):
                nn.init.normal_(m.relative_attention_bias.weight, std=c.d_model ** -0.5)
        nn.init.normal_(self.shared.weight, std=1.0)
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head.weight, std=1.0)

    @classmethod
    def adapt_hf_checkpoint(cls, config: T5Config, hf: dict[str, Tensor]) -> tuple[T5Config, dict[str, Tensor]]:
        """Untie the head when the checkpoint holds an ``lm_head.weight`` of its own (transformers 5
        writes ``tie_word_embeddings: true`` for every T5 and unties on that tensor, as we do). A
        config that declares the head untied (transformers 4) and a checkpoint without ``lm_head.weight``
        fail to load, naming the missing tensor."""
        head, shared = hf.get("lm_head.weight"), hf.get("shared.weight")
        if config.tie_word_embeddings and head is not None and shared is not None and not torch.equal(head, shared):
            config = dataclasses.replace(config, tie_word_embeddings=False)
        return config, hf

    # ---- forward -------------------------------------------------------------------------

    def encode(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        """``input_ids (B, S)`` -> encoder output ``(B, S, E)``; ``attention_mask`` 1 = token, 0 = padding."""
        return self._encode(input_ids, attention_mask, False)[0]

    def _encode(self, input_ids: Tensor, attention_mask: Optional[Tensor], need_weights: bool):
        check_token_inputs(input_ids, attention_mask, vocab_size=self.config.vocab_size)
        h, weights, _ = self.encoder(self.shared(input_ids), attention_mask, need_weights=need_weights)
        return h, tuple(weights) if need_weights else None

    def decode(self, decoder_input_ids: Tensor, encoder_hidden_states: Tensor, *,
               attention_mask: Optional[Tensor] = None, decoder_attention_mask: Optional[Tensor] = None,
               cache: Optional[list[LayerCache]] = None) -> Tensor:
        """Logits ``(B, T, V)`` of ``decoder_input_ids (B, T)`` on the encoder output ``(B, S, E)``.

        With ``cache`` (:meth:`new_cache`, updated in place) the ids continue the cached prefix and
        ``decoder_attention_mask`` covers ``past + T``; ``attention_mask`` is the source's ``(B, S)``.
        """
        return self._decode(decoder_input_ids, encoder_hidden_states, attention_mask, decoder_attention_mask,
                            cache, False)[0]

    def _decode(self, ids: Tensor, memory: Tensor, attention_mask, decoder_attention_mask, cache, need_weights):
        h, self_w, cross_w = self._decoder_states(ids, memory, attention_mask, decoder_attention_mask, cache,
                                                  need_weights)
        if self.config.scale_decoder_outputs:
            h = h * self.config.d_model ** -0.5
        logits = F.linear(h, self.shared.weight if self.lm_head is None else self.lm_head.weight)  # (B, T, V)
        return logits, self_w, cross_w

    def _decoder_states(self, ids: Tensor, memory: Tensor, attention_mask, decoder_attention_mask, cache,
                        need_weights):
        """The decoder stack's output ``(B, T, E)`` (after its final norm), + per-layer weights if ``need_weights``."""
        check_encoder_outputs(memory, self.config.d_model)
        check_attention_mask(attention_mask, memory.shape[:2])
        past = 0 if cache is None else cache[0].self_attn.length
        check_token_inputs(ids, decoder_attention_mask, vocab_size=self.config.vocab_size, past=past,
                           name="decoder_input_ids", mask_name="decoder_attention_mask")
        h, self_w, cross_w = self.decoder(self.shared(ids), decoder_attention_mask, memory=memory,
                                          memory_mask=attention_mask, caches=cache, need_weights=need_weights)
        return (h, tuple(self_w), tuple(cross_w)) if need_weights else (h, None, None)

    def forward(self, input_ids: Optional[Tensor] = None, attention_mask: Optional[Tensor] = None,
                decoder_input_ids: Optional[Tensor] = None, decoder_attention_mask: Optional[Tensor] = None,
                labels: Optional[Tensor] = None, *, encoder_outputs: Optional[Tensor] = None,
                past_key_values: Optional[list[LayerCache]] = None, use_cache: bool = False,
                output_attentions: bool = False) -> Seq2SeqLMOutput:
        """Logits of ``decoder_input_ids (B, T)`` given ``input_ids (B, S)``, as HF's forward.

        Args:
            attention_mask: ``(B, S)`` encoder padding (1 = token, 0 = padding); T5's relative positions
                do not depend on it, so both left and right padding work.
            decoder_input_ids: default ``labels`` shifted right behind ``decoder_start_token_id``
                (``-100`` replaced by ``pad_token_id``).
            decoder_attention_mask: ``(B, past + T)`` decoder padding.
            labels: ``(B, T)`` targets; ``loss`` is their mean cross-entropy, ``-100`` ignored.
            encoder_outputs: skip the encoder and use this ``(B, S, E)`` output of :meth:`encode`.
            past_key_values: per-layer caches (:meth:`new_cache`), updated in place.
            use_cache: return the caches (new ones are made when ``past_key_values`` is None).
            output_attentions: also return ``encoder_attentions`` (unless ``encoder_outputs`` is given),
                ``decoder_attentions`` and ``cross_attentions``: per layer ``(B, H, Lq, Lk)``.

        Raises:
            ValueError: ids outside ``[0, vocab_size)``, missing decoder inputs, masks of the wrong shape.
        """
        enc_w = None
        if encoder_outputs is None:
            if input_ids is None:
                raise ValueError("input_ids (or encoder_outputs) is required")
            encoder_outputs, enc_w = self._encode(input_ids, attention_mask, output_attentions)
        if labels is not None and (not isinstance(labels, Tensor) or labels.is_floating_point()
                                   or labels.is_complex() or labels.dtype == torch.bool):
            raise ValueError(f"labels must be an integer tensor (B, T) of token ids (-100 ignored), got "
                             f"{getattr(labels, 'dtype', type(labels).__name__)}")
        if decoder_input_ids is None:
            if labels is None:
                raise ValueError("decoder_input_ids or labels is required")
            decoder_input_ids = self.shift_right(labels)
        if use_cache and past_key_values is None:
            past_key_values = self.new_cache()
        logits, self_w, cross_w = self._decode(decoder_input_ids, encoder_outputs, attention_mask,
                                               decoder_attention_mask, past_key_values, output_attentions)
        loss = None
        if labels is not None:  # (labels checked: ids in [0, vocab_size) or -100, of decoder_input_ids' shape)
            from attnlab.models.classifier import _cross_entropy

            loss = _cross_entropy(logits.float(), labels, tuple(decoder_input_ids.shape), "labels")
        return Seq2SeqLMOutput(logits, encoder_outputs, loss=loss,
                               past_key_values=past_key_values if use_cache else None,
                               encoder_attentions=enc_w, decoder_attentions=self_w, cross_attentions=cross_w)

    def shift_right(self, labels: Tensor) -> Tensor:
        """``[decoder_start, y_0, …, y_{T-2}]`` with ``-100`` replaced by ``pad_token_id`` (HF's ``_shift_right``)."""
        out = labels.new_full(labels.shape, self.config.decoder_start_token_id)
        out[:, 1:] = labels[:, :-1]
        return out.masked_fill(out == -100, self.config.pad_token_id)

    def new_cache(self, *, max_length: Optional[int] = None) -> list[LayerCache]:
        """Empty per-decoder-layer caches (growing or preallocated self-attention, static cross-attention)."""
        return [LayerCache.create(max_length=max_length) for _ in self.decoder.layers]

    # ---- generation ----------------------------------------------------------------------

    @property
    def generation_defaults(self) -> dict[str, int]:
        """The config's ``decoder_start_token_id``, ``eos_token_id`` and ``pad_token_id``."""
        c = self.config
        return dict(decoder_start_token_id=c.decoder_start_token_id, eos_token_id=c.eos_token_id,
                    pad_token_id=c.pad_token_id)

    def generate(self, input_ids: Tensor, **kwargs) -> Tensor:
        """:func:`attnlab.generation.generate` with ``input_ids (B, S)`` as the source (same arguments).

        Returns the decoder ids ``(B, 1 + n)``, starting with ``decoder_start_token_id``, as
        ``transformers`` does; the token ids default to :attr:`generation_defaults`.
        """
        from attnlab.generation import generate
        return generate(self, input_ids, **kwargs)

    def hf_weight_map(self) -> WeightMap:
        """:func:`weight_map` of this model's config (the tied embedding stored once, as ``shared``)."""
        return weight_map(self.config)


register("t5", config_from_hf=T5Config.from_hf, architectures={"T5ForConditionalGeneration": T5ForConditionalGeneration},
         default="T5ForConditionalGeneration")
