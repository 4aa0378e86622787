"""Training losses: token cross-entropy (label smoothing, ignore_index) and knowledge distillation.

Token cross-entropy over the ``N`` kept positions (target ≠ ``ignore_index``), smoothing ``ε``
over ``V`` classes (Szegedy et al. 2016, as ``torch.nn.functional.cross_entropy``)::

    CE = (1/N) Σ_n [ (1 − ε) (−log p_n[y_n]) + ε · (1/V) Σ_c (−log p_n[c]) ]

Distillation (Hinton et al. 2015), temperature ``T``, weight ``α``::

    L = α · T² · KL(softmax(z_t / T) ‖ softmax(z_s / T)) + (1 − α) · CE(z_s, y)

with the KL summed over classes and averaged over the kept positions; ``T²`` keeps the soft
term's gradient scale independent of ``T``.
"""
from __future__ import annotations


import torch.nn.functional as F
from torch import Tensor, nn

from attnlab._checks import fraction, positive_number, rate

__all__ = ["token_cross_entropy", "distillation_loss", "causal_lm_loss"]


def _check_logits(name: str, logits: Tensor, targets: Tensor) -> None:
    if not isinstance(logits, Tensor) or not logits.is_floating_point() or logits.dim() < 2:
        raise ValueError(f"{name} must be a float tensor (..., V), got {getattr(logits, 'shape', type(logits))}")
    if not isinstance(targets, Tensor) or targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets must have shape {tuple(logits.shape[:-1])} (logits without the class dim), "
                         f"got {tuple(getattr(targets, 'shape', ()))}")


def token_cross_entropy(logits: Tensor, targets: Tensor, *, label_smoothing: float = 0.0,
                        ignore_index: int = -100) -> Tensor:
    """Mean cross-entropy of ``logits (..., V)`` against ``targets (...)`` over the kept positions.

    Computed in float32 (bf16/fp16 logits are upcast). Every position ignored gives 0, not NaN.

    Raises:
        ValueError: mismatched shapes or ``label_smoothing`` outside ``[0, 1)``.
    """
    _check_logits("logits", logits, targets)
    rate("label_smoothing", label_smoothing)
    flat = logits.reshape(-1, logits.shape[-1]).float()  # (N, V)
    y = targets.reshape(-1)  # (N,)
    if not bool((y != ignore_index).any()):
        return flat.sum() * 0.0  # keeps the graph; no NaN from 0/0
    return F.cross_entropy(flat, y, ignore_index=ignore_index, label_smoothing=float(label_smoothing))


def distillation_loss(student_logits: Tensor, teacher_logits: Tensor, targets: Tensor, *, temperature: float,
                      alpha: float, ignore_index: int = -100) -> Tensor:
    """``α · T² · KL(softmax(t/T) ‖ softmax(s/T)) + (1 − α) · CE(s, y)`` averaged over kept positions.

    Args:
        student_logits, teacher_logits: ``(..., V)``; the teacher gets no gradient.
        targets: ``(...)`` class ids; positions equal to ``ignore_index`` count in neither term.
        temperature: ``T > 0``.
        alpha: ``α ∈ [0, 1]``, the weight of the soft (teacher) term.

    Raises:
        ValueError: mismatched shapes, ``temperature <= 0`` or ``alpha`` outside ``[0, 1]``.
    """
    _check_logits("student_logits", student_logits, targets)
    if not isinstance(teacher_logits, Tensor) or teacher_logits.shape != student_logits.shape:
        raise ValueError(f"teacher_logits must have the student's shape {tuple(student_logits.shape)}, "
                         f"got {tuple(getattr(teacher_logits, 'shape', ()))}")
    positive_number("temperature", temperature)
    fraction("alpha", alpha)
    V = student_logits.shape[-1]
    keep = targets.reshape(-1) != ignore_index  # (N,)
    s = student_logits.reshape(-1, V).float()[keep]  # (n, V)
    t = teacher_logits.reshape(-1, V).float()[keep].detach()  # (n, V)
    if s.shape[0] == 0:
        return student_logits.sum() * 0.0
    log_ps = F.log_softmax(s / temperature, dim=-1)
    log_pt = F.log_softmax(t / temperature, dim=-1)
    kl = F.kl_div(log_ps, log_pt, reduction="batchmean", log_target=True)  # Σ_c p_t (log p_t − log p_s) / n
    ce = F.cross_entropy(s, targets.reshape(-1)[keep])
    return alpha * temperature ** 2 * kl + (1.0 - alpha) * ce


def causal_lm_loss(model: nn.Module, batch: tuple[Tensor, Tensor], *, label_smoothing: float = 0.0,
                   ignore_index: int = -100) -> tuple[Tensor, int]:
    """The trainer's ``loss_fn`` for a language model: ``batch = (x (B, T), y (B, T))``, ``y`` = next tokens.

    Returns:
        ``(mean token cross-entropy, number of target tokens counted)``.
    """
    x, y = batch
    logits = model(x).logits  # (B, T, V)
    n = int((y != ignore_index).sum())
    return token_cross_entropy(logits, y, label_smoothing=label_smoothing, ignore_index=ignore_index), n
