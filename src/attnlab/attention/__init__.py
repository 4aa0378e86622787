"""Deprecated: the attention modules moved to :mod:`attnlab.modules` (``attnlab.attention`` is the pipeline
function, and a package of the same name shadowed it).

``import attnlab.attention.multihead`` and ``from attnlab.attention import MultiheadAttention`` keep
working for one release, with a DeprecationWarning; ``attnlab.attention(q, k, v, ...)`` stays the pipeline
even after this package is imported (the import rebinds the name to this module, which forwards calls).
"""
from __future__ import annotations

import importlib
import sys
import types
import warnings

from attnlab.backends import dispatch
from attnlab.modules import *  # noqa: F401,F403  (the old names)
from attnlab.modules import __all__  # noqa: F401

warnings.warn("attnlab.attention.* (the package of modules) moved to attnlab.modules; this alias goes in the "
              "next release", DeprecationWarning, stacklevel=2)

_MOVED = ("additive", "cache", "linear", "location", "monotonic", "multihead", "multiplicative", "registry")
for _name in _MOVED:  # `import attnlab.attention.multihead` finds the module under its new name
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"attnlab.modules.{_name}")


class _CallablePackage(types.ModuleType):
    """Importing this package rebinds ``attnlab.attention`` to it: calls still reach the pipeline."""

    def __call__(self, *args, **kwargs):
        return dispatch.attention(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
