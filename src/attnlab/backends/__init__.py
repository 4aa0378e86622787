"""Backend registry: every backend computes the same pipeline with one signature.

``fn(q, k, v, *, mask, causal, window, scale, score_mod, mask_mod, dropout_p, normalize,
top_k, return_weights) -> (out, weights or None)``, with arguments already validated by
:func:`attnlab.attention`. ``unsupported(...)`` returns why a backend cannot serve a request
(an empty string when it can). ``auto`` tries the backends in :data:`AUTO_ORDER`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from attnlab.backends import reference, sdpa


@dataclass(frozen=True)
class Backend:
    name: str
    fn: Callable
    unsupported: Callable[..., str]


BACKENDS: dict[str, Backend] = {
    "reference": Backend("reference", reference.attention, reference.unsupported),
    "sdpa": Backend("sdpa", sdpa.attention, sdpa.unsupported),
}

# Fastest first; `reference` computes everything and ends the list.
AUTO_ORDER: list[str] = ["sdpa", "reference"]


def select_backend(q, k, v, **request) -> Backend:
    """The first backend in :data:`AUTO_ORDER` that can compute ``request``."""
    for name in AUTO_ORDER:
        b = BACKENDS[name]
        if not b.unsupported(q, k, v, **request):
            return b
    raise RuntimeError("no backend can compute this request")  # unreachable: reference takes all


def register_backend(name: str, fn: Callable, unsupported: Callable[..., str], *, auto_rank: int | None = None) -> None:
    """Add a backend; with ``auto_rank`` it also joins ``auto`` at that position."""
    BACKENDS[name] = Backend(name, fn, unsupported)
    if auto_rank is not None and name not in AUTO_ORDER:
        AUTO_ORDER.insert(auto_rank, name)
