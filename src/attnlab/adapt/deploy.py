"""Sparse attention at deployment: run a model trained with full attention with sliding-window
self-attention at inference.

With window ``w`` the query at position ``p`` attends only to keys ``j`` with ``p - j < w`` (and
``j - p < w`` for bidirectional layers)::

    out_p = Σ_{j : |p - j| < w, j visible} softmax_j(q_p·k_j / √d) v_j

The pipeline then picks the ``tiled`` backend, which skips the key blocks outside the band, so the
cost falls from O(L²) to O(L·w) per layer; the loss shows how much of the trained model's context
the task needed. Cross-attention is left alone.

Generating with a window keeps only the keys it can still see: ``generate(..., cache="window")`` holds a ring
buffer of ``w`` keys and values per layer (:class:`~attnlab.modules.cache.KVCache` with ``window``), so memory
stays O(w) for any number of tokens::

    with sliding_window(model, 256):
        ids = model.generate(prompt, max_new_tokens=100_000, cache="window")
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

from torch import nn

from attnlab._checks import positive_int
from attnlab.modules.multihead import MultiheadAttention
from attnlab.nn.block import DecoderLayer, EncoderLayer


def self_attention_modules(model: nn.Module) -> dict[str, MultiheadAttention]:
    """``{name: module}`` of the self-attention of every Encoder/DecoderLayer in ``model``."""
    return {f"{n}.self_attn" if n else "self_attn": m.self_attn for n, m in model.named_modules()
            if isinstance(m, (EncoderLayer, DecoderLayer))}


def kv_cache_bytes(model: nn.Module, positions: int, *, batch: int = 1, bytes_per_value: int = 4) -> int:
    """Bytes of the keys and values of ``positions`` positions of ``batch`` rows in every self-attention layer:
    what a decode's cache grows to, to compare with free memory before decoding."""
    per_position = sum(m.num_kv_heads * m.head_dim for m in self_attention_modules(model).values())
    return 2 * positions * batch * per_position * bytes_per_value


def window_cache_bytes(model: nn.Module, window: int, *, batch: int = 1, bytes_per_value: int = 4) -> int:
    """Bytes of the ring-buffer KV caches of a sliding ``window`` (each holds ``2 * window`` positions of keys and
    values per self-attention layer; see :class:`attnlab.modules.cache.KVCache`)."""
    return kv_cache_bytes(model, 2 * window, batch=batch, bytes_per_value=bytes_per_value)


def set_window(model: nn.Module, window: Optional[int]) -> dict[str, Optional[int]]:
    """Set the sliding window of every self-attention layer (``None``: full attention again).

    Returns:
        The previous window of each module, ``{name: window}`` (for :func:`restore_windows`).

    Raises:
        ValueError: ``window`` is not a positive int or None, or the model has no Encoder/DecoderLayer.
    """
    positive_int("window", window, optional=True)
    modules = self_attention_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no EncoderLayer/DecoderLayer self-attention to window")
    previous = {n: m.window for n, m in modules.items()}
    for m in modules.values():
        m.window = None if window is None else int(window)
    return previous


def restore_windows(model: nn.Module, previous: dict[str, Optional[int]]) -> None:
    """Put back the windows :func:`set_window` returned."""
    for name, window in previous.items():
        model.get_submodule(name).window = window


@contextmanager
def sliding_window(model: nn.Module, window: Optional[int]) -> Iterator[nn.Module]:
    """``with sliding_window(model, 64): ...`` runs ``model`` with window 64, then restores it."""
    previous = set_window(model, window)
    try:
        yield model
    finally:
        restore_windows(model, previous)
