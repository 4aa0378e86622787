"""Deprecated location of :func:`attnlab.attention` and :func:`attnlab.attention_weights`.

The pipeline and its dispatch live in :mod:`attnlab.backends.dispatch` (one module for every choice of
backend); import them from ``attnlab``. This module forwards the old names, with a DeprecationWarning,
for one release.
"""
from __future__ import annotations

import warnings

_MOVED = {"attention": "attnlab.backends.dispatch", "attention_weights": "attnlab.backends.dispatch",
          "ScoreMod": "attnlab.functional.request", "_prepare": "attnlab.functional.request",
          "_check_qkv": "attnlab.functional.request"}


def __getattr__(name: str):
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from attnlab.backends import dispatch  # the one upward import, allowed to this alias by tests/test_layering.py
    from attnlab.functional import request

    where = _MOVED[name]
    new = name.lstrip("_")
    warnings.warn(f"attnlab.functional.attention.{name} moved to {where}.{new} (import attention and "
                  "attention_weights from attnlab); this alias goes in the next release",
                  DeprecationWarning, stacklevel=2)
    return getattr(dispatch if where.endswith("dispatch") else request, new)
