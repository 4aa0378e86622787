"""Key/value cache for incremental decoding.

Decoding token ``t`` needs the keys and values of tokens ``0..t``; recomputing them every step
costs O(t) projections per token. The cache keeps the projected, heads-first keys and values
``(B, Hkv, L, D)`` and appends the new ones. It also remembers whether every entry written so far is finite
(``finite``, from the new entries only), so the pipeline's NaN/inf check need not re-read the whole cache
at every step.
"""
from __future__ import annotations

from typing import Optional

import math

import torch
from torch import Tensor

from attnlab._checks import positive_int


class KVCache:
    """Cached keys and values of one attention layer.

    Args:
        max_length: preallocate room for this many positions (a *static* cache: no
            reallocation per step, so memory is known up front); ``None`` grows by concatenation.
        static: cross-attention mode: the first :meth:`update` stores the projected memory and
            every later call returns it unchanged (the encoder output does not change while
            decoding).

    Raises:
        ValueError: ``max_length`` is not a positive int, or an update would overflow it.
    """

    def __init__(self, *, max_length: Optional[int] = None, static: bool = False):
        positive_int("max_length", max_length, optional=True)
        self.max_length = max_length
        self.static = static
        self.k: Optional[Tensor] = None
        self.v: Optional[Tensor] = None
        self.length = 0
        self.finite = True  # no NaN / ±inf written so far (each update checks only its new entries)

    @property
    def filled(self) -> bool:
        return self.length > 0

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``k, v (B, Hkv, L_new, D)``; return all cached ``(k, v)`` up to now."""
        if self.static and self.filled:
            return self.k, self.v
        if self.finite:
            with torch.no_grad():
                self.finite = math.isfinite(float(k.sum()) + float(v.sum()))
        n = k.shape[2]
        if self.max_length is None:
            if self.k is None:
                self.k, self.v = k, v
            else:
                self.k = torch.cat([self.k, k], dim=2)
                self.v = torch.cat([self.v, v], dim=2)
            self.length += n
            return self.k, self.v
        if self.length + n > self.max_length:
            raise ValueError(
                f"KVCache overflow: {self.length} cached + {n} new > max_length={self.max_length}"
            )
        if self.k is None:
            B, Hkv, _, D = k.shape
            self.k = k.new_empty(B, Hkv, self.max_length, D)
            self.v = v.new_empty(B, Hkv, self.max_length, v.shape[-1])
        self.k[:, :, self.length:self.length + n] = k
        self.v[:, :, self.length:self.length + n] = v
        self.length += n
        return self.k[:, :, :self.length], self.v[:, :, :self.length]

    def reorder(self, index: Tensor) -> None:
        """Select batch rows (beam search: keep the caches of the surviving beams)."""
        if self.k is not None:
            self.k = self.k.index_select(0, index)
            self.v = self.v.index_select(0, index)

    def reset(self) -> None:
        self.k = self.v = None
        self.length = 0
        self.finite = True

    def __repr__(self) -> str:
        kind = "static" if self.static else ("preallocated" if self.max_length else "growing")
        return f"KVCache({kind}, length={self.length})"
