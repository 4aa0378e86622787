"""Learning-rate schedules as pure functions of the step (so a resumed run is exact).

With peak rate ``η``, floor ``η_min``, ``w`` warm-up steps and ``S`` total steps, step ``s = 0, 1, …``:

- ``cosine`` (nanoGPT's ``get_lr``)::

      η(s) = η · (s + 1) / (w + 1)                                   s < w
      η(s) = η_min + ½ (η − η_min) (1 + cos(π (s − w) / (S − w)))     w ≤ s ≤ S
      η(s) = η_min                                                   s > S

- ``noam`` / inverse square root (Vaswani et al. 2017, with the model-size factor folded into ``η``)::

      η(s) = η · min(t / w, √(w / t)),   t = s + 1     (peak η at t = w)

- ``constant``: ``η · (s + 1) / (w + 1)`` while ``s < w``, then ``η``.

- ``wsd`` (warmup–stable–decay, Hu et al. 2024 "MiniCPM"; Hägele et al. 2024): the warm-up above, ``η`` until the
  last ``f = decay_fraction`` of the steps after it, then a linear decay to ``η_min`` at ``S``::

      d = w + (1 − f)(S − w)
      η(s) = η                                   w ≤ s < d
      η(s) = η_min + (η − η_min) (S − s) / (S − d)   d ≤ s ≤ S;    η_min after S

  A run whose length is re-planned (``time_budget``) keeps its stable phase: only where the decay starts moves.

The trainer writes ``lr_at(s)`` into every parameter group before step ``s``; a
``torch.optim.lr_scheduler.LambdaLR`` view is available through :meth:`Schedule.lambda_lr`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnlab._checks import int_at_least, is_real, non_negative_number, one_of

__all__ = ["SCHEDULES", "Schedule"]

SCHEDULES = ("cosine", "noam", "constant", "wsd")


@dataclass(frozen=True)
class Schedule:
    """A learning-rate schedule; call :meth:`lr_at` with the 0-based step.

    Args:
        kind: one of :data:`SCHEDULES`.
        lr: peak learning rate ``η``.
        min_lr: floor ``η_min`` of the cosine and wsd decays (ignored by the others).
        warmup_steps: ``w``; must be >= 1 for ``noam``.
        total_steps: ``S``, the end of the cosine and wsd decays.
        decay_fraction: ``f`` in ``(0, 1]``, the share of the steps after warm-up that ``wsd`` decays over.

    Raises:
        ValueError: unknown ``kind`` or an out-of-range argument (the message names it).
    """

    kind: str
    lr: float
    min_lr: float = 0.0
    warmup_steps: int = 0
    total_steps: int = 1
    decay_fraction: float = 0.2

    def __post_init__(self) -> None:
        one_of("schedule", self.kind, SCHEDULES)
        for name in ("lr", "min_lr"):
            non_negative_number(name, getattr(self, name), finite=True)
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must be <= lr ({self.lr})")
        for name, lo in (("warmup_steps", 0), ("total_steps", 1)):
            int_at_least(name, getattr(self, name), lo)
        if not (is_real(self.decay_fraction) and 0.0 < self.decay_fraction <= 1.0):  # (a bool is refused; NaN fails the bounds)
            raise ValueError(f"decay_fraction must be in (0, 1], got {self.decay_fraction!r}")
        if self.kind == "noam" and self.warmup_steps < 1:
            raise ValueError("warmup_steps must be >= 1 for the noam schedule")

    def lr_at(self, step: int) -> float:
        """The learning rate of 0-based step ``step`` (see the module docstring for the formulas)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        w = self.warmup_steps
        if self.kind == "noam":
            t = step + 1
            return self.lr * min(t / w, math.sqrt(w / t))
        if step < w:
            return self.lr * (step + 1) / (w + 1)
        if self.kind == "constant":
            return self.lr
        if step > self.total_steps or self.total_steps <= w:
            return self.min_lr
        if self.kind == "wsd":
            d = w + (1.0 - self.decay_fraction) * (self.total_steps - w)
            if step < d:
                return self.lr
            return self.min_lr + (self.lr - self.min_lr) * (self.total_steps - step) / (self.total_steps - d)
        ratio = (step - w) / (self.total_steps - w)
        return self.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (self.lr - self.min_lr)

    def lambda_lr(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        """The same schedule as a ``LambdaLR`` (factor ``lr_at(s) / lr`` on each group's initial lr)."""
        peak = self.lr if self.lr > 0 else 1.0
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: self.lr_at(s) / peak)
