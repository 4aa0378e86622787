"""Positional encodings as modules.

* :class:`SinusoidalPositionalEmbedding`, :class:`LearnedPositionalEmbedding`: ``positions -> (..., dim)``,
  added to the token embeddings.
* :class:`RotaryEmbedding`: ``rotary(x, positions)`` rotates q or k ``(B, H, L, D)``; this is
  how :class:`~attnlab.modules.multihead.MultiheadAttention` calls its ``rotary`` argument.
* :class:`ALiBi`, :class:`T5RelativeBias`: ``bias(q_positions, k_positions) -> (1, H, Lq, Lk)``
  added to the scores, and ``.score_mod()``, the same formula as a FlexAttention-style mod
  (``q_idx``, ``kv_idx`` absolute positions); MultiheadAttention's ``position_bias``.

All positions are absolute integer positions (with a KV cache, queries sit at
``past + arange(Lq)``, keys at ``arange(Lk)``).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from attnlab import _native

from attnlab import _native_train
from attnlab._checks import boolean, int_at_least, tensor
from attnlab._limits import check_elements
from attnlab.functional.positional import (ScoreMod, alibi_score_mod, alibi_slopes, apply_rope, rope_frequencies,
                                           sinusoidal_table, t5_relative_buckets)


def _check_positions(name: str, positions: Tensor, *, limit: Optional[int] = None, limit_name: str = "") -> int:
    """Check an integer tensor with ``0 <= positions`` (and ``< limit`` when given); return its max (-1 if empty)."""
    tensor(name, positions, kind="integer")
    if positions.numel() == 0:
        return -1
    lo, hi = int(positions.min()), int(positions.max())
    if lo < 0:
        raise ValueError(f"{name} must be >= 0, got a minimum of {lo}")
    if limit is not None and hi >= limit:
        raise ValueError(f"{name} must be < {limit_name}={limit}, got a maximum of {hi}")
    return hi


def _relative_positions(q_positions: Tensor, k_positions: Tensor) -> Tensor:
    """``r[i, j] = k_positions[j] - q_positions[i]``, ``(Lq, Lk)``, after checking both are 1-D positions."""
    for name, pos in (("q_positions", q_positions), ("k_positions", k_positions)):
        _check_positions(name, pos)
        if pos.dim() != 1:
            raise ValueError(f"{name} must be 1-D (L,), got shape {tuple(pos.shape)}")
    return k_positions.unsqueeze(0) - q_positions.unsqueeze(1)  # (Lq, Lk)


class SinusoidalPositionalEmbedding(nn.Module):
    """Fixed encodings of Vaswani et al., ``PE(pos, 2i) = sin(pos / base^(2i/d))``,
    ``PE(pos, 2i+1) = cos(pos / base^(2i/d))`` (see :func:`~attnlab.functional.positional.sinusoidal_table`).

    The table is a non-persistent buffer (not in the state dict) of ``max_positions`` rows;
    asking for a position ``>= max_positions`` is an error rather than a silent regrowth, so
    the limit a model was built with stays visible.

    Args:
        dim: model width ``d``.
        max_positions: number of positions in the table.
        base: wavelength base.

    Raises:
        ValueError: ``dim`` or ``max_positions`` not a positive int, ``base <= 1``.
    """

    def __init__(self, dim: int, *, max_positions: int = 2048, base: float = 10000.0):
        super().__init__()
        int_at_least("dim", dim, 1)
        int_at_least("max_positions", max_positions, 1)
        self.dim, self.max_positions, self.base = dim, max_positions, base
        self.register_buffer("table", sinusoidal_table(max_positions, dim, base=base), persistent=False)

    def forward(self, positions: Tensor) -> Tensor:
        """``positions`` integer tensor of any shape ``S`` -> ``(*S, dim)``."""
        _check_positions("positions", positions, limit=self.max_positions, limit_name="max_positions")
        return self.table[positions.to(self.table.device)]

    def extra_repr(self) -> str:
        return f"{self.dim}, max_positions={self.max_positions}, base={self.base}"


class LearnedPositionalEmbedding(nn.Embedding):
    """Learned absolute positions (BERT, GPT-2): ``PE(pos) = W[pos]``, ``W (max_positions, dim)``.

    An :class:`torch.nn.Embedding` whose only parameter is ``weight`` (so HF-style
    ``position_embeddings.weight`` loads directly), with a clear error past ``max_positions``.
    Initialised like ``nn.Embedding`` (``N(0, 1)``); models re-initialise as they need.
    """

    def __init__(self, max_positions: int, dim: int, *, device=None, dtype=None):
        int_at_least("max_positions", max_positions, 1)
        int_at_least("dim", dim, 1)
        check_elements(f"LearnedPositionalEmbedding(max_positions={max_positions}, dim={dim})", max_positions, dim,
                       device=device or "cpu")
        super().__init__(max_positions, dim, device=device, dtype=dtype)

    @property
    def max_positions(self) -> int:
        return self.num_embeddings

    def forward(self, positions: Tensor) -> Tensor:
        """``positions`` integer tensor of any shape ``S`` -> ``(*S, dim)``."""
        _check_positions("positions", positions, limit=self.num_embeddings, limit_name="max_positions")
        return super().forward(positions)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al., 2021) applied to q or k: each pair of dims at
    position ``m`` is rotated by ``m θ_i``, ``θ_i = base^(-2i/R)``, so ``⟨R(m)q, R(n)k⟩``
    depends only on ``m - n`` (see :func:`~attnlab.functional.positional.apply_rope`).

    ``interleaved=False`` (default) is Hugging Face Llama's half-split layout (pairs
    ``(i, i + R/2)``); ``interleaved=True`` the paper's / GPT-J's ``(2i, 2i + 1)``. With
    ``rotary_dim < head_dim`` only the first ``rotary_dim`` dims rotate (GPT-NeoX).

    ``cos``/``sin`` are cached for positions ``0 .. max_positions - 1`` in float32 (computed as
    HF Llama computes them) as non-persistent buffers; the cache grows (doubling) when a larger
    position is asked for. Float64 inputs get float64 angles computed on the fly.

    Args:
        head_dim: size ``D`` of each head.
        base: θ's base.
        rotary_dim: number of rotated dims ``R`` (even, ``<= head_dim``); default ``head_dim``.
        interleaved: pair layout, see above.
        max_positions: initial cache length.

    Raises:
        ValueError: ``head_dim``/``rotary_dim`` not even where rotated, ``rotary_dim > head_dim``,
            ``max_positions`` not a positive int, ``base <= 1``.
    """

    def __init__(self, head_dim: int, *, base: float = 10000.0, rotary_dim: Optional[int] = None,
                 interleaved: bool = False, max_positions: int = 2048):
        super().__init__()
        int_at_least("head_dim", head_dim, 1)
        if rotary_dim is None:
            if head_dim % 2:
                raise ValueError(f"head_dim must be even for RoPE (dims rotate in pairs), got {head_dim}")
            rotary_dim = head_dim
        else:
            int_at_least("rotary_dim", rotary_dim, 2)
            if rotary_dim % 2 or rotary_dim > head_dim:
                raise ValueError(f"rotary_dim must be even and <= head_dim={head_dim}, got {rotary_dim}")
        int_at_least("max_positions", max_positions, 1)
        check_elements(f"RotaryEmbedding(max_positions={max_positions})", max_positions, rotary_dim)
        self.head_dim, self.rotary_dim, self.base = head_dim, rotary_dim, base
        self.interleaved = bool(interleaved)
        cos, sin = rope_frequencies(rotary_dim, torch.arange(max_positions), base=base)  # (P, R/2)
        self.register_buffer("cos_cached", cos, persistent=False)
        self.register_buffer("sin_cached", sin, persistent=False)

    @property
    def cached_positions(self) -> int:
        return self.cos_cached.shape[0]

    def _grow(self, needed: int) -> None:
        length = max(needed, 2 * self.cached_positions)
        positions = torch.arange(length, device=self.cos_cached.device)
        cos, sin = rope_frequencies(self.rotary_dim, positions, base=self.base)
        self.cos_cached = cos.to(self.cos_cached.dtype)
        self.sin_cached = sin.to(self.sin_cached.dtype)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotate ``x (B, H, L, D)`` at absolute ``positions`` ``(L,)`` (or ``(B, L)`` per sample)."""
        if not isinstance(x, Tensor) or x.dim() != 4 or x.shape[-1] != self.head_dim:
            raise ValueError(f"x must be (B, H, L, D={self.head_dim}), got {tuple(getattr(x, 'shape', ()))}")
        last = _check_positions("positions", positions)
        if positions.dim() not in (1, 2) or positions.shape[-1] != x.shape[2]:
            raise ValueError(f"positions must be (L,) or (B, L) with L={x.shape[2]}, got {tuple(positions.shape)}")
        if x.dtype == torch.float64:
            cos, sin = rope_frequencies(self.rotary_dim, positions.to(x.device), base=self.base, dtype=torch.float64)
        else:
            if last >= self.cached_positions:
                self._grow(last + 1)
            index = positions.to(self.cos_cached.device)
            cos, sin = self.cos_cached[index].to(x.device), self.sin_cached[index].to(x.device)  # (..., L, R/2)
        if positions.dim() == 2:  # (B, L, R/2) -> (B, 1, L, R/2), broadcast over heads
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            return apply_rope(x, cos, sin, interleaved=self.interleaved)
        return self._rotate(x, cos, sin)

    def span(self, x: Tensor, start: int) -> Tensor:
        """``forward(x, torch.arange(start, start + L))`` for ``x (B, H, L, D)``: the cached rows taken by a view (the
        same values as ``forward``'s gather), the positions known without reading a tensor — what a compiled graph
        needs (``forward`` checks its positions' data). float64 goes through :meth:`forward`."""
        if not isinstance(x, Tensor) or x.dim() != 4 or x.shape[-1] != self.head_dim:
            raise ValueError(f"x must be (B, H, L, D={self.head_dim}), got {tuple(getattr(x, 'shape', ()))}")
        int_at_least("start", start, 0)
        L = x.shape[2]
        if x.dtype == torch.float64 or self.cos_cached.device != x.device:
            return self.forward(x, torch.arange(start, start + L, device=x.device))
        if start + L > self.cached_positions:
            self._grow(start + L)
        return self._rotate(x, self.cos_cached.narrow(0, start, L), self.sin_cached.narrow(0, start, L))

    def _rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``x (B, H, L, D)`` rotated by the angles' ``cos``, ``sin`` ``(L, R/2)``."""
        if (x.requires_grad and torch.is_grad_enabled() and not self.interleaved and self.rotary_dim == self.head_dim
              and x.stride(-1) == 1 and x.numel() > 0 and _native.trainable(x, contiguous=False)):
            return _Rotate.apply(x, cos.float().contiguous(), sin.float().contiguous())  # training: one pass each way
        return apply_rope(x, cos, sin, interleaved=self.interleaved)

    def at(self, x: Tensor, position: int) -> Tensor:
        """``forward(x, torch.tensor([position]))`` for ``x (B, H, 1, D)`` at one position a caller knows is valid (a
        decoding step's, from its cache): the cached cos/sin row taken by a view, no tensor checks. float64, a
        position past the cache, or cos/sin on another device go through :meth:`forward`."""
        cos = self.cos_cached
        if x.dtype == torch.float64 or position >= cos.shape[0] or cos.device != x.device:
            return self.forward(x, torch.arange(position, position + 1, device=x.device))
        return apply_rope(x, cos.narrow(0, position, 1), self.sin_cached.narrow(0, position, 1),
                          interleaved=self.interleaved)

    def angles_at(self, position: int) -> tuple[Tensor, Tensor]:
        """``cos(position · θ)``, ``sin(position · θ)``: the cached rows ``(R/2,)`` (views; the cache grows to hold
        ``position``), as :meth:`forward` uses them — for a fused kernel that rotates by itself
        (:func:`attnlab._native.attend_decode`)."""
        if position >= self.cached_positions:
            self._grow(position + 1)
        return self.cos_cached[position], self.sin_cached[position]

    def extra_repr(self) -> str:
        return (f"{self.head_dim}, rotary_dim={self.rotary_dim}, base={self.base}, interleaved={self.interleaved}, "
                f"cached_positions={self.cached_positions}")


class _Rotate(torch.autograd.Function):
    """:func:`~attnlab.functional.positional.apply_rope` (half-split pairs, every dim rotated) of a float32 or bfloat16
    ``x (B, H, L, D)`` in one C++ pass (:func:`attnlab._native_train.rope_train`, the arithmetic in float32 and one rounding,
    where ``apply_rope`` rounds each product in ``x``'s dtype), and its backward, the rotation by ``−φ`` (``R(φ)ᵀ =
    R(−φ)``): ``∂L/∂x = R(−φ) ∂L/∂y``. fwd + bwd of q (16, 4, 256, 64), 2 cores: 0.39× ``apply_rope``'s time under
    autograd in float32, 0.54× in bfloat16 (``benchmarks/train_passes.py``)."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return _native_train.rope_train(x, cos, sin)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        cos, sin = ctx.saved_tensors
        grad = grad if grad.stride(-1) == 1 else grad.contiguous()
        return _native_train.rope_train(grad, cos, sin, inverse=True), None, None


class ALiBi(nn.Module):
    """Attention with linear biases (Press et al., 2022): ``bias[h, i, j] = m_h · (k_j - q_i)``
    (``causal=True``; ``<= 0`` for past keys) or ``-m_h · |k_j - q_i|`` (``causal=False``),
    slopes ``m_h`` from :func:`~attnlab.functional.positional.alibi_slopes` (a non-persistent buffer).

    Args:
        num_heads: ``H``.
        causal: the one-sided (decoder) or symmetric (encoder) form.

    Raises:
        ValueError: ``num_heads`` not a positive int.
    """

    def __init__(self, num_heads: int, *, causal: bool = True):
        super().__init__()
        int_at_least("num_heads", num_heads, 1)
        boolean("causal", causal)
        self.num_heads, self.causal = num_heads, causal
        self.register_buffer("slopes", alibi_slopes(num_heads), persistent=False)

    def forward(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        """``q_positions (Lq,)``, ``k_positions (Lk,)`` -> float bias ``(1, H, Lq, Lk)``."""
        distance = _relative_positions(q_positions, k_positions).to(self.slopes.device)  # (Lq, Lk)
        if not self.causal:
            distance = -distance.abs()
        return (self.slopes.view(-1, 1, 1) * distance).unsqueeze(0)  # (1, H, Lq, Lk)

    def score_mod(self) -> ScoreMod:
        """The same bias as ``score_mod(score, b, h, q_idx, kv_idx)``; it holds the current
        ``slopes`` tensor, so ask again after moving the module to another device or dtype."""
        return alibi_score_mod(self.slopes, causal=self.causal)

    def extra_repr(self) -> str:
        return f"{self.num_heads}, causal={self.causal}"


class T5RelativeBias(nn.Module):
    """T5's learned relative position bias (Raffel et al., 2020):
    ``bias[h, i, j] = W[bucket(k_j - q_i), h]`` with ``W = relative_attention_bias.weight``
    ``(num_buckets, H)`` (Hugging Face's name and layout) and
    :func:`~attnlab.functional.positional.t5_relative_buckets`.

    Args:
        num_heads: ``H``.
        bidirectional: encoder (True) or causal decoder (False) buckets.
        num_buckets: number of buckets (32 in T5).
        max_distance: distance from which all positions share the last bucket (128 in T5).

    Raises:
        ValueError: ``num_heads`` not a positive int, or bucket settings invalid.
    """

    def __init__(self, num_heads: int, *, bidirectional: bool = True, num_buckets: int = 32,
                 max_distance: int = 128, device=None, dtype=None):
        super().__init__()
        int_at_least("num_heads", num_heads, 1)
        t5_relative_buckets(torch.zeros(1, dtype=torch.long), bidirectional=bidirectional,
                            num_buckets=num_buckets, max_distance=max_distance)  # validates the settings
        self.num_heads, self.bidirectional = num_heads, bool(bidirectional)
        self.num_buckets, self.max_distance = num_buckets, max_distance
        check_elements(f"T5RelativeBias(num_heads={num_heads}, num_buckets={num_buckets})", num_buckets, num_heads,
                       device=device or "cpu")
        self.relative_attention_bias = nn.Embedding(num_buckets, num_heads, device=device, dtype=dtype)

    def _buckets(self, relative_position: Tensor) -> Tensor:
        return t5_relative_buckets(relative_position, bidirectional=self.bidirectional,
                                   num_buckets=self.num_buckets, max_distance=self.max_distance)

    def forward(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        """``q_positions (Lq,)``, ``k_positions (Lk,)`` -> float bias ``(1, H, Lq, Lk)``."""
        weight = self.relative_attention_bias.weight
        buckets = self._buckets(_relative_positions(q_positions, k_positions).to(weight.device))  # (Lq, Lk)
        return self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)  # (1, H, Lq, Lk)

    def score_mod(self) -> ScoreMod:
        """The same bias as ``score_mod(score, b, h, q_idx, kv_idx) = score + W[bucket(kv_idx - q_idx), h]``.

        It reads ``relative_attention_bias.weight`` at call time, so gradients reach it."""

        def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            weight = self.relative_attention_bias.weight
            return score + weight[self._buckets(kv_idx - q_idx), h].to(score.dtype)

        score_mod.additive = True  # score + bias (the table's own gradient still goes through autograd)
        return score_mod

    def extra_repr(self) -> str:
        return (f"{self.num_heads}, bidirectional={self.bidirectional}, num_buckets={self.num_buckets}, "
                f"max_distance={self.max_distance}")
