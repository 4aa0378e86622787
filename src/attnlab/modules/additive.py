"""Additive attention (Bahdanau, Cho & Bengio 2015), and the helpers every classic
score-based module shares: input checks and the mask -> normalise -> weighted-sum tail of the
pipeline for scores that are not dot products.

::

    e_ij = vᵀ tanh(W_q q_i + W_k k_j)
    α_ij = normalize_j(e_ij)            # softmax by default
    c_i  = Σ_j α_ij v_j
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from attnlab._checks import positive_int
from attnlab._limits import check_elements
from attnlab.functional.scores import check_normalize, prepare_inputs, score_attention


class AdditiveAttention(nn.Module):
    """Additive attention of Bahdanau et al. (2015), "Neural Machine Translation by Jointly
    Learning to Align and Translate"::

        e_ij = vᵀ tanh(W_q q_i + W_k k_j)
        α_ij = softmax_j(e_ij)              # or another normaliser, see ``normalize``
        c_i  = Σ_j α_ij v_j

    ``W_q``, ``W_k`` and ``v`` carry no bias, exactly as the formula.

    Args:
        query_dim: ``Dq``, the size of a query (the decoder state ``s_{i-1}`` in the paper).
        key_dim: ``Dk``, the size of a key (the annotation ``h_j``).
        hidden_dim: the size of the hidden layer inside ``tanh``.
        value_dim: ``Dv``, the size of a value; defaults to ``key_dim`` (keys are the values).
        normalize: a name in :data:`attnlab.functional.normalize.NORMALIZERS`.
        top_k: scores kept per row with ``normalize="topk"``.

    Raises:
        ValueError: a size is not a positive int, or ``normalize`` / ``top_k`` is invalid.
    """

    def __init__(self, query_dim: int, key_dim: int, hidden_dim: int, *, value_dim: Optional[int] = None,
                 normalize: str = "softmax", top_k: Optional[int] = None):
        super().__init__()
        value_dim = key_dim if value_dim is None else value_dim
        for name, value in (("query_dim", query_dim), ("key_dim", key_dim), ("hidden_dim", hidden_dim),
                            ("value_dim", value_dim)):
            positive_int(name, value)
        check_elements(f"AdditiveAttention(query_dim={query_dim}, key_dim={key_dim}, hidden_dim={hidden_dim})",
                       query_dim + key_dim + 1, hidden_dim)
        check_normalize(normalize, top_k)
        self.query_dim, self.key_dim, self.value_dim = query_dim, key_dim, value_dim
        self.normalize, self.top_k = normalize, top_k
        self.W_q = nn.Linear(query_dim, hidden_dim, bias=False)
        self.W_k = nn.Linear(key_dim, hidden_dim, bias=False)
        self.v = nn.Linear(hidden_dim, 1, bias=False)

    def forward(self, query: Tensor, keys: Tensor, values: Optional[Tensor] = None, *,
                mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """Attend from each query to the keys.

        Args:
            query: ``(B, Lq, Dq)``, or ``(B, Dq)`` for one decoder step.
            keys: ``(B, Lk, Dk)``.
            values: ``(B, Lk, Dv)``; defaults to ``keys``.
            mask: bool, True = may attend, broadcastable to ``(B, Lq, Lk)``, or ``(B, Lk)``.

        Returns:
            ``(context, weights)``: ``(B, Lq, Dv)`` and ``(B, Lq, Lk)``, or ``(B, Dv)`` and
            ``(B, Lk)`` for a 2-D query.
        """
        q, keys, values, mask, one_step = prepare_inputs(
            query, keys, values, mask, query_dim=self.query_dim, key_dim=self.key_dim, value_dim=self.value_dim)
        hidden = torch.tanh(self.W_q(q).unsqueeze(2) + self.W_k(keys).unsqueeze(1))  # (B, Lq, Lk, hidden)
        scores = self.v(hidden).squeeze(-1)  # (B, Lq, Lk)
        context, weights = score_attention(scores, values, mask=mask, normalize=self.normalize, top_k=self.top_k)
        if one_step:
            return context.squeeze(1), weights.squeeze(1)
        return context, weights
