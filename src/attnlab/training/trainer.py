"""The training loop: accumulation, clipping, mixed precision, evaluation, checkpoints, exact resume.

One optimiser step ``s`` (0-based) with ``A = grad_accum`` micro-batches::

    lr ← schedule.lr_at(s)
    g  ← ∇ (1/A) Σ_a loss_fn(model, batch_a)        (DDP: also averaged over ranks)
    g  ← g · min(1, clip / ‖g‖₂)                     (clip > 0)
    θ  ← optimizer.step(θ, g)

Everything that decides the future of the run — parameters, optimiser and grad-scaler state, the
step, each rank's RNG, the data iterator's position — is in the checkpoint, so ``k`` steps, a stop
and a resume give bitwise the parameters of an uninterrupted run (CPU, fp32, same thread count).
Evaluation runs under a forked RNG and never changes the training trajectory.
"""
from __future__ import annotations

import contextlib
import math
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn
from attnlab._runtime import progress_bar as tqdm

from attnlab import _native
from attnlab._checks import stored_dtype
from attnlab.adapt.int8_training import int8_training
from attnlab.training import distributed as D
from attnlab.training.activation_checkpointing import enable_gradient_checkpointing
from attnlab.training.checkpoint import (latest_checkpoint, latest_intact_checkpoint, rng_state, save_checkpoint,
                                        set_rng_state)
from attnlab.training.config import DTYPES, TrainConfig, run_dtype
from attnlab.training.optim import build_optimizer, clip_grad_norm_
from attnlab.training.pacing import PLAN_AT, BudgetClock, LogWindow  # noqa: F401  (PLAN_AT: part of this API)
from attnlab.training.reporting import MetricsLog, plot_loss_curve, write_json

__all__ = ["TrainConfig", "Trainer", "TrainingDivergedError", "enable_gradient_checkpointing"]



class TrainingDivergedError(RuntimeError):
    """The loss (or gradient norm) became NaN/inf; the run stopped before the bad update was applied."""


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


class Trainer:
    """Train ``model`` on ``train_batches`` with ``loss_fn``; evaluate, log and checkpoint into ``out_dir``.

    Args:
        model: the module to train (moved to ``config.device``).
        config: a :class:`TrainConfig`.
        train_batches: an endless iterator of batches; with ``state_dict``/``load_state_dict`` its
            position is checkpointed (needed for exact resume). Under DDP it yields this rank's shard
            and its state must be rank-independent (rank 0's is saved).
        loss_fn: ``loss_fn(model, batch) -> (mean loss Tensor, n_tokens int)``; called under autocast.
        evaluate: ``evaluate(model) -> dict`` with at least ``"val_loss"``; run on rank 0, in eval
            mode, without grad, in fp32, under a forked RNG.
        out_dir: receives checkpoints, ``metrics.jsonl``, ``metrics.json``, ``loss.png``.
        run_info: saved in every checkpoint as ``"run"`` (plain values): e.g. the recipe, preset and full
            settings the run was made with, so a resume never depends on a file beside the checkpoint.
        dtype_source: where an explicit ``config.dtype`` came from, printed and recorded as its reason
            ("asked for", "recipe default", ...; ``"auto"`` states its own reason).

    Raises:
        TypeError / ValueError: bad arguments (the message names them).
    """

    def __init__(self, model: nn.Module, config: TrainConfig, *, train_batches, loss_fn: Callable,
                 evaluate: Optional[Callable[[nn.Module], dict]] = None, out_dir: Union[str, Path],
                 run_info: Optional[dict] = None, dtype_source: str = "asked for") -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(config, TrainConfig):
            raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
        if not hasattr(train_batches, "__next__"):
            raise TypeError(f"train_batches must be an iterator (has __next__), got {type(train_batches).__name__}")
        if not callable(loss_fn):
            raise TypeError("loss_fn must be callable: loss_fn(model, batch) -> (loss, n_tokens)")
        if evaluate is not None and not callable(evaluate):
            raise TypeError("evaluate must be callable: evaluate(model) -> {'val_loss': ...}")
        self.config, self.train_batches, self.loss_fn, self.evaluate = config, train_batches, loss_fn, evaluate
        self.out_dir = Path(out_dir)
        self.dist = D.dist_info_from_env()
        self.device = D.resolve_device(config.device, self.dist)
        # "auto" -> what this machine computes natively (bf16 or fp32); printed once in fit, kept in metrics
        self.dtype, self.dtype_reason = run_dtype(config.dtype, self.device, int8_training=config.int8_training,
                                                  name="TrainConfig.dtype", source=dtype_source)
        self.model = model.to(self.device)
        self.int8_layers = self._int8(config)
        if config.grad_checkpointing:
            enable_gradient_checkpointing(self.model)
        self.optimizer = build_optimizer(self.model, name=config.optimizer, lr=config.lr, betas=config.betas,
                                         eps=config.eps, weight_decay=config.weight_decay,
                                         ns_dtype=torch.bfloat16 if self.dtype == "bf16" else torch.float32,
                                         muon_lr_scale=config.muon_lr_scale, muon_ns_steps=config.muon_ns_steps)
        self.params = list(self.model.parameters())  # (clipped each step: a list, not a generator walk per step)
        self.max_steps, self.planned = config.max_steps, False  # max_steps may be planned (time_budget)
        self._eval_s = 0.0  # one evaluation's time, measured by the plan
        self.schedule = config.schedule_fn()
        self.scaler = torch.amp.GradScaler("cuda") if self.dtype == "fp16" else None
        self.ddp = D.wrap_ddp(self.model, self.device)
        self.forward_model = torch.compile(self.ddp) if config.compile else self.ddp
        self.log = MetricsLog(self.out_dir / "metrics.jsonl", enabled=self.dist.is_main)
        self.step, self.best_val, self.best_step = 0, None, None
        self.tokens, self.train_time, self.prior_wall = 0, 0.0, 0.0
        self.history: list[dict] = []
        self.run_info = run_info
        self._window = LogWindow()  # checkpointed: the log after a resume equals the uninterrupted one

    def _int8(self, config: TrainConfig) -> list[str]:
        """``int8_training``: the model's linear layers (but an output head) made int8-product layers, in place;
        None: so where the products would be fp32 on the CPU and the native kernels are built."""
        want = config.int8_training
        if want is None:
            want = (self.device.type == "cpu" and self.dtype == "fp32" and not config.compile
                    and _native.available())
            self.int8_reason = "auto: the products would be fp32 here" if want else ""
        else:
            self.int8_reason = "asked for"
        if not want:
            return []
        if self.device.type != "cpu":
            raise ValueError(f"TrainConfig.int8_training runs on the CPU; the device is {self.device}")
        if config.compile:
            raise ValueError("TrainConfig.int8_training runs eagerly: compile=True traces PyTorch's operations, "
                             "not attnlab's kernels (set one of them False)")
        if not _native.available():
            raise ValueError(f"TrainConfig.int8_training needs attnlab's native kernels: {_native.status()}")
        return int8_training(self.model)

    # ---- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to continue exactly (collective under DDP: every rank must call it)."""
        data = self.train_batches.state_dict() if hasattr(self.train_batches, "state_dict") else None
        return {
            "format": "attnlab-train-1", "step": self.step, "max_steps": self.max_steps, "planned": self.planned,
            "plan_eval_s": self._eval_s,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "rng": D.gather_objects(rng_state()), "data": data,
            "best_val_loss": self.best_val, "best_step": self.best_step,
            "counters": {"tokens": self.tokens, "train_time_s": self.train_time, "wall_s": self._wall()},
            "config": asdict(self.config), "run": self.run_info, "log_window": self._window.state(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (model, optimiser, scaler, this rank's RNG, data position, counters)."""
        missing = {"step", "model", "optimizer", "rng"} - state.keys()
        if missing:
            raise ValueError(f"checkpoint lacks {sorted(missing)}: not written by attnlab's Trainer")
        own = self.model.state_dict()
        for name, t in state["model"].items():
            if name in own:
                stored_dtype(f"{name} of the checkpoint", t, own[name])
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        rngs = state["rng"]
        set_rng_state(rngs[self.dist.rank] if len(rngs) == self.dist.world_size else rngs[0])
        if state.get("data") is not None:
            if not hasattr(self.train_batches, "load_state_dict"):
                raise ValueError("the checkpoint holds a data position but train_batches has no load_state_dict")
            self.train_batches.load_state_dict(state["data"])
        self.step, self.best_val, self.best_step = state["step"], state.get("best_val_loss"), state.get("best_step")
        if state.get("planned"):  # keep the planned length (and so the schedule) of the interrupted run
            self.max_steps, self.planned = min(self.config.max_steps, state["max_steps"]), True
            self._eval_s = state.get("plan_eval_s", 0.0)
            self.schedule = self.config.schedule_fn(self.max_steps)
        c = state.get("counters", {})
        self.tokens, self.train_time = c.get("tokens", 0), c.get("train_time_s", 0.0)
        if state.get("log_window") is not None:
            self._window = LogWindow.from_state(state["log_window"])
        self.prior_wall = c.get("wall_s", 0.0)

    def _save(self) -> None:
        state = self.state_dict()
        if self.dist.is_main:
            save_checkpoint(state, self.out_dir, self.step, keep=self.config.keep_checkpoints)

    def _wall(self) -> float:
        return self.prior_wall + time.perf_counter() - self._t0

    # ---- the loop ----------------------------------------------------------------------------
    def fit(self, resume: bool = False) -> dict:
        """Train to ``max_steps`` (or ``max_seconds``); return the final metrics (also in ``metrics.json``).

        Args:
            resume: continue from the latest checkpoint in ``out_dir`` (a fresh start if there is none).

        Raises:
            ValueError: ``out_dir`` already holds checkpoints and ``resume`` is False.
            TrainingDivergedError: a non-finite loss or gradient norm (no checkpoint is written for it).
        """
        cfg, main = self.config, self.dist.is_main
        latest = self._start(resume)
        bar = tqdm(total=self.max_steps, initial=self.step, disable=not (cfg.progress and main), unit="step",
                   dynamic_ncols=True, mininterval=0.5, desc="train")
        last_eval = None
        self._window.t0 = time.perf_counter()  # the open log window's rate counts from here
        clock = BudgetClock(cfg.time_budget is not None)
        try:
            while self.step < self.max_steps:
                t = time.perf_counter()
                clock.step_starts(self.step, self.planned, t)  # timing for the plan, or re-plans after a resume
                loss, tokens, stop = self._train_step()
                self.train_time += time.perf_counter() - t
                self.step += 1
                step_s = clock.plan_due(self.step, self.planned)
                if step_s is not None:
                    self._plan(step_s)
                    bar.total = self.max_steps
                    bar.refresh()
                self.tokens += tokens
                self._window.add(loss, tokens)
                bar.update(1)
                last = self.step >= self.max_steps or stop
                if self.step % cfg.log_every == 0 or last:
                    rec = self._window.record(step=self.step, lr=self.schedule.lr_at(self.step - 1),
                                              elapsed_s=self._wall())
                    self._record(rec)
                    bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:,.0f}", refresh=False)
                    self._window.restart()
                if self.evaluate is not None and ((cfg.eval_every and self.step % cfg.eval_every == 0) or last):
                    last_eval = self._run_eval()
                    bar.set_postfix(loss=f"{loss:.4f}", val=f"{last_eval.get('val_loss', float('nan')):.4f}",
                                    refresh=False)
                if clock.replan_due(self.step, self.planned, last=last, eval_every=cfg.eval_every):
                    self._replan(clock.mark)  # every rank, evaluating or not
                    bar.total = self.max_steps
                if (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0) or last:
                    self._save()
                if stop:
                    break
        finally:
            bar.close()
        if self.evaluate is not None and last_eval is None and latest is not None and self.step >= self.max_steps:
            last_eval = self._run_eval()  # resumed after the end: report the final evaluation again
        return self._finish(last_eval)

    def _start(self, resume: bool) -> Optional[Path]:
        """Open the run: the output folder, the dtype line, then resume from the newest intact checkpoint
        (returned) or seed a fresh start (None). Refuses a folder with checkpoints unless ``resume``."""
        cfg, main = self.config, self.dist.is_main
        self._t0 = time.perf_counter()
        if main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            if cfg.progress:  # quiet runs still record it in metrics.json
                print(f"dtype: {self.dtype} ({self.dtype_reason})", file=sys.stderr)
                if self.int8_layers:
                    print(f"int8 products: {len(self.int8_layers)} linear layers ({self.int8_reason})", file=sys.stderr)
        latest = D.broadcast_object(latest_checkpoint(self.out_dir) if main else None)
        if latest is not None and not resume:
            raise ValueError(f"{self.out_dir} already holds checkpoints (latest {latest.name}): "
                             "resume to continue, or choose a new output folder")
        if latest is not None:  # the newest checkpoint that reads (a torn or empty newer one is skipped, warned)
            # read onto the CPU: load_state_dict moves weights and optimizer state to their parameters' device
            latest, state = latest_intact_checkpoint(self.out_dir, map_location="cpu",
                                                     warn=None if main else (lambda line: None))
            self.load_state_dict(state)
            self.history = self.log.truncate_after(self.step)
        else:
            torch.manual_seed(cfg.seed + self.dist.rank)
            random.seed(cfg.seed + self.dist.rank)
            self.log.reset()
        self.model.train()
        return latest

    def _train_step(self) -> tuple[float, int, bool]:
        """One optimiser step; returns (mean loss over ranks, tokens over ranks, stop requested by any rank)."""
        cfg = self.config
        lr = self.schedule.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        dtype = DTYPES[self.dtype]
        autocast = (lambda: torch.autocast(self.device.type, dtype=dtype)) if dtype else contextlib.nullcontext
        loss_sum, tokens = 0.0, 0
        for micro in range(cfg.grad_accum):
            batch = _to_device(next(self.train_batches), self.device)
            no_sync = micro < cfg.grad_accum - 1 and self.ddp is not self.model
            with self.ddp.no_sync() if no_sync else contextlib.nullcontext():
                with autocast():
                    loss, n = self.loss_fn(self.forward_model, batch)
                scaled = loss / cfg.grad_accum
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            loss_sum += loss.item()
            tokens += int(n)
        stop = cfg.max_seconds is not None and self._wall() >= cfg.max_seconds
        mean_loss = loss_sum / cfg.grad_accum
        if self.ddp is not self.model:  # every rank: the mean loss, all tokens, and stop if any rank is out of time
            stats = D.all_reduce_sum(torch.tensor([mean_loss, tokens, float(stop)], dtype=torch.float64,
                                                  device=self.device))
            mean_loss, tokens, stop = stats[0].item() / self.dist.world_size, int(stats[1].item()), stats[2].item() > 0
        if not math.isfinite(mean_loss):
            raise TrainingDivergedError(self._diverged(f"loss is {mean_loss}"))
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if cfg.clip > 0:
            norm = clip_grad_norm_(self.params, cfg.clip)
            if self.scaler is None and not math.isfinite(norm.item()):
                raise TrainingDivergedError(self._diverged(f"gradient norm is {norm.item()}"))
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return mean_loss, tokens, bool(stop)

    def _plan(self, step_s: float) -> None:
        """Set ``max_steps`` so the run ends within ``time_budget``: steps and evaluations that fit."""
        cfg = self.config
        eval_s = 0.0
        if self.evaluate is not None and self.dist.is_main:
            t = time.perf_counter()
            self._run_eval()  # also times one evaluation
            eval_s = time.perf_counter() - t
        self.planned, self._eval_s = True, eval_s
        self._fit_length(step_s + (eval_s / cfg.eval_every if cfg.eval_every else 0.0), kind="plan", eval_s=eval_s)

    def _replan(self, mark: tuple[int, float]) -> None:
        """Re-fit ``max_steps`` to the budget left, from the wall time per step since ``mark`` = (step, time).

        That time includes evaluations, checkpoints and a machine slower (or faster) than during the
        first plan, so the cosine still ends inside ``time_budget`` instead of being cut by
        ``max_seconds`` before it decays. The schedule is rebuilt for the new length (a small step in
        the learning rate); the length is saved in checkpoints like the first plan.
        """
        self._fit_length((time.perf_counter() - mark[1]) / max(1, self.step - mark[0]), kind="replan")

    def _fit_length(self, per_step: float, *, kind: str, **record) -> None:
        """``max_steps`` = the steps of ``per_step`` seconds that fit in the budget left (less the final
        evaluation and files), rank 0's answer on every rank; the schedule follows; logged when it changes."""
        cfg = self.config
        remaining = cfg.time_budget - self._wall() - self._eval_s - 1.0
        fit = self.step + max(1, int(0.97 * remaining / per_step))
        planned = D.broadcast_object(min(cfg.max_steps, fit) if self.dist.is_main else None)
        if kind == "plan" or planned != self.max_steps:
            self.max_steps = planned
            self.schedule = cfg.schedule_fn(planned)
            self._record({"kind": kind, "step": self.step, "max_steps": planned, "step_s": per_step, **record,
                          "elapsed_s": self._wall()})

    def _diverged(self, what: str) -> str:
        good = latest_checkpoint(self.out_dir)
        where = f"last good checkpoint: {good}" if good else "no checkpoint was written yet"
        return (f"training diverged at step {self.step + 1}: {what}; stopped before the update ({where}). "
                "Try a lower lr or more warmup_steps.")

    def _run_eval(self) -> dict:
        """``evaluate(model)`` on rank 0 in eval mode, no grad, fp32, RNG untouched; logged and tracked."""
        if not self.dist.is_main:
            return {}
        py_state = random.getstate()
        self.model.eval()
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                result = self.evaluate(self.model)
        finally:
            self.model.train()
            random.setstate(py_state)
        if not isinstance(result, dict) or "val_loss" not in result:
            raise TypeError(f"evaluate(model) must return a dict with 'val_loss', got {result!r}")
        result = {k: (v.item() if isinstance(v, Tensor) and v.numel() == 1 else v) for k, v in result.items()}
        val = float(result["val_loss"])
        if math.isfinite(val) and (self.best_val is None or val < self.best_val):
            self.best_val, self.best_step = val, self.step
        self._record({"kind": "eval", "step": self.step, **result, "elapsed_s": self._wall()})
        return result

    def _record(self, rec: dict) -> None:
        self.history.append(rec)
        self.log.append(rec)

    def _finish(self, last_eval: Optional[dict]) -> dict:
        wall = self._wall()
        metrics = {"steps": self.step, "train_tokens": self.tokens,
                   "train_tokens_per_s": self.tokens / self.train_time if self.train_time > 0 else 0.0,
                   "train_time_s": self.train_time, "wall_s": wall,
                   "dtype": self.dtype, "dtype_reason": self.dtype_reason, "int8_layers": len(self.int8_layers)}
        train = [r for r in self.history if r.get("kind") == "train"]
        if train:
            metrics["train_loss"] = train[-1]["loss"]
        if last_eval:
            metrics.update(last_eval)
        metrics["best_val_loss"], metrics["best_step"] = self.best_val, self.best_step
        if self.dist.is_main:
            write_json(self.out_dir / "metrics.json", metrics)
            plot_loss_curve(self.history, self.out_dir / "loss.png", title=self.out_dir.name)
        return D.broadcast_object(metrics)
