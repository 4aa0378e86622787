"""Positional encodings as pure functions: sinusoidal, RoPE, ALiBi, T5 relative buckets.

Absolute encodings (sinusoidal) are added to the token embeddings; RoPE rotates q and k;
ALiBi and T5 add a bias to the scores and come in two forms that agree exactly: a dense bias
``(1, H, Lq, Lk)`` (see :mod:`attnlab.nn.positional`) and a FlexAttention-style
``score_mod(score, b, h, q_idx, kv_idx)`` with absolute positions ``q_idx``, ``kv_idx``.
Relative positions are always ``key_pos - query_pos`` (negative for past keys).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from attnlab._checks import int_at_least, is_int, is_real, tensor
from attnlab._limits import HEADS, SIZE_LIMITS, check_elements

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def _check_base(base) -> None:
    """RoPE's and the sinusoids' ``base`` must be a finite real number ``> 1``."""
    if not (is_real(base) and 1.0 < base < math.inf):
        raise ValueError(f"base must be a finite real number > 1, got {base!r}")


# --------------------------------------------------------------------------- sinusoidal

def sinusoidal_table(num_positions: int, dim: int, *, base: float = 10000.0, device=None,
                     dtype: torch.dtype = torch.float32) -> Tensor:
    """The fixed encodings of Vaswani et al. (2017), interleaved as in the paper::

        PE(pos, 2i)   = sin(pos / base^(2i/d))
        PE(pos, 2i+1) = cos(pos / base^(2i/d))

    Computed in float64, returned in ``dtype``. An odd ``dim`` is allowed: its last column is
    the sine of the last frequency (``2i = d - 1``), exactly what the formula gives.

    Args:
        num_positions: number of rows (positions ``0 .. num_positions - 1``), ``>= 0``.
        dim: model width ``d``, ``>= 1``.
        base: the wavelength base (10000 in the paper).

    Returns:
        ``(num_positions, dim)`` table.

    Raises:
        ValueError: ``num_positions < 0``, ``dim < 1`` or ``base <= 1``.
    """
    int_at_least("num_positions", num_positions, 0)
    int_at_least("dim", dim, 1)
    _check_base(base)
    check_elements(f"sinusoidal_table(num_positions={num_positions}, dim={dim})", num_positions, dim, 2,
                   bytes_per_value=8, device=device or "cpu")
    pos = torch.arange(num_positions, dtype=torch.float64, device=device).unsqueeze(1)  # (P, 1)
    two_i = torch.arange(0, dim, 2, dtype=torch.float64, device=device)                 # (ceil(d/2),)
    angles = pos / base ** (two_i / dim)                                                # (P, ceil(d/2))
    table = torch.empty(num_positions, dim, dtype=torch.float64, device=device)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles[:, : dim // 2])
    return table.to(dtype)


# --------------------------------------------------------------------------- RoPE

def rope_frequencies(head_dim: int, positions: Tensor, *, base: float = 10000.0,
                     dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Rotary angles of Su et al. (2021): ``θ_i = base^(-2i/d)``, ``i = 0 .. d/2 - 1``.

    Returns ``cos(m θ_i)`` and ``sin(m θ_i)`` for every position ``m``. In float32 (the
    default) the arithmetic is that of Hugging Face Llama and gpt-fast step by step
    (``inv_freq = 1 / base ** (arange(0, d, 2) / d)``, ``angle = m * inv_freq``), so the tables
    are bit-identical to theirs; pass ``dtype=torch.float64`` for float64 work.

    Args:
        head_dim: number of rotated dims ``d`` (even; for partial rotary pass ``rotary_dim``,
            as GPT-NeoX computes its frequencies over the rotated dims only).
        positions: integer tensor of absolute positions, any shape ``S``.
        base: θ's base (10000 in the paper and Llama 2, 500000 in Llama 3).
        dtype: floating dtype the angles are computed in.

    Returns:
        ``(cos, sin)``, each of shape ``(*S, head_dim // 2)`` -- one angle per rotated pair; the
        layout of pairs inside a head is chosen by :func:`apply_rope`.

    Raises:
        ValueError: ``head_dim`` is not a positive even int, or ``base <= 1``.
        TypeError: ``positions`` is not an integer tensor.
    """
    if not (is_int(head_dim) and head_dim >= 2 and head_dim % 2 == 0):
        raise ValueError(f"head_dim must be a positive even int for RoPE (dims rotate in pairs), got {head_dim!r}")
    _check_base(base)
    tensor("positions", positions, kind="integer")
    check_elements(f"rope_frequencies(head_dim={head_dim}) of {positions.numel()} positions", positions.numel(),
                   head_dim, bytes_per_value=torch.empty((), dtype=dtype).element_size(), device=positions.device)
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device)
                               .to(dtype) / head_dim))                           # (d/2,)
    angles = positions.to(dtype).unsqueeze(-1) * inv_freq                         # (*S, d/2)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False) -> Tensor:
    """Rotate each pair of dims ``(a, b)`` of ``x`` by its angle ``φ = m θ_i``::

        a' = a cos φ - b sin φ
        b' = b cos φ + a sin φ

    Pairing conventions:

    * ``interleaved=False`` (default, half-split, ``rotate_half``): pairs ``(i, i + R/2)``.
      This is Hugging Face Llama / GPT-NeoX's layout, so Llama checkpoints load unchanged.
    * ``interleaved=True``: pairs ``(2i, 2i + 1)``, the paper's and GPT-J / Meta Llama's
      original layout (``x`` viewed as complex numbers multiplied by ``e^{i m θ}``).

    Partial rotary (GPT-NeoX): with ``R = 2 * cos.shape[-1] < D`` only the first ``R`` dims
    rotate; the last ``D - R`` pass through unchanged.

    Args:
        x: ``(B, H, L, D)`` (any ``(..., L, D)`` works).
        cos, sin: from :func:`rope_frequencies`, ``(L, R/2)`` or broadcastable to
            ``(..., L, R/2)`` (e.g. ``(B, 1, L, R/2)`` for per-sample positions).
        interleaved: pair layout, see above.

    Returns:
        Rotated ``x``, same shape and dtype (``cos``/``sin`` are cast to ``x.dtype``).

    Raises:
        ValueError: ``cos`` and ``sin`` differ in shape, or rotate more dims than ``x`` has.
    """
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    try:
        torch.broadcast_shapes(tuple(cos.shape[:-1]), tuple(x.shape[:-1]))
    except RuntimeError:
        raise ValueError(f"cos/sin of shape {tuple(cos.shape)} do not cover x's positions: their leading dims must "
                         f"broadcast to x's (..., L) = {tuple(x.shape[:-1])}") from None
    rot = 2 * cos.shape[-1]
    if rot > x.shape[-1]:
        raise ValueError(f"cos/sin rotate {rot} dims but x has only D={x.shape[-1]} (shape {tuple(x.shape)})")
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    if interleaved:
        a, b = x_rot[..., 0::2], x_rot[..., 1::2]                                 # (..., L, R/2)
        rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    else:
        a, b = x_rot[..., : rot // 2], x_rot[..., rot // 2:]                      # (..., L, R/2)
        rotated = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    return torch.cat((rotated, x_pass), dim=-1) if x_pass.shape[-1] else rotated


# --------------------------------------------------------------------------- ALiBi

def alibi_slopes(num_heads: int, *, device=None, dtype: torch.dtype = torch.float32) -> Tensor:
    """ALiBi head slopes (Press et al., 2022).

    For ``n`` a power of two, the geometric sequence ``m_h = 2^(-8h/n)``, ``h = 1 .. n``
    (``n = 8``: ``1/2, 1/4, ..., 1/256``). Otherwise, as in the paper's reference code and
    Hugging Face BLOOM: the slopes for the closest power of two ``c < n``, then the odd-indexed
    slopes of ``2c`` (``2^(-4h/c)`` for ``h = 1, 3, 5, ...``), ``n - c`` of them.

    Raises:
        ValueError: ``num_heads`` is not an int in ``[1, 1024]`` (a model's largest head count).
    """
    int_at_least("num_heads", num_heads, 1)
    if num_heads > SIZE_LIMITS[HEADS]:
        raise ValueError(f"num_heads must be an int in [1, {SIZE_LIMITS[HEADS]}], got {num_heads!r}")

    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    closest = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=dtype, device=device)


def alibi_score_mod(slopes: Tensor, *, causal: bool = True) -> ScoreMod:
    """ALiBi as a FlexAttention-style ``score_mod``.

    ``causal=True``:  ``score + m_h · (kv_idx - q_idx)`` (``<= 0`` for past keys; future keys
    get a positive bias, so pair it with a causal mask, as in the paper).
    ``causal=False``: ``score - m_h · |kv_idx - q_idx|`` (the symmetric form for encoders).

    The bias is computed in ``slopes``' dtype and cast to the score's dtype.

    Args:
        slopes: ``(H,)`` from :func:`alibi_slopes`.
        causal: which of the two forms above.
    """
    if not isinstance(slopes, Tensor) or slopes.dim() != 1 or not slopes.is_floating_point():
        raise ValueError(f"slopes must be a 1-D floating tensor (H,), got {getattr(slopes, 'shape', slopes)!r}")

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        distance = kv_idx - q_idx
        if score.dtype == slopes.dtype:  # one pass over the scores: score + m_h · d (d exact in float below 2²⁴)
            d = distance.to(score.dtype) if causal else distance.abs().to(score.dtype).neg_()
            return torch.addcmul(score, slopes[h], d)
        bias = slopes[h] * distance if causal else -slopes[h] * distance.abs()
        return score + bias.to(score.dtype)

    score_mod.additive = True  # score + bias: the tiled backend's backward passes dS through in closed form
    score_mod.alibi = (slopes, causal)  # what the tiled backend's C++ kernel computes itself
    return score_mod


# --------------------------------------------------------------------------- T5 buckets

def t5_relative_buckets(relative_position: Tensor, *, bidirectional: bool = True, num_buckets: int = 32,
                        max_distance: int = 128) -> Tensor:
    """T5's relative-position buckets (Raffel et al., 2020), Hugging Face's
    ``T5Attention._relative_position_bucket`` step for step.

    With ``r = key_pos - query_pos``. Bidirectional: half the buckets are for ``r > 0`` (offset
    by ``num_buckets / 2``), half for ``r <= 0``, and ``n = |r|``; unidirectional (decoder):
    ``n = max(-r, 0)`` over all ``num_buckets``. Within the ``N`` buckets of a direction,
    ``E = N // 2`` are exact and the rest log-spaced up to ``max_distance``::

        bucket(n) = n                                                   if n < E
                  = min(N - 1, E + ⌊log(n / E) / log(max_distance / E) · (N - E)⌋)  otherwise

    Args:
        relative_position: integer tensor of ``key_pos - query_pos``, any shape.
        bidirectional: encoder (True) or causal decoder (False).
        num_buckets: total number of buckets (32 in T5).
        max_distance: distances ``>= max_distance`` share the last bucket (128 in T5).

    Returns:
        long tensor of buckets in ``[0, num_buckets)``, the shape of ``relative_position``.

    Raises:
        ValueError: too few buckets (a direction needs ``>= 2``), or ``max_distance`` not above
            the exact range.
        TypeError: ``relative_position`` is not an integer tensor.
    """
    tensor("relative_position", relative_position, kind="integer")
    int_at_least("num_buckets", num_buckets, 4 if bidirectional else 2)
    n_dir = num_buckets // 2 if bidirectional else num_buckets
    max_exact = n_dir // 2
    if not (is_int(max_distance) and max_distance > max_exact):
        raise ValueError(f"max_distance must be an int > {max_exact} (the exact-bucket range), got {max_distance!r}")

    relative_position = relative_position.long()
    if bidirectional:
        buckets = (relative_position > 0).long() * n_dir
        n = relative_position.abs()
    else:
        buckets = torch.zeros_like(relative_position)
        n = (-relative_position).clamp(min=0)
    is_small = n < max_exact
    # clamp only keeps log() finite where the exact branch is taken anyway
    large = max_exact + (
        torch.log(n.clamp(min=max_exact).float() / max_exact) / math.log(max_distance / max_exact) * (n_dir - max_exact)
    ).long()
    large = large.clamp(max=n_dir - 1)
    return buckets + torch.where(is_small, n, large)
