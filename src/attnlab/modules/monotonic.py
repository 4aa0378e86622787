"""Hard monotonic attention: Raffel, Luong, Liu, Weiss & Eck (2017), "Online and Linear-Time
Attention by Enforcing Monotonic Alignments".

At output step ``i`` the decoder scans the memory left to right from where it stopped at step
``i - 1`` and stops at the first entry it "chooses" (``z_ij ~ Bernoulli(p_ij)``), attending to
that one entry. Training uses the expectation of that process over the ``z``::

    e_ij = g · vᵀ/‖v‖ · tanh(W s_{i-1} + V h_j + b) + r
    p_ij = σ(e_ij + ε),   ε ~ N(0, noise_std²) in training, 0 at inference
    α_ij = p_ij Σ_{k≤j} α_{i-1,k} Π_{l=k}^{j-1} (1 - p_il)           (expected alignment)
    c_i  = Σ_j α_ij v_j

Monotonic attention is a different algorithm from the pipeline (no normaliser over ``j``), so
it lives beside it with the same tensor conventions.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from attnlab._checks import is_real, positive_int
from attnlab._limits import check_elements
from attnlab.functional.scores import prepare_inputs


def expected_alignment(p_choose: Tensor, prev_alignment: Tensor) -> Tensor:
    """The expected monotonic alignment (Raffel et al. 2017, eq. 9), batch of rows ``(B, Lk)``::

        α_ij = p_ij Σ_{k≤j} α_{i-1,k} Π_{l=k}^{j-1} (1 - p_il)

    computed by the stable recurrence (no division by ``Π (1 - p)``, so exact for ``p`` = 0 or 1)::

        q_ij = (1 - p_{i,j-1}) q_{i,j-1} + α_{i-1,j},   q_{i,0} = α_{i-1,0}
        α_ij = p_ij q_ij

    ``q_ij`` is the probability that the scan reaches entry ``j`` at step ``i``. Rows sum to at
    most ``Σ_j α_{i-1,j}``: the rest is the probability that the scan runs off the end.
    """
    q = prev_alignment[:, 0]  # (B,)
    alpha = [p_choose[:, 0] * q]
    for j in range(1, p_choose.shape[-1]):
        q = (1 - p_choose[:, j - 1]) * q + prev_alignment[:, j]
        alpha.append(p_choose[:, j] * q)
    return torch.stack(alpha, dim=-1)  # (B, Lk)


def hard_alignment(p_choose: Tensor, prev_alignment: Tensor) -> Tensor:
    """Hard monotonic decoding (Raffel et al. 2017, Algorithm 1), batch of rows ``(B, Lk)``.

    ``t_{i-1} = argmax_j α_{i-1,j}`` (the attended index of a one-hot row); attend to the first
    ``j ≥ t_{i-1}`` with ``p_ij ≥ 0.5`` (one-hot). If there is none, or ``α_{i-1}`` is all zeros,
    the row is all zeros: nothing is attended. Equals :func:`expected_alignment` when every
    ``p_ij`` is 0 or 1 and ``α_{i-1}`` is one-hot or zero.
    """
    Lk = p_choose.shape[-1]
    start = prev_alignment.argmax(dim=-1, keepdim=True)  # (B, 1): t_{i-1}
    active = (prev_alignment != 0).any(dim=-1, keepdim=True)  # (B, 1)
    j = torch.arange(Lk, device=p_choose.device)
    chosen = (p_choose >= 0.5) & (j >= start) & active  # (B, Lk)
    first = chosen & (chosen.cumsum(dim=-1) == 1)  # only the first chosen entry of each row
    return first.to(p_choose.dtype)


class MonotonicAttention(nn.Module):
    """Monotonic attention of Raffel et al. (2017), one decoder step at a time::

        e_ij = g · vᵀ/‖v‖ · tanh(W s_{i-1} + V h_j + b) + r     # weight-normalised v, scalars g, r
        p_ij = σ(e_ij + ε),  ε ~ N(0, noise_std²) only in training
        training (self.training):  α_i = expected_alignment(p_i, α_{i-1})
        inference (eval):          α_i = hard_alignment(p_i, α_{i-1})  (one-hot or zero)
        c_i = Σ_j α_ij v_j

    ``g`` starts at ``1/sqrt(hidden_dim)`` and ``r`` at ``init_r`` (the paper's ``r = -4``
    makes early alignments scan far instead of stopping at the first entry). Padded keys
    (mask False) get ``p_ij = 0``: they are never chosen and the scan passes over them.

    Decoding starts from :meth:`initial_alignment` (``α_{0,j} = δ_{j,0}``) and feeds each
    step's alignment to the next::

        alignment = attn.initial_alignment(B, Lk)
        for s in decoder_states:                          # s: (B, query_dim)
            context, alignment = attn(s, keys, alignment, mask=mask)

    In eval mode a step that finds no ``p_ij ≥ 0.5`` returns zero context and a zero
    alignment; a zero ``prev_alignment`` attends to nothing again (in training likewise no
    probability mass is left). To make the decoder *stay* at ``t_{i-1}`` instead and scan
    again from there at the next step, keep passing the last non-zero alignment::

        alignment = torch.where(new.any(-1, keepdim=True), new, alignment)

    Args:
        query_dim: size of the decoder state ``s_{i-1}``.
        key_dim: size of an encoder state ``h_j``.
        hidden_dim: size of ``v`` and of the hidden layer inside ``tanh``.
        init_r: initial value of the scalar energy offset ``r``.
        noise_std: standard deviation of the pre-sigmoid noise in training (0 disables it).
        value_dim: size of a value; defaults to ``key_dim`` (keys are the values).

    Raises:
        ValueError: a size is not a positive int, ``noise_std`` is negative or ``init_r`` is
            not a finite number.
    """

    def __init__(self, query_dim: int, key_dim: int, hidden_dim: int, *, init_r: float = -4.0,
                 noise_std: float = 1.0, value_dim: Optional[int] = None):
        super().__init__()
        value_dim = key_dim if value_dim is None else value_dim
        for name, value in (("query_dim", query_dim), ("key_dim", key_dim), ("hidden_dim", hidden_dim),
                            ("value_dim", value_dim)):
            positive_int(name, value)
        check_elements(f"MonotonicAttention(query_dim={query_dim}, key_dim={key_dim}, hidden_dim={hidden_dim})",
                       query_dim + key_dim + 2, hidden_dim)
        if not (is_real(init_r) and math.isfinite(init_r)):
            raise ValueError(f"init_r must be a finite real number, got {init_r!r}")
        if not (is_real(noise_std) and noise_std >= 0):
            raise ValueError(f"noise_std must be a real number >= 0, got {noise_std!r}")
        self.query_dim, self.key_dim, self.value_dim = query_dim, key_dim, value_dim
        self.noise_std = float(noise_std)
        self.W = nn.Linear(query_dim, hidden_dim, bias=False)
        self.V = nn.Linear(key_dim, hidden_dim, bias=False)
        self.b = nn.Parameter(torch.zeros(hidden_dim))
        bound = 1.0 / math.sqrt(hidden_dim)
        self.v = nn.Parameter(torch.empty(hidden_dim).uniform_(-bound, bound))
        self.g = nn.Parameter(torch.tensor(bound))
        self.r = nn.Parameter(torch.tensor(float(init_r)))

    def initial_alignment(self, batch_size: int, length: int) -> Tensor:
        """``α_0``: one-hot at key 0 (``α_{0,j} = δ_{j,0}``), ``(B, Lk)`` in the module's dtype/device."""
        positive_int("batch_size", batch_size)
        positive_int("length", length)
        alignment = self.v.new_zeros(batch_size, length)
        alignment[:, 0] = 1.0
        return alignment

    def energy(self, query: Tensor, keys: Tensor) -> Tensor:
        """``e_ij = g · vᵀ/‖v‖ · tanh(W s_{i-1} + V h_j + b) + r`` for one step: query ``(B, Dq)``,
        keys ``(B, Lk, Dk)`` -> ``(B, Lk)``. No noise, no mask."""
        q, keys, _, _, _ = prepare_inputs(query, keys, None, None, query_dim=self.query_dim,
                                          key_dim=self.key_dim, value_dim=self.key_dim, step_only=True)
        hidden = torch.tanh(self.W(q) + self.V(keys) + self.b)  # (B, 1, hid) + (B, Lk, hid)
        return self.g * (hidden @ (self.v / self.v.norm())) + self.r  # (B, Lk)

    def forward(self, query: Tensor, keys: Tensor, prev_alignment: Tensor, *, values: Optional[Tensor] = None,
                mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """One decoder step.

        Args:
            query: the decoder state ``s_{i-1}``, ``(B, Dq)``.
            keys: the encoder states ``h``, ``(B, Lk, Dk)``.
            prev_alignment: ``α_{i-1}``, ``(B, Lk)``; start with :meth:`initial_alignment`.
            values: ``(B, Lk, Dv)``; defaults to ``keys``.
            mask: bool ``(B, Lk)`` (or broadcastable to it), True = may attend.

        Returns:
            ``(context (B, Dv), alignment (B, Lk))``: the expected alignment in training, the hard
            one-hot (or zero) alignment in eval mode.
        """
        q, keys, values, mask, _ = prepare_inputs(query, keys, values, mask, query_dim=self.query_dim,
                                                  key_dim=self.key_dim, value_dim=self.value_dim, step_only=True)
        B, Lk = keys.shape[0], keys.shape[1]
        if not isinstance(prev_alignment, Tensor) or prev_alignment.shape != (B, Lk):
            got = tuple(prev_alignment.shape) if isinstance(prev_alignment, Tensor) else type(prev_alignment).__name__
            raise ValueError(f"prev_alignment must have shape (B, Lk) = {(B, Lk)}, got {got}")
        e = self.energy(query, keys)  # (B, Lk)
        if self.training and self.noise_std > 0:
            e = e + self.noise_std * torch.randn_like(e)
        p = torch.sigmoid(e)
        if mask is not None:
            p = p.masked_fill(~mask.squeeze(1), 0.0)  # padded keys are never chosen
        if self.training:
            alignment = expected_alignment(p, prev_alignment)
        else:
            alignment = hard_alignment(p, prev_alignment)
        bad = ~torch.isfinite(prev_alignment).all(-1, keepdim=True)  # NaN/inf in: that row NaN out, never zeros
        if bool(bad.any()):
            alignment = alignment.masked_fill(bad, math.nan)
        context = torch.bmm(alignment.unsqueeze(1), values).squeeze(1)  # (B, Dv)
        return context, alignment
