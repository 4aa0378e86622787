"""Encoder, decoder and encoder–decoder Transformers (Vaswani et al. 2017).

* :class:`TransformerEncoder` / :class:`TransformerDecoder`: stacks of
  :class:`~attnlab.nn.block.EncoderLayer` / :class:`~attnlab.nn.block.DecoderLayer` with an
  optional final norm.
* :class:`Transformer`: the two stacks, a batch-first equivalent of ``torch.nn.Transformer``
  (with its final ``encoder.norm`` and ``decoder.norm``; ``Transformer.from_torch`` copies weights).
* :class:`Seq2SeqTransformer`: embeddings, positions, the stacks and the output projection::

    x_0 = Embed(ids) · sqrt(d) + PE(positions)          # PE only for sinusoidal / learned
    logits = W_out Decoder(x_0^tgt, Encoder(x_0^src))   # W_out = Embed_tgt when tied

  with :meth:`~Seq2SeqTransformer.generate` (greedy, sampling, beam search on the KV cache) and
  ``output_attentions`` (weights recovered from the log-sum-exp; the fast backends keep running).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, Optional, Union

import torch
from torch import Tensor, nn

from attnlab._checks import positive_int
from attnlab.models.config import TransformerConfig
from attnlab.models.hub import check_attention_mask
from attnlab.models.outputs import Seq2SeqLMOutput
from attnlab.nn.block import AttentionWeights, DecoderLayer, EncoderLayer, LayerCache, LayerSpec
from attnlab.nn.dropout import Dropout
from attnlab.nn.norms import make_norm
from attnlab.nn.positional import (ALiBi, LearnedPositionalEmbedding, RotaryEmbedding, SinusoidalPositionalEmbedding,
                                   T5RelativeBias)


class _LayerStack(nn.Module):
    """``num_layers`` layers built by ``make_layer(i)``, then ``norm`` (if given).

    Raises:
        ValueError: ``num_layers`` is not a positive int.
    """

    def __init__(self, make_layer: Callable[[int], nn.Module], num_layers: int, *,
                 norm: Optional[nn.Module] = None) -> None:
        super().__init__()
        _check_num_layers(num_layers)
        self.layers = nn.ModuleList(make_layer(i) for i in range(num_layers))
        self.norm = norm


class TransformerEncoder(_LayerStack):
    """A stack of encoder layers (``make_layer(i)`` builds layer ``i``) and an optional final norm."""

    def forward(self, x: Tensor, *, key_padding_mask: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                is_causal: bool = False, need_weights: bool = False
                ) -> Union[Tensor, tuple[Tensor, list[AttentionWeights]]]:
        """``x (B, L, E) -> (B, L, E)``; with ``need_weights`` also one :class:`AttentionWeights` per layer."""
        weights = []
        for layer in self.layers:
            x = layer(x, key_padding_mask=key_padding_mask, attn_mask=attn_mask, is_causal=is_causal,
                      need_weights=need_weights)
            if need_weights:
                x, w = x
                weights.append(w)
        if self.norm is not None:
            x = self.norm(x)
        return (x, weights) if need_weights else x


class TransformerDecoder(_LayerStack):
    """A stack of decoder layers (``make_layer(i)`` builds layer ``i``) and an optional final norm."""

    def new_cache(self, *, max_length: Optional[int] = None) -> list[LayerCache]:
        """Empty per-layer caches; ``max_length`` preallocates the self-attention caches."""
        return [LayerCache.create(max_length=max_length, cross_attention=layer.cross_attn is not None)
                for layer in self.layers]

    def forward(self, x: Tensor, memory: Optional[Tensor] = None, *, tgt_key_padding_mask: Optional[Tensor] = None,
                memory_key_padding_mask: Optional[Tensor] = None, tgt_mask: Optional[Tensor] = None,
                memory_mask: Optional[Tensor] = None, is_causal: bool = True,
                cache: Optional[list[LayerCache]] = None, need_weights: bool = False
                ) -> Union[Tensor, tuple[Tensor, list[AttentionWeights]]]:
        """``x (B, T, E)``, ``memory (B, S, E)`` -> ``(B, T, E)``; see :meth:`DecoderLayer.forward`.

        ``cache`` is :meth:`new_cache`'s list (one :class:`LayerCache` per layer), updated in place.
        """
        if cache is not None and len(cache) != len(self.layers):
            raise ValueError(f"cache must hold one LayerCache per layer ({len(self.layers)}), got {len(cache)}")
        weights = []
        for i, layer in enumerate(self.layers):
            x = layer(x, memory, tgt_key_padding_mask=tgt_key_padding_mask,
                      memory_key_padding_mask=memory_key_padding_mask, tgt_mask=tgt_mask, memory_mask=memory_mask,
                      is_causal=is_causal, cache=None if cache is None else cache[i], need_weights=need_weights)
            if need_weights:
                x, w = x
                weights.append(w)
        if self.norm is not None:
            x = self.norm(x)
        return (x, weights) if need_weights else x


class Transformer(nn.Module):
    """Encoder–decoder stacks, batch first, equivalent to ``torch.nn.Transformer(batch_first=True)``.

    As in torch, both stacks end with a LayerNorm (``encoder.norm``, ``decoder.norm``) whether
    ``norm_first`` or not, and matrices are Xavier-uniform initialised. Unlike torch, the decoder's
    self-attention is causal by default (``tgt_is_causal=True``) without building a mask.

    Args: as :class:`~attnlab.nn.block.EncoderLayer` (``dim``, ``num_heads``, ``ffn_dim``, ...),
    plus ``num_encoder_layers`` and ``num_decoder_layers``.
    """

    def __init__(self, dim: int = 512, num_heads: int = 8, *, num_encoder_layers: int = 6,
                 num_decoder_layers: int = 6, ffn_dim: int = 2048, dropout: float = 0.1,
                 activation: str = "relu", norm_first: bool = False, norm: str = "layernorm",
                 norm_eps: float = 1e-5, num_kv_heads: Optional[int] = None, bias: bool = True,
                 backend: str = "auto") -> None:
        super().__init__()
        spec = LayerSpec(dim, num_heads, ffn_dim=ffn_dim, activation=activation, dropout=dropout,
                         norm_first=norm_first, norm=norm, norm_eps=norm_eps, num_kv_heads=num_kv_heads, bias=bias,
                         backend=backend)
        self.encoder = TransformerEncoder(lambda i: EncoderLayer.from_spec(spec), num_encoder_layers,
                                          norm=make_norm(norm, dim, eps=norm_eps))
        self.decoder = TransformerDecoder(lambda i: DecoderLayer.from_spec(spec), num_decoder_layers,
                                          norm=make_norm(norm, dim, eps=norm_eps))
        _xavier_(self)

    def forward(self, src: Tensor, tgt: Tensor, *, src_mask: Optional[Tensor] = None,
                tgt_mask: Optional[Tensor] = None, memory_mask: Optional[Tensor] = None,
                src_key_padding_mask: Optional[Tensor] = None, tgt_key_padding_mask: Optional[Tensor] = None,
                memory_key_padding_mask: Optional[Tensor] = None, tgt_is_causal: bool = True) -> Tensor:
        """``src (B, S, E)``, ``tgt (B, T, E)`` -> ``(B, T, E)``; masks as ``torch.nn.Transformer``."""
        memory = self.encoder(src, key_padding_mask=src_key_padding_mask, attn_mask=src_mask)
        return self.decoder(tgt, memory, tgt_key_padding_mask=tgt_key_padding_mask,
                            memory_key_padding_mask=memory_key_padding_mask, tgt_mask=tgt_mask,
                            memory_mask=memory_mask, is_causal=tgt_is_causal)

    @classmethod
    def from_torch(cls, model: nn.Transformer, *, backend: str = "auto") -> "Transformer":
        """Convert a ``torch.nn.Transformer`` built with its default encoder/decoder (weights copied)."""
        if not isinstance(model, nn.Transformer):
            raise TypeError(f"model must be torch.nn.Transformer, got {type(model).__name__}")
        enc_layers, dec_layers = model.encoder.layers, model.decoder.layers
        first = EncoderLayer.from_torch(enc_layers[0])
        ours = cls(first.dim, first.num_heads, num_encoder_layers=len(enc_layers),
                   num_decoder_layers=len(dec_layers), ffn_dim=first.ffn.w1.out_features,
                   activation=first.ffn.activation, dropout=first.dropout1.p, norm_first=first.norm_first,
                   norm_eps=first.norm1.eps, bias=first.ffn.w1.bias is not None, backend=backend)
        for stack, theirs, convert in ((ours.encoder, enc_layers, EncoderLayer.from_torch),
                                       (ours.decoder, dec_layers, DecoderLayer.from_torch)):
            for layer, torch_layer in zip(stack.layers, theirs):
                layer.load_state_dict(convert(torch_layer).state_dict())
        ours.encoder.norm.load_state_dict(model.encoder.norm.state_dict())
        ours.decoder.norm.load_state_dict(model.decoder.norm.state_dict())
        return ours.train(model.training)


class Seq2SeqTransformer(nn.Module):
    """Token-to-token encoder–decoder Transformer built from a :class:`TransformerConfig`.

    Positions (``config.position``): ``"sinusoidal"`` (one fixed table) or ``"learned"`` (one table
    per side) are added to the scaled embeddings; ``"rope"`` rotates q/k of every self-attention;
    ``"alibi"`` and ``"t5"`` add a score bias to every self-attention (symmetric / bidirectional in
    the encoder, causal in the decoder, one module shared by the layers of a stack, as in T5);
    cross-attention gets no positional signal. Final norms are added when ``norm_first``. Stochastic
    depth grows linearly with depth, ``linspace(0, drop_path, num_layers)`` per stack.

    When ``pad_id`` is set, source positions holding it are masked by default. The config names no
    start or end token: :meth:`generate` takes them as ``decoder_start_token_id`` (the BOS every
    target starts with) and ``eos_token_id``.
    """

    is_encoder_decoder = True  # attnlab.generation encodes the source once

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        if not isinstance(config, TransformerConfig):
            raise TypeError(f"config must be a TransformerConfig, got {type(config).__name__}")
        self.config = c = config
        self.src_embed = nn.Embedding(c.src_vocab_size, c.dim, padding_idx=c.pad_id)
        self.tgt_embed = nn.Embedding(c.tgt_vocab_size, c.dim, padding_idx=c.pad_id)
        self.src_pos = self.tgt_pos = None
        if c.position == "sinusoidal":
            self.src_pos = self.tgt_pos = SinusoidalPositionalEmbedding(c.dim, max_positions=c.max_positions)
        elif c.position == "learned":
            self.src_pos = LearnedPositionalEmbedding(c.max_positions, c.dim)
            self.tgt_pos = LearnedPositionalEmbedding(c.max_positions, c.dim)
        enc_pos, dec_pos = self._attention_positions(c)
        self.dropout = Dropout(c.dropout)
        spec = LayerSpec(c.dim, c.num_heads, ffn_dim=c.ffn_dim, activation=c.activation, dropout=c.dropout,
                         attn_dropout=c.attn_dropout, norm_first=c.norm_first, norm=c.norm, norm_eps=c.norm_eps,
                         num_kv_heads=c.num_kv_heads, bias=c.bias, backend=c.backend)
        enc_spec, dec_spec = replace(spec, **enc_pos), replace(spec, **dec_pos)

        def final_norm() -> Optional[nn.Module]:
            return make_norm(c.norm, c.dim, eps=c.norm_eps) if c.norm_first else None

        def rate(i: int, n: int) -> float:
            return c.drop_path * i / (n - 1) if n > 1 else c.drop_path

        self.encoder = TransformerEncoder(
            lambda i: EncoderLayer.from_spec(replace(enc_spec, drop_path=rate(i, c.num_encoder_layers))),
            c.num_encoder_layers, norm=final_norm())
        self.decoder = TransformerDecoder(
            lambda i: DecoderLayer.from_spec(replace(dec_spec, drop_path=rate(i, c.num_decoder_layers))),
            c.num_decoder_layers, norm=final_norm())
        self.out_proj = nn.Linear(c.dim, c.tgt_vocab_size, bias=False)
        _xavier_(self.encoder)
        _xavier_(self.decoder)
        for embed in (self.src_embed, self.tgt_embed):  # N(0, 1/d): unit variance after × sqrt(d)
            nn.init.normal_(embed.weight, std=c.dim ** -0.5)
            if c.pad_id is not None:
                nn.init.zeros_(embed.weight[c.pad_id])
        if c.tie_embeddings:
            self.out_proj.weight = self.tgt_embed.weight

    @staticmethod
    def _attention_positions(c: TransformerConfig) -> tuple[dict, dict]:
        """``rotary=`` / ``position_bias=`` arguments of the encoder and decoder self-attentions."""
        if c.position == "rope":
            rotary = RotaryEmbedding(c.head_dim, max_positions=c.max_positions)
            return {"rotary": rotary}, {"rotary": rotary}
        if c.position == "alibi":
            return ({"position_bias": ALiBi(c.num_heads, causal=False)},
                    {"position_bias": ALiBi(c.num_heads, causal=True)})
        if c.position == "t5":
            return ({"position_bias": T5RelativeBias(c.num_heads, bidirectional=True)},
                    {"position_bias": T5RelativeBias(c.num_heads, bidirectional=False)})
        return {}, {}

    def padding_mask(self, ids: Tensor) -> Optional[Tensor]:
        """``ids == pad_id`` (True = padding), or None without a ``pad_id``."""
        return None if self.config.pad_id is None else ids == self.config.pad_id

    def embed_source(self, src_ids: Tensor) -> Tensor:
        """``Embed_src(ids) · sqrt(d) + PE(0..S-1)``, then dropout: the encoder input ``(B, S, E)``."""
        return self._embed(src_ids, self.src_embed, self.src_pos)

    def embed_target(self, tgt_ids: Tensor, *, offset: int = 0) -> Tensor:
        """The decoder input ``(B, T, E)`` for tokens at positions ``offset .. offset + T - 1``."""
        return self._embed(tgt_ids, self.tgt_embed, self.tgt_pos, offset)

    def _embed(self, ids: Tensor, embed: nn.Embedding, pos: Optional[nn.Module], offset: int = 0) -> Tensor:
        if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.is_floating_point():
            raise ValueError(f"token ids must be an integer tensor (B, L), got {ids.dtype} {tuple(ids.shape)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= embed.num_embeddings):
            raise ValueError(f"token ids must lie in [0, vocab_size={embed.num_embeddings}), got values in "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        x = embed(ids) * math.sqrt(self.config.dim)  # (B, L, E)
        if pos is not None:  # the table raises a ValueError past max_positions
            x = x + pos(torch.arange(offset, offset + ids.shape[1], device=ids.device)).to(x.dtype)
        return self.dropout(x)

    def encode(self, src_ids: Tensor, attention_mask: Optional[Tensor] = None, *,
               src_key_padding_mask: Optional[Tensor] = None) -> Tensor:
        """``src_ids (B, S)`` -> memory ``(B, S, E)``.

        The padding is ``attention_mask`` (1 = token, 0 = padding, as :meth:`generate`) or
        ``src_key_padding_mask`` (True = padding, as :meth:`forward`); default :meth:`padding_mask`.

        Raises:
            ValueError: both masks are given, or ``attention_mask`` is not a 0/1 ``(B, S)`` tensor.
        """
        if attention_mask is not None:
            if src_key_padding_mask is not None:
                raise ValueError("give attention_mask or src_key_padding_mask, not both")
            check_attention_mask(attention_mask, tuple(src_ids.shape))
            src_key_padding_mask = attention_mask == 0
        elif src_key_padding_mask is None:
            src_key_padding_mask = self.padding_mask(src_ids)
        return self.encoder(self.embed_source(src_ids), key_padding_mask=src_key_padding_mask)

    def forward(self, src_ids: Tensor, tgt_ids: Tensor, *, src_key_padding_mask: Optional[Tensor] = None,
                tgt_key_padding_mask: Optional[Tensor] = None, output_attentions: bool = False
                ) -> Union[Tensor, Seq2SeqLMOutput]:
        """Teacher-forced logits ``(B, T, V_tgt)`` for ``src_ids (B, S)``, ``tgt_ids (B, T)``.

        ``src_key_padding_mask`` defaults to ``src_ids == pad_id``; target padding needs no mask
        (causal attention keeps it out of earlier positions) but may be given. With
        ``output_attentions`` returns a :class:`Seq2SeqLMOutput` (``logits``, ``encoder_last_hidden_state``
        and per layer ``(B, H, Lq, Lk)`` ``encoder_attentions``, ``decoder_attentions``, ``cross_attentions``).
        """
        if src_key_padding_mask is None:
            src_key_padding_mask = self.padding_mask(src_ids)
        if not output_attentions:
            memory = self.encode(src_ids, src_key_padding_mask=src_key_padding_mask)
            return self.out_proj(self.decoder(self.embed_target(tgt_ids), memory, tgt_key_padding_mask=tgt_key_padding_mask,
                                              memory_key_padding_mask=src_key_padding_mask))
        memory, enc_w = self.encoder(self.embed_source(src_ids), key_padding_mask=src_key_padding_mask, need_weights=True)
        h, dec_w = self.decoder(self.embed_target(tgt_ids), memory, tgt_key_padding_mask=tgt_key_padding_mask,
                                memory_key_padding_mask=src_key_padding_mask, need_weights=True)
        return Seq2SeqLMOutput(self.out_proj(h), memory, encoder_attentions=tuple(w.self_attn for w in enc_w),
                               decoder_attentions=tuple(w.self_attn for w in dec_w),
                               cross_attentions=tuple(w.cross_attn for w in dec_w))

    # ---- generation (the encoder–decoder protocol of attnlab.generation) -------------------

    def new_cache(self, *, max_length: Optional[int] = None) -> list[LayerCache]:
        """Empty per-decoder-layer caches; ``max_length`` preallocates the self-attention ones."""
        return self.decoder.new_cache(max_length=max_length)

    def decode(self, tgt_ids: Tensor, memory: Tensor, *, attention_mask: Optional[Tensor] = None,
               cache: Optional[list[LayerCache]] = None) -> Tensor:
        """Logits ``(B, T, V)`` of the target tokens ``tgt_ids (B, T)`` on ``memory (B, S, E)``.

        With ``cache`` (:meth:`new_cache`, updated in place) they continue the cached prefix and their
        positions start at its length. ``attention_mask`` is the source's ``(B, S)`` (1 = token).
        """
        past = 0 if cache is None else cache[0].self_attn.length
        check_attention_mask(attention_mask, tuple(memory.shape[:2]))
        kpm = None if attention_mask is None else attention_mask == 0
        h = self.decoder(self.embed_target(tgt_ids, offset=past), memory, memory_key_padding_mask=kpm, cache=cache)
        return self.out_proj(h)

    @property
    def generation_defaults(self) -> dict[str, Optional[int]]:
        """No start or end token (the config names none); ``pad_token_id`` is ``config.pad_id``."""
        return dict(decoder_start_token_id=None, eos_token_id=None, pad_token_id=self.config.pad_id)

    def generate(self, src_ids: Tensor, **kwargs) -> Tensor:
        """:func:`attnlab.generation.generate` from the source ``src_ids (B, S)`` (call ``eval()`` first).

        Args:
            kwargs: :func:`~attnlab.generation.generate`'s arguments, as keywords or a ``config``:
                ``decoder_start_token_id`` (the BOS token every target starts with; required, the model
                names none), ``eos_token_id`` (a row ends at this token and is then filled with
                ``pad_token_id``, default ``config.pad_id``; None: rows run for ``max_new_tokens``),
                ``max_new_tokens``, ``num_beams``, ``do_sample``, ...; ``attention_mask`` defaults to
                ``src_ids != pad_id``.

        Returns:
            ``(B, 1 + n)`` ids: ``decoder_start_token_id`` then ``n <= max_new_tokens`` tokens.
        """
        from attnlab.generation import generate
        pad = self.config.pad_id
        if kwargs.get("attention_mask") is None and pad is not None and isinstance(src_ids, Tensor) \
                and bool((src_ids == pad).any()):
            kwargs["attention_mask"] = (src_ids != pad).long()  # as forward's default
        return generate(self, src_ids, **kwargs)  # a keyword given wins over a config's field, as in generate


def _xavier_(module: nn.Module) -> None:
    """Xavier-uniform on every Linear weight, as ``torch.nn.Transformer._reset_parameters`` (whose
    matrices are all projections); position-bias tables keep their own initialisation."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)


def _check_num_layers(num_layers: int) -> None:
    positive_int("num_layers", num_layers)
