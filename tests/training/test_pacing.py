"""The named pieces of Trainer.fit: the log window and the time-budget clock."""
from __future__ import annotations

import pytest

from attnlab.training.pacing import PLAN_AT, PLAN_FROM, BudgetClock, LogWindow


def test_log_window_means_and_checkpoint_state():
    w = LogWindow()
    w.add(2.0, 10)
    w.add(4.0, 30)
    rec = w.record(step=7, lr=0.1, elapsed_s=1.5)
    assert (rec["kind"], rec["step"], rec["loss"], rec["lr"], rec["elapsed_s"]) == ("train", 7, 3.0, 0.1, 1.5)
    assert rec["tokens_per_s"] > 0
    assert w.state() == [6.0, 2, 40]  # open until restarted: a checkpoint here keeps the sums
    again = LogWindow.from_state(w.state())
    assert again.state() == [6.0, 2, 40] and isinstance(again.state()[1], int)
    w.restart()
    assert w.state() == [0.0, 0, 0]


def test_budget_clock_marks_plans_and_replans():
    off = BudgetClock(False)
    off.step_starts(PLAN_FROM, planned=False, t=0.0)
    assert off.mark is None and off.plan_due(PLAN_AT, planned=False) is None

    clock = BudgetClock(True)
    clock.step_starts(PLAN_FROM - 1, planned=False, t=0.0)
    assert clock.mark is None  # the first steps are not timed
    clock.step_starts(PLAN_FROM, planned=False, t=5.0)
    clock.step_starts(PLAN_FROM + 1, planned=False, t=6.0)
    assert clock.mark == (PLAN_FROM, 5.0)  # set once
    assert clock.plan_due(PLAN_AT - 1, planned=False) is None
    assert clock.plan_due(PLAN_AT, planned=False) is not None
    assert clock.plan_due(PLAN_AT, planned=True) is None
    assert clock.replan_due(30, True, last=False, eval_every=10)
    assert not clock.replan_due(30, True, last=True, eval_every=10)
    assert not clock.replan_due(31, True, last=False, eval_every=10)
    assert not clock.replan_due(30, True, last=False, eval_every=0)
    assert not clock.replan_due(30, False, last=False, eval_every=10)


@pytest.mark.parametrize("step", [0, 1])
def test_budget_clock_marks_at_once_after_a_planned_resume(step):
    clock = BudgetClock(True)
    clock.step_starts(step, planned=True, t=2.0)
    assert clock.mark == (step, 2.0)
