"""Key/value cache for incremental decoding.

Decoding token ``t`` needs the keys and values of tokens ``0..t``; recomputing them every step
costs O(t) projections per token. The cache keeps the projected, heads-first keys and values
``(B, Hkv, L, D)`` and writes the new ones in place: a growing cache doubles its room when full
(``capacity = max(2 · capacity, L + L_new)``), so a decode step copies only its own entries, never the whole
prefix (no concatenation per step; amortised O(1) copies per entry). It also remembers whether every entry
written so far is finite (``finite``, from the new entries only), so the pipeline's NaN/inf check need not
re-read the whole cache at every step.

With a sliding window ``w`` (Mistral-style: the query at position ``p`` sees the keys ``p - w < j ≤ p``) the cache
is a ring buffer that holds O(w) entries however long the generation runs. Position ``p`` is written twice, at
slots ``p mod w`` and ``p mod w + w`` of a ``2w`` buffer, so the ``w`` newest entries in order of position are
always the contiguous slice ``[L mod w, L mod w + w)`` (``L`` entries written so far): no copy per step.
"""
from __future__ import annotations

from typing import Optional

import math

import torch
from torch import Tensor

from attnlab._checks import boolean, is_int, positive_int


def _tracing() -> bool:
    """Whether a graph is being recorded (``torch.jit`` tracing, as the ONNX exporter does)."""
    return torch.jit.is_tracing() or torch.onnx.is_in_onnx_export()


class KVCache:
    """Cached keys and values of one attention layer.

    Args:
        max_length: preallocate room for this many positions (a *static* cache: no
            reallocation at all, so memory is known up front); ``None`` grows, doubling its room when full.
        static: cross-attention mode: the first :meth:`update` stores the projected memory and
            every later call returns it unchanged (the encoder output does not change while
            decoding).
        window: keep only the keys a sliding window of this width can still see (a ring buffer of
            ``2 * window`` slots). :meth:`update` then returns the entries of the last ``window - 1``
            positions before the new ones, followed by the new ones: the attention must apply the same
            window (bottom-right aligned, as the pipeline's ``window`` and ``causal`` masks are).
            ``length`` still counts every position written (rotary positions follow it).

    Raises:
        ValueError: ``max_length`` or ``window`` is not a positive int, both are given, or an update would
            overflow ``max_length``.
    """

    def __init__(self, *, max_length: Optional[int] = None, static: bool = False, window: Optional[int] = None):
        positive_int("max_length", max_length, optional=True)
        positive_int("window", window, optional=True)
        boolean("static", static)
        if window is not None and (max_length is not None or static):
            raise ValueError("window is a cache of its own: give it without max_length or static")
        self.max_length = max_length
        self.static = static
        self.window = window
        self.k: Optional[Tensor] = None
        self.v: Optional[Tensor] = None
        self.length = 0
        self.finite = True  # no NaN / ±inf written so far (each update checks only its new entries)

    @property
    def filled(self) -> bool:
        return self.length > 0

    def mark(self) -> tuple[int, bool]:
        """What :meth:`rewind` needs to forget every update made after this call."""
        return self.length, self.finite

    def rewind(self, mark: tuple[int, bool]) -> None:
        """Forget the updates since :meth:`mark` (their entries are overwritten by the next ones; a growing or
        preallocated cache only: a ring's slots are not restored)."""
        if self.window is not None:
            raise ValueError("a windowed (ring) cache cannot be rewound")
        if not (isinstance(mark, tuple) and len(mark) == 2 and is_int(mark[0]) and 0 <= mark[0] <= self.length):
            raise ValueError(f"mark must be a value of mark() from this cache (a length in [0, {self.length}]), "
                             f"got {mark!r}")
        self.length, self.finite = mark

    def update(self, k: Tensor, v: Tensor, *, finite: Optional[bool] = None) -> tuple[Tensor, Tensor]:
        """Append ``k, v (B, Hkv, L_new, D)``; return all cached ``(k, v)`` up to now (views of the buffers).

        ``finite``: the caller already knows whether ``k`` and ``v`` are free of NaN and ±inf (e.g. from one
        check of the projection they were cut from); None reads them here.
        """
        if self.static and self.filled:
            return self.k, self.v
        self._check_entries(k, v)
        if self.finite:
            if finite is None:
                with torch.no_grad():
                    finite = math.isfinite(float(k.sum()) + float(v.sum()))
            self.finite = finite
        n = k.shape[2]
        if self.window is not None:
            return self._update_ring(k, v, n)
        self._check_room(n)
        if self.max_length is None and (self.k is None or _tracing()):
            # the first entries of a growing cache are kept as they are; while a graph is recorded (ONNX export)
            # it concatenates, a data flow that dynamic shapes follow (the buffers then hold no spare room)
            self.k, self.v = (k, v) if self.k is None else (torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2))
            self.length += n
            return self.k, self.v
        self._grow(k, v, n)
        self.k.narrow(2, self.length, n).copy_(k)
        self.v.narrow(2, self.length, n).copy_(v)
        self.length += n
        return self.k.narrow(2, 0, self.length), self.v.narrow(2, 0, self.length)

    def _check_entries(self, k: Tensor, v: Tensor) -> None:
        """``k``, ``v`` are ``(B, Hkv, L_new, D)`` tensors of one length, and match what the cache holds (batch, heads,
        width, dtype, device): a mismatch would otherwise be promoted, cast or reported deep in a concatenation."""
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, Tensor) or t.dim() != 4:
                got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                raise (ValueError if isinstance(t, Tensor) else TypeError)(
                    f"{name} must be a (B, Hkv, L_new, D) tensor, got {got}")
        if k.shape[:3] != v.shape[:3]:
            raise ValueError(f"k and v must agree in (B, Hkv, L_new), got k {tuple(k.shape)} and v {tuple(v.shape)}")
        if self.k is not None:
            for name, t, held in (("k", k, self.k), ("v", v, self.v)):
                if (t.shape[:2], t.shape[3]) != (held.shape[:2], held.shape[3]) or t.dtype != held.dtype \
                        or t.device != held.device:
                    raise ValueError(f"{name} of shape {tuple(t.shape)} {t.dtype} on {t.device} does not match the "
                                     f"cached entries (B, Hkv, ·, D) = {tuple(held.shape[:2])} · {held.shape[3]}, "
                                     f"{held.dtype} on {held.device}: reset() the cache before a new request")

    def room_for(self, n: int) -> Optional[tuple[Tensor, Tensor]]:
        """The whole buffers ``(B, Hkv, capacity, D)``, grown (as :meth:`update` grows them) so that ``n`` more entries
        fit after :attr:`length`, for a caller that writes the entries there itself and then calls
        :meth:`advance`; None where a caller cannot (nothing cached yet, cross-attention, a ring, buffers that are
        not contiguous, a graph being recorded).

        Raises:
            ValueError: ``n`` more entries would overflow ``max_length``.
        """
        if self.k is None or self.static or self.window is not None or _tracing():
            return None
        self._check_room(n)
        self._grow(self.k, self.v, n)
        if not (self.k.is_contiguous() and self.v.is_contiguous()):
            return None
        return self.k, self.v

    def advance(self, n: int, *, finite: bool) -> None:
        """Count ``n`` entries written after :attr:`length` into the buffers :meth:`room_for` returned; ``finite``:
        whether they are all free of NaN and ±inf (the caller checked)."""
        self.length += n
        self.finite = self.finite and finite

    def _check_room(self, n: int) -> None:
        if self.max_length is not None and self.length + n > self.max_length:
            raise ValueError(f"KVCache overflow: {self.length} cached + {n} new > max_length={self.max_length}")

    def _grow(self, k: Tensor, v: Tensor, n: int) -> None:
        """Buffers with room for ``n`` more entries: ``max_length`` positions (static), else double or enough."""
        if self.k is None or self.length + n > self.k.shape[2]:
            self._resize(k, v, self.max_length or max(2 * self.k.shape[2], self.length + n))

    def _resize(self, k: Tensor, v: Tensor, room: int) -> None:
        """New buffers of ``room`` positions (shaped as ``k``, ``v``), holding the entries written so far."""
        B, Hkv, _, D = k.shape
        old_k, old_v = self.k, self.v
        self.k = k.new_empty(B, Hkv, room, D)
        self.v = v.new_empty(B, Hkv, room, v.shape[-1])
        if old_k is not None and self.length:
            self.k.narrow(2, 0, self.length).copy_(old_k.narrow(2, 0, self.length))
            self.v.narrow(2, 0, self.length).copy_(old_v.narrow(2, 0, self.length))

    def _update_ring(self, k: Tensor, v: Tensor, n: int) -> tuple[Tensor, Tensor]:
        w = self.window
        if self.k is None:
            B, Hkv, _, D = k.shape
            self.k = k.new_empty(B, Hkv, 2 * w, D)
            self.v = v.new_empty(B, Hkv, 2 * w, v.shape[-1])
        result = None
        if n > 1:  # several new queries: the first of them still sees the w - 1 positions before it (copied
            pk, pv = self.stored()  # now, before the ring overwrites them)
            keep = pk.shape[2] - min(pk.shape[2], w - 1)
            result = torch.cat([pk[:, :, keep:], k], dim=2), torch.cat([pv[:, :, keep:], v], dim=2)
        if n == 1:
            s = self.length % w
            self.k[:, :, s] = self.k[:, :, s + w] = k[:, :, 0]
            self.v[:, :, s] = self.v[:, :, s + w] = v[:, :, 0]
        else:  # only the last w new entries can stay
            keep = min(n, w)
            slots = torch.arange(self.length + n - keep, self.length + n, device=k.device) % w
            for buf, new in ((self.k, k[:, :, n - keep:]), (self.v, v[:, :, n - keep:])):
                buf.index_copy_(2, slots, new)
                buf.index_copy_(2, slots + w, new)
        self.length += n
        return self.stored() if result is None else result

    def stored(self) -> tuple[Tensor, Tensor]:
        """The entries held now, in order of position: all of them, or a ring's ``window`` newest."""
        if self.k is None:
            raise ValueError("the cache is empty")
        if self.window is None:
            if self.max_length is None and _tracing():  # no spare room while tracing (see update)
                return self.k, self.v
            return self.k[:, :, :self.length], self.v[:, :, :self.length]
        w = self.window
        if self.length <= w:
            return self.k[:, :, :self.length], self.v[:, :, :self.length]
        s = self.length % w
        return self.k[:, :, s:s + w], self.v[:, :, s:s + w]

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
        if self.window is not None:
            return f"KVCache(window={self.window}, length={self.length})"
        kind = "static" if self.static else ("preallocated" if self.max_length else "growing")
        return f"KVCache({kind}, length={self.length})"
