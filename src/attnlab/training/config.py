""":class:`TrainConfig`: the trainer's hyper-parameters, validated with errors that name the field."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import Optional

import torch

from attnlab._runtime import DTYPE_CHOICES, check_dtype_name, resolve_dtype
from attnlab.training.optim import OPTIMIZERS
from attnlab.training.schedules import SCHEDULES, Schedule

__all__ = ["DTYPES", "TrainConfig"]

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def run_dtype(dtype: str, device, *, int8_training: Optional[bool], name: str = "dtype",
              source: str = "asked for") -> tuple[str, str]:
    """The precision a training run computes in, and why (what :class:`~attnlab.training.trainer.Trainer` uses):
    :func:`attnlab._runtime.resolve_dtype`, except that ``"auto"`` with ``int8_training=True`` on a CPU is fp32 — the
    linear layers' products are int8 either way, bf16 autocast would only cast around them, and a layer's fused
    training node is float32 (faster than bf16 there: see docs/performance.md).
    ``source``: where an explicit ``dtype`` came from, its reason (e.g. "asked for", "recipe default")."""
    if int8_training is True and dtype == "auto" and torch.device(device).type == "cpu":
        return "fp32", "auto with int8 products: bf16 would only cast around them"
    return resolve_dtype(dtype, device, name=name, source=source)


@dataclass
class TrainConfig:
    """Hyper-parameters of :class:`~attnlab.training.trainer.Trainer` (ValueError naming a bad field).

    ``eval_every`` / ``checkpoint_every`` = 0 mean "only at the end"; ``clip`` = 0 turns clipping
    off. ``dtype``: ``"auto"`` = bf16 where the machine computes it natively and faster, else fp32
    (:func:`attnlab._runtime.resolve_dtype`; the trainer prints and records the choice), and fp32 on the CPU with
    ``int8_training=True`` (the products are int8 either way; bf16 would only cast around them); ``"bf16"``
    autocasts on CPU or CUDA, ``"fp16"`` (CUDA only) adds a ``GradScaler``. ``compile`` runs the forward through
    ``torch.compile``.
    ``optimizer="muon"`` only: ``muon_lr_scale`` (the hidden matrices' lr is that times the schedule's) and
    ``muon_ns_steps`` (Newton–Schulz steps), see :class:`~attnlab.training.optim.Muon`. ``schedule``: one of
    :data:`~attnlab.training.schedules.SCHEDULES`; ``decay_fraction`` is the share of the steps ``"wsd"`` decays over.
    ``int8_training``: the linear layers' three products in int8 on the CPU (all but an output head;
    :mod:`attnlab.adapt.int8_training`), the rest in ``dtype``; None: where the run's products would be fp32 on
    the CPU (no native bf16, or ``dtype="fp32"``) of an eager run, there int8 runs them ~2× as fast. Under DDP each
    rank rounds its own tokens' columns for ∂L/∂W: N ranks × B rows equal N·B rows up to those roundings.

    Time limits (seconds of ``fit``):

    - ``max_seconds``: a hard stop at the first step boundary past it (then the final evaluation
      and checkpoint).
    - ``time_budget``: plan the run to end within it. After :data:`PLAN_AT` steps the trainer
      times a step and one evaluation and sets the run's length to
      ``min(max_steps, steps that fit)``, so the cosine schedule decays fully inside the budget.
      At each later evaluation it re-plans from the wall time per step so far (evaluations,
      checkpoints and a machine that slowed down included; a ``replan`` record in the metrics).
      The planned length is saved in checkpoints (a resumed run keeps it and re-plans from its own
      pace); it depends on the machine's speed, so two runs on different machines differ in length.
    """

    max_steps: int = 1000
    lr: float = 1e-3
    min_lr: float = 1e-4
    optimizer: str = "adamw"
    muon_lr_scale: float = 1.0
    muon_ns_steps: int = 5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    schedule: str = "cosine"
    decay_fraction: float = 0.2
    warmup_steps: int = 0
    grad_accum: int = 1
    clip: float = 1.0
    dtype: str = "fp32"
    int8_training: Optional[bool] = False
    grad_checkpointing: bool = False
    compile: bool = False
    eval_every: int = 0
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    log_every: int = 10
    seed: int = 0
    device: str = "cpu"
    max_seconds: Optional[float] = None
    time_budget: Optional[float] = None
    progress: bool = True

    @classmethod
    def of(cls, settings: "TrainConfig") -> "TrainConfig":
        """The trainer's fields of ``settings`` (a recipe's subclass), Muon's only with Muon: a recipe's own Muon
        defaults are not TrainConfig's, and without Muon they are unused."""
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)
                      if settings.optimizer == "muon" or not f.name.startswith("muon_")})

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise ValueError(f"TrainConfig.{name} must be {what}, got {getattr(self, name)!r}")

        def is_int(v) -> bool:  # a plain int, stricter than attnlab._checks.is_int: settings are written as JSON
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)

        for name in ("max_steps", "grad_accum", "keep_checkpoints", "log_every"):
            need(is_int(getattr(self, name)) and getattr(self, name) >= 1, name, "an int >= 1")
        for name in ("warmup_steps", "eval_every", "checkpoint_every", "seed"):
            need(is_int(getattr(self, name)) and getattr(self, name) >= 0, name, "an int >= 0")
        for name in ("lr", "min_lr", "eps", "weight_decay", "clip"):
            need(is_num(getattr(self, name)) and getattr(self, name) >= 0, name, "a finite number >= 0")
        need(self.lr > 0, "lr", "> 0")
        need(self.eps > 0, "eps", "a finite number > 0 (the optimiser divides by sqrt(v) + eps; 0 gives 0/0 = NaN)")
        need(self.min_lr <= self.lr, "min_lr", f"<= lr ({self.lr})")
        need(isinstance(self.betas, (tuple, list)) and len(self.betas) == 2
             and all(is_num(b) and 0 <= b < 1 for b in self.betas), "betas", "two numbers in [0, 1)")
        self.betas = tuple(float(b) for b in self.betas)
        need(self.optimizer in OPTIMIZERS, "optimizer", f"one of {list(OPTIMIZERS)}")
        need(is_num(self.muon_lr_scale) and self.muon_lr_scale > 0, "muon_lr_scale", "a finite number > 0")
        need(is_int(self.muon_ns_steps) and self.muon_ns_steps >= 1, "muon_ns_steps", "an int >= 1")
        if self.optimizer != "muon":  # unused: refused unless at TrainConfig's defaults or a recipe's (a subclass's)
            own = (type(self).muon_lr_scale, type(self).muon_ns_steps)
            need((self.muon_lr_scale, self.muon_ns_steps) in {(1.0, 5), own}, "muon_lr_scale",
                 f"left at its default ({own[0]}, muon_ns_steps {own[1]}) unless optimizer='muon'")
        need(self.schedule in SCHEDULES, "schedule", f"one of {list(SCHEDULES)}")
        need(is_num(self.decay_fraction) and 0 < self.decay_fraction <= 1, "decay_fraction", "a number in (0, 1]")
        need(isinstance(self.dtype, str) and self.dtype.lower() in DTYPE_CHOICES + ("float32", "bfloat16", "float16"),
             "dtype", f"one of {', '.join(DTYPE_CHOICES)}")
        self.dtype = check_dtype_name(self.dtype)
        for name in ("max_seconds", "time_budget"):
            v = getattr(self, name)
            need(v is None or (is_num(v) and v > 0), name, "None or a number > 0")
        need(self.int8_training is None or isinstance(self.int8_training, bool), "int8_training",
             "True, False or None (auto)")
        for name in ("grad_checkpointing", "compile", "progress"):
            need(isinstance(getattr(self, name), bool), name, "a bool")
        need(isinstance(self.device, str) and bool(self.device), "device", "a device string ('cpu', 'cuda', 'auto')")
        if self.device != "auto":
            from attnlab._limits import check_device

            try:
                check_device("device", self.device)
            except ValueError as e:
                raise ValueError(f"TrainConfig.{e}") from None
        self.schedule_fn()  # schedule-specific checks (noam needs warmup_steps >= 1)

    def schedule_fn(self, total_steps: Optional[int] = None) -> Schedule:
        """The learning-rate schedule over ``total_steps`` (default ``max_steps``)."""
        return Schedule(self.schedule, lr=float(self.lr), min_lr=float(self.min_lr), decay_fraction=self.decay_fraction,
                        warmup_steps=self.warmup_steps, total_steps=total_steps or self.max_steps)
