"""Backend registry: every backend computes the same pipeline with one signature.

``fn(q, k, v, *, mask, causal, window, scale, score_mod, mask_mod, dropout_p, normalize,
top_k, return_weights) -> (out, weights or None)``, with arguments already validated by
:func:`attnlab.attention`; what else the registry knows of a backend is in
:class:`~attnlab.backends.base.Backend`. Every choice between backends is made in
:mod:`attnlab.backends.dispatch`: ``auto`` tries the backends in :data:`AUTO_ORDER` (dense requests) or
:data:`SPARSE_ORDER` (a window, a mask_mod or a score_mod), skipping those whose ``auto_when`` is false.
"""
from __future__ import annotations

from typing import Callable, Optional

from attnlab.backends import flex, reference, sdpa, short, tiled
from attnlab.backends.base import Backend, BackendUnavailable

BACKENDS: dict[str, Backend] = {
    "reference": Backend("reference", reference.attention, reference.unsupported),
    "sdpa": Backend("sdpa", sdpa.attention, sdpa.unsupported, lse=sdpa.attention_lse),
    # CPU training on short sequences: explicit products beat the fused kernel's backward there
    "short": Backend("short", short.attention, short.unsupported, auto_when=short.auto_when),
    "tiled": Backend("tiled", tiled.attention, tiled.unsupported, lse=tiled.attention_lse, auto_when=tiled.auto_when),
    # auto on CUDA only (flex.auto_when): compiling costs seconds per shape on first use, and CPU has no flex backward
    "flex": Backend("flex", flex.attention, flex.unsupported, unavailable=flex.unavailable, fallback="tiled",
                    auto_when=flex.auto_when),
}

# Fastest first for dense requests; `reference` computes everything and ends the list. `tiled` before `sdpa`:
# its auto_when takes the long causal or differentiated float32 requests its C++ kernel computes faster.
AUTO_ORDER: list[str] = ["short", "tiled", "sdpa", "reference"]
# For block-sparse masks (window, mask_mod) and score_mods: `flex` on CUDA (its auto_when), else `tiled`:
# both skip the empty blocks (SDPA would compute them under a dense mask) and keep memory O(N).
SPARSE_ORDER: list[str] = ["flex", "tiled", "short", "sdpa", "reference"]


def register_backend(name: str, fn: Callable, unsupported: Callable[..., str], *, auto_rank: Optional[int] = None,
                     lse: Optional[Callable] = None) -> None:
    """Add a backend; with ``auto_rank`` it also joins ``auto`` at that position of :data:`AUTO_ORDER`;
    with ``lse`` it can serve ``return_lse=True`` (see :class:`~attnlab.backends.base.Backend`)."""
    BACKENDS[name] = Backend(name, fn, unsupported, lse=lse)
    if auto_rank is not None and name not in AUTO_ORDER:
        AUTO_ORDER.insert(auto_rank, name)


from attnlab.backends.dispatch import select_backend  # noqa: E402  (dispatch reads the registry above)

__all__ = ["BACKENDS", "AUTO_ORDER", "SPARSE_ORDER", "Backend", "BackendUnavailable", "register_backend",
           "select_backend"]
