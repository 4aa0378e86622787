"""What every classification head shares, whatever the family: :class:`ClassifierConfig` (the family's config
plus the labels and ``problem_type``), the output records, and the losses as transformers computes them::

    num_labels == 1          regression     MSE(logits, labels)
    integer labels           single-label   -log softmax(logits)[label]   (label -100 ignored)
    float (B, num_labels)    multi-label    BCEWithLogits(logits, labels)
    QA                       (CE(start_logits, start) + CE(end_logits, end)) / 2

:func:`adopt_checkpoint` reads any checkpoint of a family into one of its heads (a fresh head, one warning
line, when it has none). The heads themselves are in :mod:`attnlab.models.heads` (BERT),
:mod:`attnlab.models.decoder_heads` (GPT-2, Llama) and :mod:`attnlab.models.seq2seq_heads` (BART).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab._checks import check_int, one_of, rate
from attnlab.models.bert import BertConfig
from attnlab.models.hub import MODEL_TYPES, register


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
        pad_token_id: the padding id a decoder-only head needs to find each sequence's last token in a
            batch; default the family config's own ``pad_token_id`` (GPT-2 has none).

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
        if self.pad_token_id is None:
            self.pad_token_id = getattr(self.base, "pad_token_id", None)
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
        if isinstance(self.base, BertConfig) or self.classifier_dropout is not None:
            d["classifier_dropout"] = self.classifier_dropout
        if not isinstance(self.base, BertConfig) and (self.pad_token_id is not None or "pad_token_id" not in d):
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




def question_answering_loss(start: Tensor, end: Tensor, start_positions, end_positions) -> Optional[Tensor]:
    """``(CE(start, s) + CE(end, e)) / 2`` over ``(B, L)`` logits, positions clamped to ``[0, L]`` and ``L``
    ignored (as transformers); None when neither position is given.

    Raises:
        ValueError: only one of the two is given, or one is not an integer tensor of shape ``(B,)``.
    """
    if start_positions is None and end_positions is None:
        return None
    if start_positions is None or end_positions is None:
        raise ValueError("give both start_positions and end_positions (or neither)")
    B, L = start.shape
    parts = []
    for name, logits, pos in (("start_positions", start, start_positions), ("end_positions", end, end_positions)):
        if not isinstance(pos, Tensor) or pos.is_floating_point() or pos.reshape(-1).shape != (B,):
            raise ValueError(f"{name} must be an integer tensor of shape (B,) = ({B},), got "
                             f"{getattr(pos, 'dtype', type(pos).__name__)} {tuple(getattr(pos, 'shape', ()))}")
        parts.append(F.cross_entropy(logits, pos.reshape(-1).long().clamp(0, L), ignore_index=L))
    return (parts[0] + parts[1]) / 2


# top-level names of the task and LM heads transformers puts beside a family's body
OTHER_HEADS = ("lm_head", "score", "classifier", "qa_outputs", "classification_head", "final_logits_bias", "cls")


def adopt_checkpoint(owner: str, hf: dict[str, Tensor], *, prefix: str, body_prefixes: tuple[str, ...],
                     head: dict[str, tuple[int, ...]], std: float, marker: str) -> dict[str, Tensor]:
    """Any checkpoint of a family as the head ``owner``'s: the body's tensors (under one of ``body_prefixes``,
    or none: a bare model) are put under ``prefix``, other heads' (:data:`OTHER_HEADS`) dropped, and when the
    body is there (``prefix + marker``) but some of ``head`` (``{name: shape}``) is not, those tensors are
    freshly initialised (weights ~ N(0, std), biases 0) with one warning line naming them, as transformers."""
    out, own = {}, {}
    for k, v in hf.items():
        if k in head:
            own[k] = v
            continue
        p = next((p for p in body_prefixes if k.startswith(p)), None)
        if p is not None:
            out[prefix + k[len(p):]] = v
        elif k.split(".")[0] not in OTHER_HEADS:
            out[prefix + k] = v
    missing = [k for k in head if k not in own]
    if missing and prefix + marker in out:
        dtype = out[prefix + marker].dtype
        n = max(shape[0] for shape in head.values())
        warnings.warn(f"the checkpoint has no {', '.join(missing)}: {owner}'s head is freshly initialised "
                      f"({n} outputs), train it before use", stacklevel=4)
        for k in missing:
            t = torch.zeros(head[k]) if k.endswith("bias") else torch.randn(head[k]).mul_(std)
            own[k] = t.to(dtype)
    return {**out, **own}


def extend_family(model_type: str, *classes: type) -> None:
    """Add ``classes`` (by their ``hf_architecture``) to the registered family ``model_type``."""
    family = MODEL_TYPES[model_type]
    register(model_type, config_from_hf=family.config_from_hf, default=family.default,
             architectures={**family.architectures, **{c.hf_architecture: c for c in classes}})
