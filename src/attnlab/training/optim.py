"""Optimisers with weight-decay groups: AdamW (Loshchilov & Hutter 2019), Adafactor (Shazeer & Stern 2018) and
Muon (Jordan et al. 2024) for the hidden matrices with AdamW for the rest.

Weight-decay rule (GPT-2 / nanoGPT's): every trainable parameter with ``dim >= 2`` is decayed —
the weight matrices of linear layers and the embedding tables — and every parameter with
``dim < 2`` is not: biases and the gains/offsets of LayerNorm/RMSNorm. A tied parameter (the LM
head sharing the token embedding) is counted once.

AdamW's decoupled update with decay ``λ``::

    m ← β₁ m + (1 − β₁) g;   v ← β₂ v + (1 − β₂) g²
    θ ← θ − lr · (λ θ + m̂ / (√v̂ + ε))        (m̂, v̂ bias-corrected)

Muon's update of a matrix ``θ (A, B)`` with momentum ``μ`` (Nesterov), then orthogonalised::

    M ← μ M + g;   U = g + μ M
    O = NS₅(U)                                 (≈ the U Vᵀ of U's SVD: every singular value ≈ 1)
    θ ← θ (1 − lr_M λ) − lr_M · 0.2 √max(A, B) · O        (lr_M = lr_scale · lr)

``NS₅`` is five Newton–Schulz steps ``X ← a X + (b X Xᵀ + c (X Xᵀ)²) X`` from ``X = U / ‖U‖_F`` (on the wide
orientation, ``(a, b, c) = (3.4445, −4.7750, 2.0315)``); the factor ``0.2 √max(A, B)`` (Moonshot's "match RMS
AdamW" rule, Liu et al. 2025) gives the update AdamW's RMS, so one ``lr`` and ``λ`` serve both optimisers;
``lr_scale`` (default 1) lets the matrices take a larger step than AdamW's parameters (Keller Jordan's runs give
Muon an update several times AdamW's RMS). The schedule writes ``lr``; the scale stays.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from attnlab import _native, _native_train
from attnlab._checks import is_real, non_negative_number, one_of, positive_number

__all__ = ["OPTIMIZERS", "param_groups", "build_optimizer", "clip_grad_norm_", "FusedAdamW", "Muon", "MuonWithAdamW",
           "muon_parameters", "orthogonalize"]

OPTIMIZERS = ("adamw", "adafactor", "muon")
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def param_groups(model: nn.Module, *, weight_decay: float) -> list[dict]:
    """Two groups of ``model``'s trainable parameters: ``dim >= 2`` with ``weight_decay``, the rest with 0.

    Empty groups are left out. Raises ValueError if the model has no trainable parameter.
    """
    decay, no_decay = [], []
    for _, p in model.named_parameters():  # tied parameters appear once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    if not decay and not no_decay:
        raise ValueError("model has no trainable parameters")
    groups = [{"params": decay, "weight_decay": float(weight_decay)},
              {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def clip_grad_norm_(params: list[Tensor], max_norm: float) -> Tensor:
    """Clip the gradients of ``params`` to a total L2 norm of ``max_norm``; returns the norm before clipping::

        ‖g‖ = (Σ_p Σ g_p²)^½;   g_p ← g_p · min(1, max_norm / (‖g‖ + 1e-6))

    ``torch.nn.utils.clip_grad_norm_``'s rule. Float32 CPU gradients go through one C++ call
    (:func:`attnlab._native_train.clip_grad_norm_`, timed by ``benchmarks/train_passes.py``), where PyTorch's CPU
    path runs a norm and a product per tensor; anything else (other dtypes or devices, sparse) through
    PyTorch's."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads and all(g.dtype == torch.float32 and g.device.type == "cpu" and g.layout == torch.strided
                     and g.is_contiguous() for g in grads) and _native.runs_on(grads[0]):
        return _native_train.clip_grad_norm_(grads, max_norm)
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def _closure_loss(closure) -> Optional[Tensor]:
    """An optimiser's ``step(closure)``: the loss the closure recomputes, with gradients enabled, or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def orthogonalize(u: Tensor, *, steps: int = 5, dtype: torch.dtype = torch.float32, eps: float = 1e-7) -> Tensor:
    """``NS_steps(u)`` of the module docstring: ``u (..., A, B)`` (a matrix or a stack of them) with its singular
    values pushed towards 1, computed in ``dtype`` (bf16 where the CPU multiplies it natively, as the training
    step) and returned in ``u``'s dtype."""
    a, b, c = NS_COEFFICIENTS
    x = u.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:  # X Xᵀ on the short side
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)
    for _ in range(steps):
        s = x @ x.mT
        x = a * x + (b * s + c * (s @ s)) @ x
    return (x.mT if tall else x).to(u.dtype)


class Muon(torch.optim.Optimizer):
    """Muon on 2-D parameters (the update of the module docstring).

    Args:
        params: matrices (``dim() == 2``) or groups of them.
        lr, weight_decay: as AdamW's (the ``0.2 √max(A, B)`` factor matches the update's RMS to AdamW's).
        momentum: ``μ`` (Nesterov).
        ns_steps: Newton–Schulz steps.
        ns_dtype: the dtype of the Newton–Schulz products.
        lr_scale: the matrices' learning rate is ``lr_scale · lr`` (``lr`` is what a schedule writes).

    Raises:
        ValueError: a parameter that is not a matrix, or an out-of-range hyper-parameter.
    """

    def __init__(self, params, *, lr: float, weight_decay: float = 0.0, momentum: float = 0.95, ns_steps: int = 5,
                 ns_dtype: torch.dtype = torch.float32, lr_scale: float = 1.0) -> None:
        for arg, value in (("lr", lr), ("weight_decay", weight_decay)):
            non_negative_number(arg, value)
        positive_number("lr_scale", lr_scale, finite=True)
        if not (is_real(momentum) and 0.0 <= momentum < 1.0):
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        if not (isinstance(ns_steps, int) and ns_steps >= 1):
            raise ValueError(f"ns_steps must be an int >= 1, got {ns_steps!r}")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, ns_steps=ns_steps))
        self.ns_dtype, self.lr_scale = ns_dtype, float(lr_scale)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"Muon updates matrices only; got a parameter of shape {tuple(p.shape)} "
                                     "(give vectors and embedding tables to AdamW: optimizer='muon' does)")

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            lr, wd, mu = group["lr"] * self.lr_scale, group["weight_decay"], group["momentum"]
            grads = [p.grad for p in params]
            bufs = [self.state[p].setdefault("momentum_buffer", torch.zeros_like(p)) for p in params]
            torch._foreach_mul_(bufs, mu)
            torch._foreach_add_(bufs, grads)
            updates = torch._foreach_add(grads, bufs, alpha=mu)  # Nesterov: g + μ M
            if wd:
                torch._foreach_mul_(params, 1.0 - lr * wd)
            by_shape: dict = {}  # matrices of one shape (up to a transpose) orthogonalised as one stack
            for p, u in zip(params, updates):
                by_shape.setdefault((min(p.shape), max(p.shape), p.dtype), []).append((p, u))
            for (_, wide, _), pairs in by_shape.items():
                stack = torch.stack([u if u.shape[0] <= u.shape[1] else u.mT for _, u in pairs])
                out = orthogonalize(stack, steps=group["ns_steps"], dtype=self.ns_dtype)
                targets = [p if p.shape[0] <= p.shape[1] else p.mT for p, _ in pairs]
                torch._foreach_add_(targets, list(out.unbind(0)), alpha=-lr * 0.2 * math.sqrt(wide))
        return loss


class FusedAdamW:
    """AdamW (the module docstring's update) as ``torch.optim.AdamW(fused=True)`` computes it — one call of the same
    fused kernel, ``torch._fused_adamw_``, per parameter group, device and dtype: the same parameters after every
    step, bit for bit — without ``torch.optim.Optimizer``'s machinery around it: its Python per parameter per step
    (~0.1 ms a step at nanogpt-cpu's 52 tensors) and the import of ``torch._dynamo`` that its first
    ``add_param_group`` triggers (~1 s of every training process, a 2000-step run's 3 %).

    ``param_groups`` (dicts with ``lr``, ``betas``, ``eps``, ``weight_decay``: a schedule writes ``lr``), ``state``
    (per parameter ``step``, ``exp_avg``, ``exp_avg_sq``), ``step``, ``zero_grad`` and ``state_dict`` /
    ``load_state_dict`` in ``torch.optim.AdamW``'s format: either loads the other's checkpoint. For floating-point
    parameters on CPU or CUDA (:func:`build_optimizer` takes it where torch's fused AdamW would run).
    """

    def __init__(self, groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float) -> None:
        self.defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False,
                             maximize=False, foreach=None, capturable=False, differentiable=False, fused=True,
                             decoupled_weight_decay=True)
        self.param_groups = [{**self.defaults, **g, "params": list(g["params"])} for g in groups]
        for p in (p for g in self.param_groups for p in g["params"]):
            if not self.takes(p):
                raise ValueError(f"FusedAdamW takes floating-point CPU or CUDA parameters, got {p.dtype} on "
                                 f"{p.device}")
        self.state: dict = {}
        # group index -> (its parameters with a gradient, their kernel calls' lists, the state they were made from);
        # a state replaced whole (load_state_dict, or ``opt.state = {}``) is seen, one entry edited in place is not
        self._plans: dict = {}

    @staticmethod
    def takes(p: Tensor) -> bool:
        """Whether the fused kernel can update ``p``: a floating-point tensor on the CPU or a CUDA device."""
        return p.is_floating_point() and p.device.type in ("cpu", "cuda")

    def _state(self, p: Tensor) -> dict:
        st = self.state.get(p)
        if st is None:  # as torch's fused AdamW: the step count a float32 scalar on the parameter's device
            st = self.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                  "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                  "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        return st

    def _plan(self, live: list[Tensor]) -> list[tuple]:
        """The kernel calls for the parameters ``live`` (those with a gradient): per device and dtype ``(params,
        exp_avgs, exp_avg_sqs, steps, counts)``, the step counts made views of one tensor ``counts`` — one ``add_``
        a step for all, where ``torch._foreach_add_`` on CPU adds to each scalar in turn (52 calls, ~0.3 ms a step
        at nanogpt-cpu's)."""
        lists: dict = {}
        for p in live:
            st = self._state(p)
            for lst, t in zip(lists.setdefault((p.device, p.dtype), ([], [], [], [])),
                              (p, st["exp_avg"], st["exp_avg_sq"], st["step"])):
                lst.append(t)
        calls = []
        for params, exp_avgs, exp_avg_sqs, steps in lists.values():
            counts = torch.stack(steps)  # (each parameter's own count: a view of its own element)
            steps = list(counts.unbind(0))
            for p, step in zip(params, steps):
                self.state[p]["step"] = step
            calls.append((params, exp_avgs, exp_avg_sqs, steps, counts))
        return calls

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for i, group in enumerate(self.param_groups):
            live = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in live):
                raise RuntimeError("FusedAdamW does not take sparse gradients")
            plan = self._plans.get(i)
            if plan is None or plan[2] is not self.state or len(plan[0]) != len(live) or any(
                    a is not b for a, b in zip(plan[0], live)):  # the first step, other gradients, a new state
                plan = self._plans[i] = (live, self._plan(live), self.state)
            beta1, beta2 = group["betas"]
            for params, exp_avgs, exp_avg_sqs, steps, counts in plan[1]:
                counts.add_(1)
                torch._fused_adamw_(params, [p.grad for p in params], exp_avgs, exp_avg_sqs, [], steps,
                                    lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                                    eps=group["eps"], amsgrad=False, maximize=False, grad_scale=None, found_inf=None)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in (p for g in self.param_groups for p in g["params"]):
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    def state_dict(self) -> dict:
        """``torch.optim.AdamW``'s layout: parameters numbered in group order, state keyed by those numbers."""
        index, groups = {}, []
        for g in self.param_groups:
            ids = [index.setdefault(p, len(index)) for p in g["params"]]
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
        return {"state": {index[p]: {**st, "step": st["step"].clone()} for p, st in self.state.items()},
                "param_groups": groups}

    def load_state_dict(self, state: dict) -> None:
        """Load an AdamW state (ours or ``torch.optim.AdamW``'s) for the same parameter groups; the moments are
        copied to each parameter's device and dtype, ``step`` to float32 there."""
        saved = state.get("param_groups") if isinstance(state, dict) else None
        if (not isinstance(saved, list) or len(saved) != len(self.param_groups)
                or any(len(s["params"]) != len(g["params"]) for s, g in zip(saved, self.param_groups))):
            raise ValueError("this optimiser state does not match the parameter groups (a state saved for another "
                             "model or optimizer)")
        by_index = {i: p for s, g in zip(saved, self.param_groups) for i, p in zip(s["params"], g["params"])}
        new_state = {}
        for i, st in state.get("state", {}).items():
            if int(i) not in by_index or not {"step", "exp_avg", "exp_avg_sq"} <= set(st):
                raise ValueError(f"this optimiser state is not AdamW's for these parameters (entry {i}: "
                                 f"{sorted(st)[:4]}): resume with the optimizer the run was started with")
            p = by_index[int(i)]
            new_state[p] = {"step": st["step"].to(device=p.device, dtype=torch.float32, copy=True).reshape(()),
                            "exp_avg": st["exp_avg"].to(device=p.device, dtype=p.dtype, copy=True),
                            "exp_avg_sq": st["exp_avg_sq"].to(device=p.device, dtype=p.dtype, copy=True)}
        for s, g in zip(saved, self.param_groups):
            g.update({k: (tuple(v) if k == "betas" else v) for k, v in s.items() if k != "params"})
        self.state, self._plans = new_state, {}


class MuonWithAdamW:
    """:class:`Muon` on the hidden matrices and AdamW (:class:`FusedAdamW`, or torch's) on every other parameter (if
    any), as one optimiser.

    ``param_groups`` lists both optimisers' groups (the same dicts: setting ``group["lr"]`` reaches them);
    ``state_dict`` holds both; ``step`` / ``zero_grad`` run both. ``GradScaler`` accepts it.
    """

    def __init__(self, muon: Muon, adamw) -> None:
        self.parts = {"muon": muon, "adamw": adamw} if adamw is not None else {"muon": muon}

    @property
    def param_groups(self) -> list[dict]:
        return [g for part in self.parts.values() for g in part.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for part in self.parts.values() for p, s in part.state.items()}

    def step(self, closure=None):
        loss = self.parts["muon"].step(closure)
        if "adamw" in self.parts:
            self.parts["adamw"].step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts.values():
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != set(self.parts):
            raise ValueError("this optimiser state was not written by optimizer='muon' for this model (parts "
                             f"{sorted(state)[:4]}, expected {sorted(self.parts)}): resume with the optimizer the run "
                             "was started with")
        for name, part in self.parts.items():
            part.load_state_dict(state[name])


def muon_parameters(model: nn.Module) -> list[Tensor]:
    """The matrices :class:`Muon` updates: trainable weights of the ``nn.Linear`` layers, except one shared with an
    ``nn.Embedding`` (a tied head) and the output head ``model.lm_head`` (Keller Jordan's rule: the embedding and the
    head take AdamW)."""
    skip = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear):
        skip.add(id(head.weight))
    seen, out = set(), []
    for m in model.modules():
        w = getattr(m, "weight", None) if isinstance(m, nn.Linear) else None
        if w is not None and w.requires_grad and w.dim() == 2 and id(w) not in skip | seen:
            seen.add(id(w))
            out.append(w)
    return out


def build_optimizer(model: nn.Module, *, name: str = "adamw", lr: float, betas: tuple[float, float] = (0.9, 0.999),
                    eps: float = 1e-8, weight_decay: float = 0.0, fused: Optional[bool] = None,
                    ns_dtype: torch.dtype = torch.float32, muon_lr_scale: float = 1.0, muon_ns_steps: int = 5):
    """An optimiser over :func:`param_groups` of ``model``.

    Args:
        model: the module whose trainable parameters are optimised.
        name: ``"adamw"`` (:class:`FusedAdamW`, or ``torch.optim.AdamW``'s foreach kernels where the fused one
            cannot run), ``"adafactor"`` (``torch.optim.Adafactor``, with
            its own defaults for β₂-decay and ε; ``betas``/``eps`` apply to AdamW only) or ``"muon"``
            (:class:`MuonWithAdamW`: :class:`Muon` on :func:`muon_parameters`, AdamW on the rest, same
            ``lr`` and ``weight_decay``).
        lr: the (initial) learning rate; a schedule overwrites each group's ``lr`` every step.
        betas, eps: AdamW's moment coefficients and denominator ε.
        weight_decay: decoupled decay λ of the ``dim >= 2`` group.
        fused: AdamW's single-kernel implementation (:class:`FusedAdamW`); ``None`` = fused when every parameter
            is a float tensor on CPU or CUDA (the fastest choice there), else torch's foreach one.
        ns_dtype: Muon's Newton–Schulz dtype (the trainer passes bf16 when it trains in bf16).
        muon_lr_scale, muon_ns_steps: Muon's ``lr_scale`` and ``ns_steps`` (ignored by the other optimisers).

    Raises:
        ValueError: unknown ``name`` or an out-of-range hyper-parameter (the message names it).
    """
    one_of("optimizer", name, OPTIMIZERS)
    for arg, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        non_negative_number(arg, value)
    if (not isinstance(betas, (tuple, list)) or len(betas) != 2
            or not all(is_real(b) and 0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    groups = param_groups(model, weight_decay=weight_decay)
    if name == "adafactor":
        return torch.optim.Adafactor(groups, lr=lr, weight_decay=weight_decay)
    matrices = muon_parameters(model) if name == "muon" else []
    if matrices:
        ids = {id(p) for p in matrices}
        groups = [{**g, "params": [p for p in g["params"] if id(p) not in ids]} for g in groups]
        groups = [g for g in groups if g["params"]]
    if name == "muon" and not matrices:
        raise ValueError("optimizer='muon' found no nn.Linear weight to update (besides the head): use adamw")
    if fused is None:
        params = [p for g in groups for p in g["params"]]
        fused = all(FusedAdamW.takes(p) for p in params)
    if not groups:
        adamw = None
    elif fused:
        adamw = FusedAdamW(groups, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
    else:
        adamw = torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, foreach=True)
    if name != "muon":
        return adamw
    return MuonWithAdamW(Muon(matrices, lr=lr, weight_decay=weight_decay, ns_dtype=ns_dtype, lr_scale=muon_lr_scale,
                              ns_steps=muon_ns_steps), adamw)
