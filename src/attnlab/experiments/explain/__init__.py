"""``attnlab explain``: the classic questions about attention, answered by measurement.

Each experiment is a module with ``run(out_dir, *, seed=0, quick=False) -> dict``: it prints the
numbers it measures and writes ``NAME.png`` (plot), ``NAME.md`` (a short report: the numbers and
what they show) and ``NAME.json`` (the numbers) into ``out_dir``. A full run takes from seconds to about six
minutes on two CPU cores (:data:`FULL_RUN`, said before it starts); its training shows a progress bar and its other
stages a line each on standard error. ``quick=True`` takes seconds (smaller sizes, fewer steps): a smoke run that
draws no conclusion, except for the experiments in :data:`QUICK_CONCLUDES`, whose quick run reaches the full run's
conclusion (their tests assert the same claim of both).
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Union

# name -> (one-line description, "module:function")
EXPERIMENTS = {
    "scaling": ("why 1/sqrt(d_k): var(q.k) grows as d_k; saturation, entropy and gradient with and without it",
                "attnlab.experiments.explain.scaling:run"),
    "heads": ("one wide head vs several narrow heads vs heads summed, on a task that reads four positions",
              "attnlab.experiments.explain.heads:run"),
    "position": ("sinusoidal / learned / RoPE / ALiBi / none: train short, test long; the permutation test",
                 "attnlab.experiments.explain.position:run"),
    "linear": ("time and memory of exact vs linear attention vs a GRU as length grows; the crossover",
               "attnlab.experiments.explain.linear:run"),
    "receptive-field": ("effective receptive field (|dy_t/dx_s|) of a CNN, an RNN and self-attention by depth",
                        "attnlab.experiments.explain.receptive_field:run"),
    "redundancy": ("prune the heads of a trained model one by one and cumulatively: how many are needed?",
                   "attnlab.experiments.explain.redundancy:run"),
    "ensemble": ("is multi-head attention an ensemble? heads trained jointly vs independent heads averaged",
                 "attnlab.experiments.explain.ensemble:run"),
    "cross-lengths": ("cross-attention between sequences of different lengths: shapes, exact check, learned alignment",
                      "attnlab.experiments.explain.cross_lengths:run"),
    "more-heads": ("more heads at a fixed width: accuracy vs H and the per-head rank bottleneck",
                   "attnlab.experiments.explain.more_heads:run"),
    "addressing": ("attention vs a learned fixed average on associative recall: the weights find the key by content",
                   "attnlab.experiments.explain.addressing:run"),
    "parallel": ("why attention replaced recurrence: dependent steps, path length, 1 vs all threads, GRU vs attention",
                 "attnlab.experiments.explain.parallel:run"),
    "limits": ("what attention cannot express: parity vs length (one layer vs a GRU); order without positions",
               "attnlab.experiments.explain.limits:run"),
    "long-context": ("long context on a CPU: char models at contexts up to 2048, sliding window vs full attention",
                     "attnlab.experiments.explain.long_context:run"),
}


# a full run's computing time: measured as one core's CPU time, which an idle two-core CPU takes as wall time or less
# (a busy machine takes longer); said before the run starts
FULL_RUN = {"scaling": "10 s", "heads": "20 s", "position": "1 min", "linear": "20 s", "receptive-field": "15 s",
            "redundancy": "15 s", "ensemble": "15 s", "cross-lengths": "15 s", "more-heads": "15 s",
            "addressing": "15 s", "parallel": "10 s", "limits": "30 s", "long-context": "6 min"}

# the experiments whose quick run reaches the full run's conclusion (the others' quick runs are smoke runs)
QUICK_CONCLUDES = frozenset({"scaling", "receptive-field", "addressing"})


def run_experiment(name: str, out_dir: Union[str, Path], *, seed: int = 0, quick: bool = False) -> dict:
    """Run the experiment ``name`` (a key of :data:`EXPERIMENTS`) into ``out_dir``; return its numbers. A line on
    standard error says first what kind of run it is and how long a full run takes (:data:`FULL_RUN`).

    Raises:
        ValueError: unknown ``name`` (the message lists the known ones).
    """
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose one of {', '.join(EXPERIMENTS)}")
    from attnlab.experiments.explain._report import stage

    if not quick:
        stage(f"{name}: a full run, about {FULL_RUN[name]} of computing on two idle CPU cores (longer on a busy "
              "machine)")
    elif name in QUICK_CONCLUDES:
        stage(f"{name}: a quick run (seconds), which reaches the full run's conclusion")
    else:
        stage(f"{name}: a quick smoke run (seconds): no conclusion; a full run takes about {FULL_RUN[name]}")
    module, func = EXPERIMENTS[name][1].split(":")
    return getattr(importlib.import_module(module), func)(out_dir, seed=seed, quick=quick)


__all__ = ["EXPERIMENTS", "FULL_RUN", "QUICK_CONCLUDES", "run_experiment"]
