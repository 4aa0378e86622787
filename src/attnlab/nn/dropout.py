"""``Dropout``: :class:`torch.nn.Dropout` computed by the cheap CPU kernel of
:mod:`attnlab.functional.dropout` (``y = x · m / (1 − p′)`` in training; see there).

``dropout`` and ``keep_mask`` are re-exported from :mod:`attnlab.functional.dropout` so that
``from attnlab.nn.dropout import dropout`` keeps working.
"""
from __future__ import annotations

from torch import Tensor, nn

from attnlab.functional.dropout import dropout, keep_mask

__all__ = ["Dropout", "dropout", "keep_mask"]


class Dropout(nn.Dropout):
    """:class:`torch.nn.Dropout` (same arguments, ``p`` and ``inplace``) computed by :func:`dropout`."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) if self.inplace else dropout(x, self.p, self.training)
