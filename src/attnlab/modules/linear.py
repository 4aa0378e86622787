"""Efficient self-attention modules beside the pipeline: Performer (linear attention, FAVOR+)
and Linformer (low-rank attention), batch-first ``(B, L, E)``, with ``q_proj, k_proj, v_proj,
out_proj`` like :class:`attnlab.modules.multihead.MultiheadAttention`.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from attnlab._checks import boolean, one_of, positive_int, rate
from attnlab._limits import check_elements
from attnlab.backends.dispatch import attention
from attnlab.functional.linear import FEATURE_MAPS, default_num_features, favor_projection, linear_attention


class _SelfAttention(nn.Module):
    """The projections and head bookkeeping both modules share."""

    def __init__(self, embed_dim: int, num_heads: int, bias: bool, device, dtype):
        super().__init__()
        positive_int("embed_dim", embed_dim)
        positive_int("num_heads", num_heads)
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        fk = dict(bias=bias, device=device, dtype=dtype)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(embed_dim, embed_dim, **fk) for _ in range(4))

    def _heads(self, x: Tensor, key_padding_mask: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """``(Q W_Q, K W_K, V W_V)`` as ``(B, H, L, Dh)`` each, after checking the inputs."""
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"x must be (B, L, {self.embed_dim}) (batch first), got shape {tuple(x.shape)}")
        B, L, _ = x.shape
        if key_padding_mask is not None:
            if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
                raise TypeError("key_padding_mask must be a bool tensor (True = padding) or None")
            if key_padding_mask.shape != (B, L):
                raise ValueError(f"key_padding_mask must be (B, L) = {(B, L)}, got {tuple(key_padding_mask.shape)}")
        return tuple(p(x).view(B, L, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, L, Dh)
                     for p in (self.q_proj, self.k_proj, self.v_proj))

    def _merge(self, out: Tensor) -> Tensor:
        B, H, L, Dh = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(B, L, H * Dh))  # (B, L, E)


class PerformerAttention(_SelfAttention):
    """Performer self-attention (Choromanski et al. 2021, "Rethinking Attention with Performers")::

        Q, K, V = X W_Q, X W_K, X W_V                     # split into H heads of Dh = E / H
        out_i   = φ(q_i)ᵀ Σ_j φ(k_j) v_jᵀ / φ(q_i)ᵀ Σ_j φ(k_j)     (j ≤ i when causal)
        φ(x)    = exp(W x' − ‖x'‖²/2) / sqrt(m),   x' = x Dh^(-1/4)   # FAVOR+: E[φ(q)ᵀφ(k)] = exp(qᵀk / sqrt(Dh))
        MHA(X)  = Concat(out^1, …, out^H) W_O

    computed in O(L) time and memory by :func:`attnlab.functional.linear.linear_attention`.
    ``W (m, Dh)`` holds positive orthogonal random features (:func:`favor_projection`), shared by
    all heads, kept in the buffer ``projection`` and redrawn at the start of every training
    forward call after ``redraw_interval`` of them (calls are counted in training mode only);
    :meth:`redraw_features` redraws at once. ``feature_map="elu"`` / ``"relu"`` give the
    deterministic linear attention of Katharopoulos et al. (2020) (no buffer).

    Args:
        embed_dim: model width E; ``E % num_heads == 0``.
        num_heads: heads H.
        num_features: FAVOR+'s m (default ``max(Dh, ceil(Dh ln Dh))``).
        causal: attend to ``j ≤ i`` only (chunked prefix sums).
        redraw_interval: training calls between redraws of ``W``; None = never.
        feature_map: ``"favor+"``, ``"elu"`` or ``"relu"``.
        bias: biases on the projections.

    ``forward(x (B, L, E), *, key_padding_mask (B, L) bool, True = padding) -> (B, L, E)``;
    padded keys contribute nothing (their ``φ(k)`` is zeroed).
    """

    def __init__(self, embed_dim: int, num_heads: int, *, num_features: Optional[int] = None,
                 causal: bool = False, redraw_interval: Optional[int] = 1000, feature_map: str = "favor+",
                 bias: bool = True, device=None, dtype=None):
        super().__init__(embed_dim, num_heads, bias, device, dtype)
        one_of("feature_map", feature_map, sorted(FEATURE_MAPS))
        boolean("causal", causal)
        positive_int("redraw_interval", redraw_interval, optional=True)
        self.feature_map, self.causal, self.redraw_interval = feature_map, causal, redraw_interval
        if feature_map == "favor+":
            num_features = default_num_features(self.head_dim) if num_features is None else num_features
            positive_int("num_features", num_features)
            self.register_buffer("projection", favor_projection(num_features, self.head_dim, device=device, dtype=dtype))
        else:
            if num_features is not None:
                raise ValueError(f"num_features is only used with feature_map='favor+' (feature_map={feature_map!r})")
            self.register_buffer("projection", None)
        self.num_features = num_features
        self.calls_since_redraw = 0

    @torch.no_grad()
    def redraw_features(self) -> None:
        """Draw a fresh ``W`` into the ``projection`` buffer (in place) and restart the count."""
        if self.projection is not None:
            self.projection.copy_(favor_projection(self.num_features, self.head_dim, device=self.projection.device,
                                                   dtype=self.projection.dtype))
        self.calls_since_redraw = 0

    def forward(self, x: Tensor, *, key_padding_mask: Optional[Tensor] = None) -> Tensor:
        q, k, v = self._heads(x, key_padding_mask)
        if self.training and self.projection is not None and self.redraw_interval is not None:
            if self.calls_since_redraw >= self.redraw_interval:
                self.redraw_features()
            self.calls_since_redraw += 1
        out = linear_attention(q, k, v, feature_map=self.feature_map, causal=self.causal, projection=self.projection,
                               key_mask=None if key_padding_mask is None else ~key_padding_mask)
        return self._merge(out)

    def extra_repr(self) -> str:
        m = f", num_features={self.num_features}" if self.projection is not None else ""
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, feature_map={self.feature_map!r}{m}, "
                f"causal={self.causal}, redraw_interval={self.redraw_interval}")


class LinformerAttention(_SelfAttention):
    """Linformer self-attention (Wang et al. 2020, "Linformer: Self-Attention with Linear Complexity")::

        Q, K, V = X W_Q, X W_K, X W_V                     # split into H heads of Dh = E / H
        K', V'  = E K, F V                                # E, F ∈ R^{k × seq_len}: length L -> k
        head    = softmax(Q K'ᵀ / sqrt(Dh)) V'            # (L × k) scores: O(L k), not O(L²)
        MHA(X)  = Concat(head^1, …, head^H) W_O

    ``E`` and ``F`` (parameters ``e_proj``, ``f_proj``) are learned and shared by all heads
    (``share_kv=True``: ``F = E``, ``f_proj`` is None); initialised uniform in ``±1/sqrt(k)``.
    A sequence of ``L < seq_len`` uses the first ``L`` columns, ``E[:, :L]``. Padded positions
    (``key_padding_mask``, True = padding) have their keys and values zeroed before the length
    projection, so their content never matters. Linformer cannot be causal: every projected row
    ``E K`` mixes all positions, future ones included (``causal=True`` / ``is_causal=True`` raise).

    Args:
        embed_dim: model width E; ``E % num_heads == 0``.
        num_heads: heads H.
        seq_len: the longest sequence accepted (the columns of E and F).
        k: projected length.
        share_kv: one projection for keys and values.
        bias: biases on the q/k/v/out projections.
        dropout: dropout on the attention weights, in training.
        causal: must be False (present so that a config asking for it gets a clear error).
    """

    def __init__(self, embed_dim: int, num_heads: int, *, seq_len: int, k: int = 256, share_kv: bool = False,
                 bias: bool = True, dropout: float = 0.0, causal: bool = False, device=None, dtype=None):
        super().__init__(embed_dim, num_heads, bias, device, dtype)
        positive_int("seq_len", seq_len)
        positive_int("k", k)
        boolean("share_kv", share_kv)
        check_elements(f"LinformerAttention(seq_len={seq_len}, k={k})", k, seq_len, 1 if share_kv else 2,
                       device=device or "cpu")
        rate("dropout", dropout)
        _refuse_causal("causal", causal)
        self.seq_len, self.k, self.share_kv, self.dropout = seq_len, k, share_kv, float(dropout)
        bound = 1 / math.sqrt(k)
        self.e_proj = nn.Parameter(torch.empty(k, seq_len, device=device, dtype=dtype).uniform_(-bound, bound))
        if share_kv:
            self.register_parameter("f_proj", None)
        else:
            self.f_proj = nn.Parameter(torch.empty(k, seq_len, device=device, dtype=dtype).uniform_(-bound, bound))

    def forward(self, x: Tensor, *, key_padding_mask: Optional[Tensor] = None, is_causal: bool = False) -> Tensor:
        _refuse_causal("is_causal", is_causal)
        if isinstance(x, Tensor) and x.dim() == 3 and x.shape[1] > self.seq_len:
            raise ValueError(f"sequence length {x.shape[1]} exceeds seq_len={self.seq_len} (the columns of E and F)")
        q, k, v = self._heads(x, key_padding_mask)
        L = x.shape[1]
        if key_padding_mask is not None:
            pad = key_padding_mask[:, None, :, None]  # (B, 1, L, 1)
            k, v = k.masked_fill(pad, 0), v.masked_fill(pad, 0)
        e = self.e_proj[:, :L]  # (k, L)
        f = e if self.f_proj is None else self.f_proj[:, :L]
        out = attention(q, e @ k, f @ v, dropout_p=self.dropout if self.training else 0.0)  # K', V': (B, H, k, Dh)
        return self._merge(out)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, seq_len={self.seq_len}, k={self.k}, "
                f"share_kv={self.share_kv}")


def _refuse_causal(name: str, value) -> None:
    boolean(name, value)
    if value:
        raise ValueError(f"LinformerAttention cannot be causal ({name}=True): its length projection "
                         f"K' = E K mixes every position, future ones included, into each projected row")
