"""What a backend is: the record the registry holds, and the one way a backend says "not here, not now".

A backend is a function with the pipeline's signature::

    fn(q, k, v, *, mask, causal, window, scale, score_mod, mask_mod, dropout_p, normalize, top_k,
       return_weights) -> (out, weights or None)

plus questions the dispatcher (:mod:`attnlab.backends.dispatch`) asks before it calls it. Every choice
between backends is made there, from these answers; no backend calls another.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


class BackendUnavailable(RuntimeError):
    """Raised by a backend that finds, while running, that it cannot run here (e.g. its kernel failed to
    compile); the dispatcher then runs the backend's registered ``fallback``."""


@dataclass(frozen=True)
class Backend:
    """One registered backend.

    Attributes:
        name: the name users pass as ``backend=``.
        fn: the computation (signature above).
        unsupported: ``unsupported(q, k, v, **request) -> str``: why the backend can never compute this
            request ("" when it can); an explicit request it cannot compute is refused with this reason.
        lse: ``lse(q, k, v, **request) -> (out, lse)``: the output and each row's log-sum-exp
            ``LSE_i = log Σ_j e^(s_ij)``, for backends that keep it (``return_lse=True``).
        unavailable: ``unavailable(q, k, v, **request) -> str``: why the backend cannot run this request
            on this device and in this state ("" when it can), e.g. no backward on CPU; the dispatcher then
            runs ``fallback`` instead, saying why at DEBUG on the ``attnlab.backends.<name>`` logger.
        fallback: the backend that computes what ``unavailable`` turns away.
        auto_when: ``auto_when(q, k, v, **request) -> bool``: ``auto`` considers this backend only when
            true (a backend that is exact everywhere but fast only in some regime).
    """

    name: str
    fn: Callable
    unsupported: Callable[..., str]
    lse: Optional[Callable] = None
    unavailable: Optional[Callable[..., str]] = None
    fallback: Optional[str] = None
    auto_when: Optional[Callable[..., bool]] = None
