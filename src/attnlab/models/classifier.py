"""What every classification head shares, whatever the family: :class:`ClassifierConfig` (the family's config
plus the labels and ``problem_type``), the output records, and the losses as transformers computes them::

    num_labels == 1          regression     MSE(logits, labels)
    integer labels           single-label   -log softmax(logits)[label]   (label -100 ignored)
    float (B, num_labels)    multi-label    BCEWithLogits(logits, labels)
    QA                       (CE(start_logits, start) + CE(end_logits, end)) / 2

The heads themselves are in :mod:`attnlab.models.heads`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab._checks import check_int, one_of, rate
from attnlab.models.bert import BertConfig


PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")


@dataclass
class ClassifierConfig:
    """A family's config (``base``: :class:`BertConfig` or :class:`GPT2Config`) plus a task head's fields.

    Args:
        base: the encoder's / decoder's config; its fields are readable on this object too.
        num_labels: the head's outputs (default 2, or ``len(id2label)``).
        id2label: ``{index: name}``; default ``{i: "LABEL_i"}``, as transformers.
        label2id: ``{name: index}``; default the inverse of ``id2label``.
        problem_type: one of :data:`PROBLEM_TYPES` or None (inferred from ``num_labels`` and the labels).
        classifier_dropout: dropout before the classifier (BERT; None: ``hidden_dropout_prob``).
        pad_token_id: GPT-2's padding id, needed to find each sequence's last token in a batch.

    Raises:
        ValueError: ``num_labels`` < 1 or different from ``len(id2label)``, keys of ``id2label`` not
            ``0 … n-1``, an unknown ``problem_type``, a dropout outside ``[0, 1)``.
    """

    base: Any
    num_labels: Optional[int] = None
    id2label: Optional[dict] = None
    label2id: Optional[dict] = None
    problem_type: Optional[str] = None
    classifier_dropout: Optional[float] = None
    pad_token_id: Optional[int] = None

    def __post_init__(self) -> None:
        if self.id2label is None:
            n = 2 if self.num_labels is None else self.num_labels
            check_int("num_labels", n)
            self.id2label = {i: f"LABEL_{i}" for i in range(n)}
        if not isinstance(self.id2label, dict) or not self.id2label:
            raise ValueError(f"id2label must be a non-empty dict {{index: name}}, got {self.id2label!r}")
        try:
            self.id2label = {int(k): str(v) for k, v in self.id2label.items()}
        except (TypeError, ValueError):
            raise ValueError(f"id2label's keys must be label indices 0, 1, …, got {list(self.id2label)}") from None
        if sorted(self.id2label) != list(range(len(self.id2label))):
            raise ValueError(f"id2label's keys must be 0 … {len(self.id2label) - 1}, got {sorted(self.id2label)}")
        if self.num_labels is not None and self.num_labels != len(self.id2label):
            raise ValueError(f"num_labels={self.num_labels} but id2label has {len(self.id2label)} labels")
        self.num_labels = len(self.id2label)
        if self.label2id is None:
            self.label2id = {v: k for k, v in self.id2label.items()}
        self.label2id = {str(k): int(v) for k, v in self.label2id.items()}
        if self.problem_type is not None:
            one_of("problem_type", self.problem_type, PROBLEM_TYPES)
        if self.classifier_dropout is not None:
            rate("classifier_dropout", self.classifier_dropout)
        if self.pad_token_id is not None:
            check_int("pad_token_id", self.pad_token_id, 0)

    def __getattr__(self, name: str):
        """The family's fields (``hidden_size``, ``vocab_size``, …) read through to ``base``."""
        if name == "base":  # not set yet (during copy / unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.base, name)

    @classmethod
    def from_hf(cls, d: dict, base_from_hf: Callable[[dict], Any]) -> "ClassifierConfig":
        """From an HF ``config.json`` dict; ``base_from_hf`` reads the family's part."""
        kw = {k: d.get(k) for k in ("id2label", "label2id", "problem_type", "classifier_dropout", "pad_token_id")}
        if kw["id2label"] is None:
            kw["num_labels"] = d.get("num_labels", 2)
            kw["label2id"] = None
        if isinstance(kw["pad_token_id"], list):  # some configs list several; transformers' heads take none
            kw["pad_token_id"] = None
        return cls(base=base_from_hf(d), **kw)

    def to_hf(self) -> dict:
        """The family's ``config.json`` dict plus the head's fields (``id2label`` keys as strings, as HF)."""
        d = {**self.base.to_hf(), "id2label": {str(k): v for k, v in self.id2label.items()},
             "label2id": dict(self.label2id), "problem_type": self.problem_type}
        if isinstance(self.base, BertConfig):
            d["classifier_dropout"] = self.classifier_dropout
        else:
            d["pad_token_id"] = self.pad_token_id
        return d


@dataclass
class SequenceClassifierOutput:
    """``logits (B, num_labels)`` (token classification: ``(B, L, num_labels)``); ``loss`` when labels are given."""

    logits: Tensor
    loss: Optional[Tensor] = None
    hidden_states: Optional[tuple[Tensor, ...]] = None
    attentions: Optional[tuple[Tensor, ...]] = None


@dataclass
class QuestionAnsweringOutput:
    """``start_logits``, ``end_logits`` ``(B, L)``; ``loss`` when both positions are given."""

    start_logits: Tensor
    end_logits: Tensor
    loss: Optional[Tensor] = None
    hidden_states: Optional[tuple[Tensor, ...]] = None
    attentions: Optional[tuple[Tensor, ...]] = None


def classification_loss(logits: Tensor, labels, config: ClassifierConfig) -> Tensor:
    """transformers' sequence-classification loss (see the module docstring for the three kinds).

    Raises:
        ValueError: ``labels`` is not a tensor of the shape and kind the problem type needs, or a class
            index is outside ``[0, num_labels)`` (``-100``, ignored, is allowed).
    """
    B, n = logits.shape
    if not isinstance(labels, Tensor):
        raise ValueError(f"labels must be a tensor, got {type(labels).__name__}")
    kind = config.problem_type
    if kind is None:
        kind = PROBLEM_TYPES[0] if n == 1 else PROBLEM_TYPES[1] if not labels.is_floating_point() else PROBLEM_TYPES[2]
    if kind == "regression":
        want = ((B,), (B, 1)) if n == 1 else ((B, n),)
        if tuple(labels.shape) not in want:
            raise ValueError(f"labels for regression with num_labels={n} must have shape "
                             f"{' or '.join(map(str, want))}, got {tuple(labels.shape)}")
        if n == 1:
            return F.mse_loss(logits.squeeze(), labels.squeeze().to(logits.dtype))
        return F.mse_loss(logits, labels.to(logits.dtype))
    if kind == "single_label_classification":
        return _cross_entropy(logits, labels, (B,), "labels")
    if tuple(labels.shape) != (B, n):
        raise ValueError(f"labels for multi-label classification must have shape (B, num_labels) = {(B, n)}, "
                         f"got {tuple(labels.shape)}")
    return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))


def _cross_entropy(logits: Tensor, labels, shape: tuple[int, ...], name: str) -> Tensor:
    """``CE(logits (…, n), labels (…))`` after checking ``labels``: integers in ``[0, n)`` or -100, ``shape``."""
    n = logits.shape[-1]
    if not isinstance(labels, Tensor) or labels.is_floating_point() or labels.is_complex() \
            or labels.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor of shape {shape} (class indices), got "
                         f"{getattr(labels, 'dtype', type(labels).__name__)}")
    if tuple(labels.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {shape} (class indices), got {tuple(labels.shape)}")
    bad = (labels != -100) & ((labels < 0) | (labels >= n))
    if bool(bad.any()):
        raise ValueError(f"{name} must lie in [0, num_labels={n}) (or be -100, ignored), got {int(labels[bad][0])}")
    return F.cross_entropy(logits.reshape(-1, n), labels.reshape(-1).long())


