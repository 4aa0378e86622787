"""T5's layers: unscaled attention with the relative position bias, the (gated) feed-forward, the stacks.

::

    Attn(Q, K, V) = softmax(Q Kᵀ + B) V        (no 1/sqrt(d) scaling: folded into W_Q)
    B[h, i, j] = W_rel[bucket(j - i), h]       (one table per stack, shared by its layers)

Attention runs through :func:`attnlab.attention` with ``scale=1.0``. The bias is an additive float mask
``(1, H, L, S)`` for SDPA while it is small (:func:`attnlab.backends.dispatch.position_bias_terms`); beyond that it is a ``score_mod`` that the
tiled backend evaluates block by block (memory O(L) instead of O(L²)). Attention weights
(``output_attentions``) are recovered from q, k and the log-sum-exp (:func:`attnlab.attention_weights`);
the forward pass keeps its fast backend. The model and its config are in :mod:`attnlab.models.t5`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.backends.dispatch import attention, attention_weights, position_bias_terms
from attnlab.functional.request import ScoreMod
from attnlab.nn.block import LayerCache
from attnlab.attention.cache import KVCache
from attnlab.nn.dropout import Dropout
from attnlab.nn.feedforward import ACTIVATIONS
from attnlab.nn.norms import RMSNorm
from attnlab.nn.positional import T5RelativeBias

if TYPE_CHECKING:
    from attnlab.models.t5 import T5Config


class T5Attention(nn.Module):
    """``softmax(Q Kᵀ + mask + bias) V`` over ``H`` heads of width ``d_kv`` (inner dim ``H·d_kv``, may
    differ from ``d_model``); projections ``q, k, v, o`` without bias; unscaled scores."""

    def __init__(self, d_model: int, num_heads: int, d_kv: int, *, dropout: float = 0.0) -> None:
        super().__init__()
        self.num_heads, self.d_kv, self.dropout = num_heads, d_kv, dropout
        inner = num_heads * d_kv
        self.q = nn.Linear(d_model, inner, bias=False)
        self.k = nn.Linear(d_model, inner, bias=False)
        self.v = nn.Linear(d_model, inner, bias=False)
        self.o = nn.Linear(inner, d_model, bias=False)

    def forward(self, x: Tensor, memory: Optional[Tensor] = None, *, mask: Optional[Tensor] = None,
                score_mod: Optional[ScoreMod] = None, causal: bool = False, cache: Optional[KVCache] = None,
                need_weights: bool = False) -> tuple[Tensor, Optional[Tensor]]:
        """``x (B, L, E)`` attends to itself or to ``memory (B, S, E)``; ``cache`` holds past keys/values.

        Returns ``(out (B, L, E), weights)``: the per-head weights ``(B, H, L, S)`` with ``need_weights``
        (recovered from the log-sum-exp, :func:`attnlab.attention_weights`), else None.
        """
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
        out = attention(q, k, v, mask=mask, score_mod=score_mod, causal=causal, scale=1.0,
                        dropout_p=self.dropout if self.training else 0.0)  # (B, H, L, D)
        weights = None
        if need_weights:
            with torch.no_grad():
                weights = attention_weights(q, k, mask=mask, score_mod=score_mod, causal=causal, scale=1.0)
        return self.o(out.transpose(1, 2).reshape(B, L, H * D)), weights  # (B, L, E)


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
        self.dropout = Dropout(dropout)

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
        self.dropout = Dropout(c.dropout_rate)

    def forward(self, x: Tensor, self_mask: Optional[Tensor], *, score_mod: Optional[ScoreMod] = None,
                causal: bool = False, memory: Optional[Tensor] = None, memory_mask: Optional[Tensor] = None,
                cache: Optional[LayerCache] = None, need_weights: bool = False
                ) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        """``(x, self-attention weights, cross-attention weights)``; the weights with ``need_weights``."""
        h, self_w = self.self_attn(self.self_norm(x), mask=self_mask, score_mod=score_mod, causal=causal,
                                   cache=None if cache is None else cache.self_attn, need_weights=need_weights)
        x = x + self.dropout(h)
        cross_w = None
        if memory is not None:
            h, cross_w = self.cross_attn(self.cross_norm(x), memory, mask=memory_mask, need_weights=need_weights,
                                         cache=None if cache is None else cache.cross_attn)
            x = x + self.dropout(h)
        return x + self.dropout(self.ffn(self.ffn_norm(x))), self_w, cross_w


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
        self.dropout = Dropout(config.dropout_rate)

    def self_attention_bias(self, L: int, past: int, key_mask: Optional[Tensor], dtype: torch.dtype
                            ) -> tuple[Optional[Tensor], Optional[ScoreMod]]:
        """``(mask, score_mod)`` of the self-attention of ``L`` queries after ``past`` cached positions.

        Short inputs: the bias ``B[h, i, j]`` with padded keys at -inf as one dense float mask
        ``(B | 1, H, L, past + L)`` (SDPA). When ``H·L·(past + L)`` is large (:func:`~attnlab.backends.dispatch.position_bias_terms`): the bias as a
        ``score_mod`` (tiled backend, block by block) and only the padding as a ``(B, 1, 1, S)`` bool mask.
        """
        S = past + L
        device = self.relative_bias.relative_attention_bias.weight.device
        keep = None if key_mask is None else key_mask[:, None, None, :].bool()  # (B, 1, 1, S), True = token
        bias, score_mod = position_bias_terms(self.relative_bias, backend="auto", heads=self.relative_bias.num_heads,
                                              q_len=L, k_len=S, device=device, dtype=dtype)  # (1, H, L, S)
        if bias is None:
            return keep, score_mod
        return (bias if keep is None else bias.masked_fill(~keep, float("-inf"))), None

    def forward(self, x: Tensor, key_mask: Optional[Tensor], *, memory: Optional[Tensor] = None,
                memory_mask: Optional[Tensor] = None, caches: Optional[list[LayerCache]] = None,
                need_weights: bool = False) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """``x (B, L, E)`` embeddings; ``key_mask (B, past + L)`` 1 = token, 0 = padding (or None).

        Returns ``(h (B, L, E), self-attention weights, cross-attention weights)``, one ``(B, H, L, ·)``
        tensor per layer in each list with ``need_weights`` (empty lists otherwise).
        """
        L = x.shape[1]
        past = 0 if caches is None else caches[0].self_attn.length
        mask, score_mod = self.self_attention_bias(L, past, key_mask, x.dtype)
        mem_mask = None if memory_mask is None else memory_mask[:, None, None, :].bool()  # (B, 1, 1, S)
        x = self.dropout(x)
        self_ws, cross_ws = [], []
        for i, layer in enumerate(self.layers):
            x, self_w, cross_w = layer(x, mask, score_mod=score_mod, causal=self.decoder and L > 1, memory=memory,
                                       memory_mask=mem_mask, cache=None if caches is None else caches[i],
                                       need_weights=need_weights)
            if need_weights:
                self_ws.append(self_w)
                if cross_w is not None:
                    cross_ws.append(cross_w)
        return self.dropout(self.final_norm(x)), self_ws, cross_ws
