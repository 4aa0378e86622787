"""Tolerances derived from the dtype and the magnitudes compared, never from what one machine printed.

Two float computations of the same formula that differ only in summation order, blocking and kernel
(another library, another backend, a KV cache against a full forward, AVX2 against AVX-512 kernels)
differ by rounding. A dot product of ``n`` terms carries a relative error of about ``sqrt(n)·ε`` (random
rounding; ``n·ε`` in the worst case) of the sum of its absolute terms, and each of ``depth`` layers that
feeds the next adds its own, so the model used here is::

    atol = c · ε(dtype) · sqrt(n) · depth · scale,     scale = max(1, max |expected|)

``c`` (default 16) covers the few products and the softmax per layer and the worst-case tail over many
compared entries. Anything beyond it is not rounding: a test must fail.
"""
from __future__ import annotations

import math

import torch


def tolerance(expected: torch.Tensor, *, dtype: torch.dtype = torch.float32, n: int = 1, depth: int = 1,
              c: float = 16.0) -> float:
    """``c · ε(dtype) · sqrt(n) · depth · max(1, max|expected|)`` (see the module docstring)."""
    scale = max(1.0, float(expected.detach().abs().max())) if expected.numel() else 1.0
    return c * torch.finfo(dtype).eps * math.sqrt(n) * depth * scale
