"""T5's stacks, built from the shared layers (:class:`~attnlab.nn.block.EncoderLayer` /
:class:`~attnlab.nn.block.DecoderLayer` with :class:`~attnlab.modules.multihead.MultiheadAttention`).

::

    Attn(Q, K, V) = softmax(Q Kᵀ + B) V        (scale=1: T5 folds 1/sqrt(d) into W_Q)
    B[h, i, j] = W_rel[bucket(j - i), h]       (one table per stack, shared by its layers)
    x = x + Dropout(F(RMSNorm(x)))             (pre-norm residual; no biases anywhere)
    FFN: relu, or gated gelu_tanh ("gated-gelu", T5 v1.1: activation "geglu_tanh")

The stack's :class:`~attnlab.nn.positional.T5RelativeBias` is every self-attention's ``position_bias``
(through :class:`SharedPositionBias`, so the table is stored once, under the stack, where HF keeps it
in block 0). ``MultiheadAttention`` adds it as a dense bias ``(1, H, L, S)`` for SDPA while
it is small and passes its ``score_mod`` to the tiled backend beyond (:func:`attnlab.backends.dispatch.position_bias_terms`; memory O(L)
instead of O(L²)); within one stack forward the dense bias is computed once and shared by the layers.
The model and its config are in :mod:`attnlab.models.t5`.
"""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Iterator, Optional

from torch import Tensor, nn

from attnlab.functional.request import ScoreMod
from attnlab.nn.block import DecoderLayer, EncoderLayer, LayerCache, LayerSpec
from attnlab.nn.dropout import Dropout
from attnlab.nn.norms import RMSNorm
from attnlab.nn.positional import T5RelativeBias


class SharedPositionBias:
    """A position-bias module lent to several attentions as their ``position_bias`` without becoming their
    submodule (its parameters stay with its owner, stored once), computing ``bias(q_positions,
    k_positions)`` once per position ranges within :meth:`reuse`.

    Args:
        bias: the module, e.g. :class:`T5RelativeBias`: ``bias(q_positions, k_positions) -> (1, H, Lq, Lk)``
            and ``bias.score_mod()``.
    """

    def __init__(self, bias: nn.Module) -> None:
        self.bias = bias
        self._memo: Optional[dict] = None

    def __call__(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        """``bias(q_positions, k_positions)``, contiguous (the table lookup leaves the heads innermost, a
        layout that the masks combined with it inherit and that SDPA reads at half speed)."""
        if self._memo is None:
            return self.bias(q_positions, k_positions).contiguous()
        key = (len(q_positions), int(q_positions[0]), len(k_positions), int(k_positions[0]), q_positions.device)
        if key not in self._memo:
            self._memo[key] = self.bias(q_positions, k_positions).contiguous()
        return self._memo[key]

    def score_mod(self) -> ScoreMod:
        """The bias as a ``score_mod`` (see :meth:`T5RelativeBias.score_mod`)."""
        return self.bias.score_mod()

    @contextmanager
    def reuse(self) -> Iterator[None]:
        """Within the block, each ``(q_positions, k_positions)`` range is computed once (one stack forward:
        every layer asks for the same bias)."""
        self._memo = {}
        try:
            yield
        finally:
            self._memo = None


class T5Stack(nn.Module):
    """Pre-RMSNorm layers sharing one relative bias, then the final RMSNorm and dropout.

    The encoder's layers are :class:`EncoderLayer` (bidirectional bias), the decoder's
    :class:`DecoderLayer` (causal bias, cross-attention without a bias): unscaled attention
    (``scale=1``) over ``num_heads`` heads of width ``d_kv`` (inner width ``H·d_kv`` may differ from
    ``d_model``), no biases, feed-forward ``relu`` or gated ``gelu_tanh``.

    Args:
        spec: every layer's options (:class:`~attnlab.models.t5.T5ForConditionalGeneration` builds it from its
            config); its ``position_bias`` is set here to the stack's shared relative bias.
        num_layers: layers in the stack.
        decoder: causal self-attention and cross-attention (else bidirectional self-attention only).
        num_buckets, max_distance: the relative bias's buckets (:class:`T5RelativeBias`).
    """

    def __init__(self, spec: LayerSpec, num_layers: int, *, decoder: bool, num_buckets: int,
                 max_distance: int) -> None:
        super().__init__()
        self.decoder = decoder
        self.relative_bias = T5RelativeBias(spec.num_heads, bidirectional=not decoder, num_buckets=num_buckets,
                                            max_distance=max_distance)
        self.position_bias = SharedPositionBias(self.relative_bias)
        spec = dataclasses.replace(spec, position_bias=self.position_bias)
        layer = DecoderLayer if decoder else EncoderLayer
        self.layers = nn.ModuleList([layer.from_spec(spec) for _ in range(num_layers)])
        self.final_norm = RMSNorm(spec.dim, eps=spec.norm_eps)
        self.dropout = Dropout(spec.dropout)

    def forward(self, x: Tensor, key_mask: Optional[Tensor], *, memory: Optional[Tensor] = None,
                memory_mask: Optional[Tensor] = None, caches: Optional[list[LayerCache]] = None,
                need_weights: bool = False) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """``x (B, L, E)`` embeddings; ``key_mask (B, past + L)`` 1 = token, 0 = padding (or None);
        ``memory (B, S, E)`` and its ``memory_mask (B, S)`` for the decoder.

        Returns ``(h (B, L, E), self-attention weights, cross-attention weights)``, one ``(B, H, L, ·)``
        tensor per layer in each list with ``need_weights`` (empty lists otherwise).
        """
        L = x.shape[1]
        pad = None if key_mask is None else ~key_mask.bool()  # (B, past + L), True = padding
        mem_pad = None if memory_mask is None else ~memory_mask.bool()  # (B, S)
        x = self.dropout(x)
        self_ws, cross_ws = [], []
        with self.position_bias.reuse():
            for i, layer in enumerate(self.layers):
                if self.decoder:
                    out = layer(x, memory, tgt_key_padding_mask=pad, memory_key_padding_mask=mem_pad,
                                is_causal=bool(L > 1), cache=None if caches is None else caches[i],
                                need_weights=need_weights)
                else:
                    out = layer(x, key_padding_mask=pad, need_weights=need_weights)
                if need_weights:
                    x, weights = out
                    self_ws.append(weights.self_attn)
                    if weights.cross_attn is not None:
                        cross_ws.append(weights.cross_attn)
                else:
                    x = out
        return self.dropout(self.final_norm(x)), self_ws, cross_ws
