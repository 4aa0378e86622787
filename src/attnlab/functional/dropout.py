"""The dropout kernel whose CPU mask costs a tenth of ``torch.bernoulli_``'s (the module is
:class:`attnlab.nn.dropout.Dropout`; the backends call :func:`dropout` on attention weights).

Inverted dropout (Srivastava et al. 2014), in training only::

    y = x · m / (1 − p′),   m_i = [r_i ≥ t],   r_i ~ U{0, …, 2¹⁵ − 1},   t = round(p · 2¹⁵),   p′ = t / 2¹⁵

so ``E[y] = x`` exactly, and the drop rate ``p′`` is ``p`` to within 2⁻¹⁶. On a CPU, torch's
``bernoulli_`` draws one double per element (~10 ms per million elements on 2 cores here, a quarter
of a small GPT's training step); four 15-bit draws per ``int64`` word from ``random_`` cost ~1 ms.
The draws come from torch's default generator, so ``torch.manual_seed`` and saved RNG states make
runs reproducible as before. On other devices this is :func:`torch.nn.functional.dropout`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["dropout", "keep_mask"]

_LEVELS = 1 << 15  # 15 random bits per draw: an int64 word gives 4 (its top sign bit is always 0)


def keep_mask(shape: torch.Size | tuple[int, ...], p: float, *, device=None) -> Tensor:
    """Bool mask of ``shape``, each entry ``True`` (kept) with probability ``1 − round(p · 2¹⁵) / 2¹⁵``."""
    n = math.prod(shape)
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_()
    draws = words.view(torch.int16)[:n].view(shape).bitwise_and(_LEVELS - 1)
    return draws >= round(p * _LEVELS)


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """``x · m / (1 − p′)`` (see the module docstring); ``x`` itself when not training or ``p == 0``."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p!r}")
    if not training or p == 0.0:
        return x
    threshold = round(p * _LEVELS)
    if x.device.type != "cpu" or threshold == _LEVELS:  # GPU bernoulli is fast; p ≈ 1 drops everything
        return F.dropout(x, p, True)
    scale = _LEVELS / (_LEVELS - threshold)
    return x * keep_mask(x.shape, p, device=x.device).to(x.dtype).mul_(scale)

