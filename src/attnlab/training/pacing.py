"""Two pieces of :meth:`attnlab.training.trainer.Trainer.fit`'s bookkeeping, each with a name.

* :class:`LogWindow`: the train steps since the last ``"train"`` log record; its sums are
  checkpointed, so the log after a resume equals the uninterrupted run's.
* :class:`BudgetClock`: when a run with a ``time_budget`` times its steps, plans ``max_steps``
  (after ``PLAN_AT`` steps, from the steps ``PLAN_FROM..PLAN_AT``) and re-plans it (after each
  evaluation), from the wall time per step since its mark.
"""
from __future__ import annotations

import time
from typing import Optional

# a run with a time_budget is planned after step PLAN_AT, from the time of steps PLAN_FROM..PLAN_AT
PLAN_AT, PLAN_FROM = 22, 2


class LogWindow:
    """Loss sum, steps and tokens since the last ``"train"`` record, and when the window opened.

    :meth:`record` gives the window's record, ``mean loss = loss_sum / steps`` and
    ``tokens_per_s = tokens / seconds since it opened``; :meth:`restart` opens the next window.
    """

    def __init__(self, loss_sum: float = 0.0, steps: int = 0, tokens: int = 0) -> None:
        self.loss_sum, self.steps, self.tokens = loss_sum, steps, tokens
        self.t0 = time.perf_counter()

    def add(self, loss: float, tokens: int) -> None:
        """Count one optimiser step."""
        self.loss_sum += loss
        self.steps += 1
        self.tokens += tokens

    def record(self, *, step: int, lr: float, elapsed_s: float) -> dict:
        """The ``"train"`` record of this window (the window stays open until :meth:`restart`)."""
        rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        return {"kind": "train", "step": step, "loss": self.loss_sum / self.steps, "lr": lr, "tokens_per_s": rate,
                "elapsed_s": elapsed_s}

    def restart(self) -> None:
        """Open the next window, empty, now."""
        self.loss_sum, self.steps, self.tokens = 0.0, 0, 0
        self.t0 = time.perf_counter()

    def state(self) -> list:
        """``[loss_sum, steps, tokens]``, as checkpoints hold it (the opening time is not kept)."""
        return [self.loss_sum, self.steps, self.tokens]

    @classmethod
    def from_state(cls, state) -> "LogWindow":
        """The window of a checkpoint's ``log_window``."""
        loss_sum, steps, tokens = state
        return cls(float(loss_sum), int(steps), int(tokens))


class BudgetClock:
    """The mark ``(step, time)`` from which a ``time_budget`` run measures its wall time per step.

    The mark is set at the start of step ``PLAN_FROM`` (the first steps are slower: allocation,
    compilation), or of the first step after a resume of a run that was already planned.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.mark: Optional[tuple[int, float]] = None

    def step_starts(self, step: int, planned: bool, t: float) -> None:
        """Set the mark at the start of ``step`` (at time ``t``) if timing starts here."""
        if self.enabled and self.mark is None and (planned or step >= PLAN_FROM):
            self.mark = (step, t)

    def plan_due(self, step: int, planned: bool) -> Optional[float]:
        """After ``step`` steps: the seconds per step to plan with, when the first plan is due; else None."""
        if self.mark is not None and not planned and step - self.mark[0] >= PLAN_AT - PLAN_FROM:
            return (time.perf_counter() - self.mark[1]) / (step - self.mark[0])
        return None

    def replan_due(self, step: int, planned: bool, *, last: bool, eval_every: int) -> bool:
        """A re-plan is due after each evaluation step of a planned run (not after its last step)."""
        return self.mark is not None and planned and not last and bool(eval_every) and step % eval_every == 0
