"""Multiplicative (Luong) attention: Luong, Pham & Manning (2015), "Effective Approaches to
Attention-based Neural Machine Translation", global attention with its three score functions::

    dot      score(h_t, h_s) = h_tᵀ h_s
    general  score(h_t, h_s) = h_tᵀ W_a h_s
    concat   score(h_t, h_s) = v_aᵀ tanh(W_a [h_t; h_s])

    a_t(s) = softmax_s(score(h_t, h_s)),   c_t = Σ_s a_t(s) v_s

``dot`` and ``general`` are dot products and run through the shared pipeline
(:func:`attnlab.attention` with ``scale=1.0`` and one head); ``concat`` is
not, and goes through the same mask -> normalise -> weighted-sum tail on its own scores.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab._checks import one_of, positive_int
from attnlab._limits import check_elements
from attnlab.backends.dispatch import attention
from attnlab.functional.scores import check_normalize, prepare_inputs, score_attention

MODES = ("dot", "general", "concat")


class LuongAttention(nn.Module):
    """Global attention of Luong et al. (2015) with the ``dot``, ``general`` or ``concat`` score::

        dot      e_ts = h_tᵀ h_s                      (needs query_dim == key_dim)
        general  e_ts = h_tᵀ W_a h_s                  (W_a: query_dim × key_dim)
        concat   e_ts = v_aᵀ tanh(W_a [h_t; h_s])     (W_a: hidden_dim × (query_dim + key_dim))
        α_ts = softmax_s(e_ts),   c_t = Σ_s α_ts v_s

    No score is scaled (``κ = 1``) and no weight carries a bias, exactly as the formulas.
    The attentional state ``h̃_t = tanh(W_c [c_t; h_t])`` of the paper is the decoder's job.

    Args:
        query_dim: size of the decoder state ``h_t``.
        key_dim: size of an encoder state ``h_s``.
        mode: ``"dot"``, ``"general"`` (the default) or ``"concat"``.
        hidden_dim: size of ``v_a`` with ``mode="concat"``; defaults to ``query_dim``. Only
            used by ``concat``.
        value_dim: size of a value; defaults to ``key_dim`` (keys are the values).
        normalize: a name in :data:`attnlab.functional.normalize.NORMALIZERS`.
        top_k: scores kept per row with ``normalize="topk"``.

    Raises:
        ValueError: unknown ``mode``; ``mode="dot"`` with ``query_dim != key_dim``;
            ``hidden_dim`` given to ``dot``/``general`` or not a positive int; a size, ``normalize``
            or ``top_k`` is invalid.
    """

    def __init__(self, query_dim: int, key_dim: int, *, mode: str = "general", hidden_dim: Optional[int] = None,
                 value_dim: Optional[int] = None, normalize: str = "softmax", top_k: Optional[int] = None):
        super().__init__()
        value_dim = key_dim if value_dim is None else value_dim
        for name, value in (("query_dim", query_dim), ("key_dim", key_dim), ("value_dim", value_dim)):
            positive_int(name, value)
        one_of("mode", mode, MODES)
        positive_int("hidden_dim", hidden_dim, optional=True)
        check_elements(f"LuongAttention(query_dim={query_dim}, key_dim={key_dim}, hidden_dim={hidden_dim})",
                       query_dim + key_dim + 1, hidden_dim or query_dim)
        if mode == "dot" and query_dim != key_dim:
            raise ValueError(f"mode='dot' needs query_dim == key_dim, got query_dim={query_dim}, key_dim={key_dim} "
                             "(use mode='general' to compare vectors of different sizes)")
        if mode != "concat" and hidden_dim is not None:
            raise ValueError(f"hidden_dim is only used with mode='concat' (mode={mode!r}, hidden_dim={hidden_dim!r})")
        check_normalize(normalize, top_k)
        self.query_dim, self.key_dim, self.value_dim = query_dim, key_dim, value_dim
        self.mode, self.normalize, self.top_k = mode, normalize, top_k
        if mode == "general":
            self.W_a = nn.Linear(key_dim, query_dim, bias=False)  # weight is W_a: (Dq, Dk)
        elif mode == "concat":
            hidden_dim = query_dim if hidden_dim is None else hidden_dim
            positive_int("hidden_dim", hidden_dim)
            self.W_a = nn.Linear(query_dim + key_dim, hidden_dim, bias=False)
            self.v_a = nn.Linear(hidden_dim, 1, bias=False)

    def forward(self, query: Tensor, keys: Tensor, values: Optional[Tensor] = None, *,
                mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """Attend from each decoder state to the encoder states.

        Args:
            query: ``(B, Lq, Dq)``, or ``(B, Dq)`` for one decoder step.
            keys: ``(B, Lk, Dk)``.
            values: ``(B, Lk, Dv)``; defaults to ``keys``.
            mask: bool, True = may attend, broadcastable to ``(B, Lq, Lk)``, or ``(B, Lk)``.

        Returns:
            ``(context, weights)``: ``(B, Lq, Dv)`` and ``(B, Lq, Lk)``, or ``(B, Dv)`` and
            ``(B, Lk)`` for a 2-D query. Rows with nothing to attend to are zeros.
        """
        q, keys, values, mask, one_step = prepare_inputs(
            query, keys, values, mask, query_dim=self.query_dim, key_dim=self.key_dim, value_dim=self.value_dim)
        if self.mode == "concat":
            W_q, W_k = self.W_a.weight.split([self.query_dim, self.key_dim], dim=1)
            # W_a [h_t; h_s] = W_q h_t + W_k h_s
            hidden = torch.tanh(F.linear(q, W_q).unsqueeze(2) + F.linear(keys, W_k).unsqueeze(1))  # (B, Lq, Lk, hid)
            scores = self.v_a(hidden).squeeze(-1)  # (B, Lq, Lk)
            context, weights = score_attention(scores, values, mask=mask, normalize=self.normalize, top_k=self.top_k)
        else:
            k = keys if self.mode == "dot" else self.W_a(keys)  # (B, Lk, Dq): W_a h_s
            context, weights = attention(
                q.unsqueeze(1), k.unsqueeze(1), values.unsqueeze(1),  # one head: (B, 1, L, D)
                mask=None if mask is None else mask.unsqueeze(1), scale=1.0,
                normalize=self.normalize, top_k=self.top_k, return_weights=True)
            context, weights = context.squeeze(1), weights.squeeze(1)  # (B, Lq, Dv), (B, Lq, Lk)
        if one_step:
            return context.squeeze(1), weights.squeeze(1)
        return context, weights
