"""Location-aware attention: Chorowski, Bahdanau, Serdyuk, Cho & Bengio (2015),
"Attention-Based Models for Speech Recognition". The scorer sees where it attended before::

    f_i  = F * α_{i-1}                                    # 1-D convolution over the previous alignment
    e_ij = wᵀ tanh(W s_{i-1} + V h_j + U f_ij + b)
    α_ij = softmax_j(e_ij),   c_i = Σ_j α_ij h_j
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from attnlab._checks import boolean, positive_int
from attnlab._limits import check_elements
from attnlab.functional.scores import check_normalize, prepare_inputs, score_attention


class LocationAwareAttention(nn.Module):
    """Location-aware attention of Chorowski et al. (2015), one decoder step at a time::

        f_i  = F * α_{i-1}                              # f_ij ∈ R^C: C filters of odd width r
        e_ij = wᵀ tanh(W s_{i-1} + V h_j + U f_ij + b)
        α_ij = softmax_j(e_ij),   c_i = Σ_j α_ij v_j

    The convolution is PyTorch's (a cross-correlation, zero padding ``(r - 1) / 2`` on each
    side, no bias): ``f_ij[c] = Σ_t F[c, t] α_{i-1, j + t - (r-1)/2}``, so ``f_i`` has one
    feature vector per key. ``W``, ``V``, ``U`` and ``w`` carry no bias; ``b`` is the one bias.

    With ``cumulative=True`` (as in Tacotron 2 and many ASR decoders) the convolution is meant
    to see the sum of all previous alignments ``Σ_{k<i} α_k`` instead of ``α_{i-1}``. The
    module keeps no state: the caller passes that sum as ``prev_weights``, and
    :meth:`accumulate` computes the next one either way::

        prev = None
        for s in decoder_states:                     # s: (B, query_dim)
            context, weights = attn(s, keys, prev, mask=mask)
            prev = attn.accumulate(prev, weights)    # α_i, or Σ_{k≤i} α_k when cumulative

    Args:
        query_dim: size of the decoder state ``s_{i-1}``.
        key_dim: size of an encoder state ``h_j``.
        hidden_dim: size of the hidden layer inside ``tanh``.
        conv_channels: ``C``, the number of convolution filters.
        kernel_size: ``r``, the (odd) filter width, so that ``f_ij`` is centred on key ``j``.
        cumulative: whether ``prev_weights`` is the cumulative alignment (see above).
        value_dim: size of a value; defaults to ``key_dim`` (keys are the values).
        normalize: a name in :data:`attnlab.functional.normalize.NORMALIZERS`.
        top_k: scores kept per row with ``normalize="topk"``.

    Raises:
        ValueError: a size or ``conv_channels`` is not a positive int, ``kernel_size`` is not a
            positive odd int, or ``normalize`` / ``top_k`` is invalid.
    """

    def __init__(self, query_dim: int, key_dim: int, hidden_dim: int, *, conv_channels: int = 10,
                 kernel_size: int = 31, cumulative: bool = False, value_dim: Optional[int] = None,
                 normalize: str = "softmax", top_k: Optional[int] = None):
        super().__init__()
        value_dim = key_dim if value_dim is None else value_dim
        for name, value in (("query_dim", query_dim), ("key_dim", key_dim), ("hidden_dim", hidden_dim),
                            ("value_dim", value_dim), ("conv_channels", conv_channels), ("kernel_size", kernel_size)):
            positive_int(name, value)
        if kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd (so f_ij is centred on key j), got {kernel_size}")
        check_elements(f"LocationAwareAttention(query_dim={query_dim}, key_dim={key_dim}, hidden_dim={hidden_dim}, "
                       f"conv_channels={conv_channels})", query_dim + key_dim + conv_channels + 2, hidden_dim)
        boolean("cumulative", cumulative)
        check_normalize(normalize, top_k)
        self.query_dim, self.key_dim, self.value_dim = query_dim, key_dim, value_dim
        self.cumulative, self.normalize, self.top_k = cumulative, normalize, top_k
        self.F = nn.Conv1d(1, conv_channels, kernel_size, padding=kernel_size // 2, bias=False)
        self.W = nn.Linear(query_dim, hidden_dim, bias=False)
        self.V = nn.Linear(key_dim, hidden_dim, bias=False)
        self.U = nn.Linear(conv_channels, hidden_dim, bias=False)
        self.b = nn.Parameter(torch.zeros(hidden_dim))
        self.w = nn.Linear(hidden_dim, 1, bias=False)

    def forward(self, query: Tensor, keys: Tensor, prev_weights: Optional[Tensor] = None, *,
                values: Optional[Tensor] = None, mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """One decoder step.

        Args:
            query: the decoder state ``s_{i-1}``, ``(B, Dq)``.
            keys: the encoder states ``h``, ``(B, Lk, Dk)``.
            prev_weights: ``α_{i-1}`` (or ``Σ_{k<i} α_k`` when ``cumulative``), ``(B, Lk)``.
                ``None`` means zeros, i.e. no alignment yet: ``f_i = 0`` (the convolution has no
                bias), so the first step scores by content alone.
            values: ``(B, Lk, Dv)``; defaults to ``keys``.
            mask: bool ``(B, Lk)`` (or broadcastable to it), True = may attend.

        Returns:
            ``(context (B, Dv), weights (B, Lk))``; a row with nothing to attend to is zeros.

        Raises:
            ValueError: on a shape mismatch (see also :func:`prepare_inputs`).
        """
        q, keys, values, mask, _ = prepare_inputs(query, keys, values, mask, query_dim=self.query_dim,
                                                  key_dim=self.key_dim, value_dim=self.value_dim, step_only=True)
        B, Lk = keys.shape[0], keys.shape[1]
        if prev_weights is None:
            prev_weights = keys.new_zeros(B, Lk)
        elif not isinstance(prev_weights, Tensor) or prev_weights.shape != (B, Lk):
            got = tuple(prev_weights.shape) if isinstance(prev_weights, Tensor) else type(prev_weights).__name__
            raise ValueError(f"prev_weights must have shape (B, Lk) = {(B, Lk)}, got {got}")
        elif not prev_weights.is_floating_point():
            raise TypeError(f"prev_weights must be a floating-point tensor (an alignment), got {prev_weights.dtype}")
        f = self.F(prev_weights.unsqueeze(1)).transpose(1, 2)  # (B, 1, Lk) -> (B, C, Lk) -> (B, Lk, C)
        hidden = torch.tanh(self.W(q) + self.V(keys) + self.U(f) + self.b)  # (B, 1, hid) + (B, Lk, hid)
        scores = self.w(hidden).transpose(1, 2)  # (B, 1, Lk)
        context, weights = score_attention(scores, values, mask=mask, normalize=self.normalize, top_k=self.top_k)
        return context.squeeze(1), weights.squeeze(1)  # (B, Dv), (B, Lk)

    def accumulate(self, prev_weights: Optional[Tensor], weights: Tensor) -> Tensor:
        """The ``prev_weights`` for the next step: ``α_i``, or ``Σ_{k≤i} α_k`` when ``cumulative``."""
        if self.cumulative and prev_weights is not None:
            return prev_weights + weights
        return weights
