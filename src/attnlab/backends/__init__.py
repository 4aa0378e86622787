"""Backend registry: every backend computes the same pipeline with one signature.

``fn(q, k, v, *, mask, causal, window, scale, score_mod, mask_mod, dropout_p, normalize,
top_k, return_weights) -> (out, weights or None)``, with arguments already validated by
:func:`attnlab.attention`. ``unsupported(...)`` returns why a backend cannot serve a request
(an empty string when it can). ``auto`` tries the backends in :data:`AUTO_ORDER`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from attnlab.backends import flex, reference, sdpa, tiled


@dataclass(frozen=True)
class Backend:
    name: str
    fn: Callable
    unsupported: Callable[..., str]


BACKENDS: dict[str, Backend] = {
    "reference": Backend("reference", reference.attention, reference.unsupported),
    "sdpa": Backend("sdpa", sdpa.attention, sdpa.unsupported),
    "tiled": Backend("tiled", tiled.attention, tiled.unsupported),
    # explicit only: compiling costs seconds per shape on first use, and CPU has no flex backward
    "flex": Backend("flex", flex.attention, flex.unsupported),
}

# Fastest first for dense requests; `reference` computes everything and ends the list.
AUTO_ORDER: list[str] = ["sdpa", "tiled", "reference"]
# For block-sparse masks (window, mask_mod) and score_mods: `tiled` skips the empty blocks
# (SDPA would compute them under a dense mask) and keeps memory O(N).
SPARSE_ORDER: list[str] = ["tiled", "sdpa", "reference"]


def select_backend(q, k, v, **request) -> Backend:
    """The first backend that can compute ``request``, from :data:`SPARSE_ORDER` when the request
    has a window, a mask_mod or a score_mod, else from :data:`AUTO_ORDER`."""
    sparse = request.get("window") is not None or request.get("mask_mod") is not None \
        or request.get("score_mod") is not None
    for name in (SPARSE_ORDER if sparse else AUTO_ORDER):
        b = BACKENDS[name]
        if not b.unsupported(q, k, v, **request):
            return b
    raise RuntimeError("no backend can compute this request")  # unreachable: reference takes all


def register_backend(name: str, fn: Callable, unsupported: Callable[..., str], *, auto_rank: int | None = None) -> None:
    """Add a backend; with ``auto_rank`` it also joins ``auto`` at that position."""
    BACKENDS[name] = Backend(name, fn, unsupported)
    if auto_rank is not None and name not in AUTO_ORDER:
        AUTO_ORDER.insert(auto_rank, name)
