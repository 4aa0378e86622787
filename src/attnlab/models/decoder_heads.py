"""Task heads on the decoder-only families, GPT-2 and Llama, as transformers defines them.

::

    ...ForSequenceClassification   logits = (W_s N_f(h))[b, last non-pad token of b]    (B, num_labels), no bias
    ...ForTokenClassification      logits = W_c dropout(N_f(h)) + b_c                   (B, T, num_labels)
    ...ForQuestionAnswering        [start | end] = W_qa N_f(h) + b_qa                   (B, T) each

``h`` is the last layer's output and ``N_f`` the family's final norm (GPT-2 ``ln_f``, Llama ``norm``).
The last non-pad token of a sequence is its last position whose id is not ``pad_token_id`` (position 0
when all are): transformers' rule, which reads right- and left-padded batches alike. Without a
``pad_token_id`` only a batch of one can be classified (its last position). Dropout before the token
classifier is ``classifier_dropout``, default 0.1 (transformers' fallback). Losses:
:mod:`attnlab.models.classifier`. GPT-2's positions follow the attention mask (``cumsum(mask) - 1``, as
:mod:`attnlab.models.causal_lm`), so its outputs at padded positions (which a QA loss's softmax reads) are
transformers' when it is given those ``position_ids``; Llama's RoPE makes the convention irrelevant.

HF tensor names: the body under ``transformer.`` (GPT-2) or ``model.`` (Llama; ``transformer.`` for
``LlamaForQuestionAnswering``, as transformers keeps it), the head as ``score`` (sequence; Llama's token
head too), ``classifier`` (GPT-2 token) or ``qa_outputs``. The LM head is not part of a task head: GPT-2's
stays tied to ``wte`` (no parameters of its own, not saved), Llama's is removed. Any checkpoint of the
family (the bare model, the LM, another head) loads with a freshly initialised task head and one warning
line (:func:`~attnlab.models.classifier.adopt_checkpoint`).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor, nn

from attnlab.models.classifier import (ClassifierConfig, QuestionAnsweringOutput, SequenceClassifierOutput,
                                       _cross_entropy, adopt_checkpoint, classification_loss, extend_family,
                                       question_answering_loss)
from attnlab.models.gpt import WEIGHT_MAP as GPT2_WEIGHT_MAP, GPT2Config, GPT2LMHeadModel
from attnlab.models.hub import WeightMap, rename
from attnlab.models.llama import LlamaConfig, LlamaForCausalLM, weight_map as llama_weight_map
from attnlab.nn.dropout import Dropout


def check_head_config(cls: type, config, base: type) -> None:
    """Refuse anything but a :class:`ClassifierConfig` over a ``base`` config, naming ``cls``."""
    if not isinstance(config, ClassifierConfig) or not isinstance(config.base, base):
        raise TypeError(f"{cls.__name__} needs a ClassifierConfig of a {base.__name__}, got "
                        f"{type(config).__name__}" + (f" of a {type(config.base).__name__}"
                                                      if isinstance(config, ClassifierConfig) else ""))


class _DecoderHead:
    """One linear head ``head_name`` on the final norm's output (the family class provides ``final_norm``)."""

    task = ""  # "sequence" | "token" | "qa"
    head_name = "score"
    head_bias = False

    @classmethod
    def _outputs(cls, config: ClassifierConfig) -> int:
        return config.num_labels

    @classmethod
    def _head_shapes(cls, config: ClassifierConfig, hidden: int) -> dict[str, tuple[int, ...]]:
        """``{HF name: shape}`` of the head's tensors."""
        n = cls._outputs(config)
        return {f"{cls.head_name}.weight": (n, hidden), **({f"{cls.head_name}.bias": (n,)} if cls.head_bias else {})}

    def _add_head(self, hidden: int, std: float) -> None:
        """The head (N(0, std) weight, zero bias) and, for token classification, its dropout."""
        layer = nn.Linear(hidden, self._outputs(self.config), bias=self.head_bias)
        nn.init.normal_(layer.weight, std=std)
        if layer.bias is not None:
            nn.init.zeros_(layer.bias)
        setattr(self, self.head_name, layer)
        p = self.config.classifier_dropout
        self.head_dropout = Dropout(0.1 if p is None else p) if self.task == "token" else nn.Identity()

    def _head_rules(self) -> list:
        return [rename(f"{self.head_name}.{{p}}", f"{self.head_name}.{{p}}")]

    def head(self, x: Tensor) -> Tensor:
        """The head at every position, ``(B, T, outputs)``; the task's :meth:`forward` reads it."""
        return getattr(self, self.head_name)(self.head_dropout(self.final_norm(x)))


class _SequenceTask(_DecoderHead):
    task, head_name, head_bias = "sequence", "score", False
    label_tensors = ("score.weight",)  # one row per label (classifier_from_pretrained keeps them if they fit)

    def forward(self, input_ids: Tensor, *, attention_mask: Optional[Tensor] = None,
                labels: Optional[Tensor] = None, output_attentions: bool = False) -> SequenceClassifierOutput:
        """Classify each sequence of ``input_ids (B, T)`` at its last non-pad token (``attention_mask`` as the
        LM's); ``labels`` ``(B,)`` add ``loss`` (:func:`~attnlab.models.classifier.classification_loss`).

        Raises:
            ValueError: B > 1 without ``config.pad_token_id``; inputs or labels as the LM / the loss refuse.
        """
        B = input_ids.shape[0] if isinstance(input_ids, Tensor) and input_ids.dim() == 2 else 1
        pad = self.config.pad_token_id
        if pad is None and B > 1:
            raise ValueError(f"{type(self).__name__} needs config.pad_token_id to classify a batch of "
                             f"{B} sequences (it reads each one's last non-padding token)")
        out = super().forward(input_ids, attention_mask=attention_mask, output_attentions=output_attentions)
        T = input_ids.shape[1]
        if pad is None:
            last = torch.full((B,), T - 1, device=input_ids.device)
        else:  # the last position that is not padding (0 when all are), as transformers
            pos = torch.arange(T, device=input_ids.device)
            last = (pos * (input_ids != pad)).argmax(-1)
        logits = out.logits[torch.arange(B, device=input_ids.device), last]  # (B, num_labels)
        loss = None if labels is None else classification_loss(logits, labels, self.config)
        return SequenceClassifierOutput(logits, loss, None, out.attentions)


class _TokenTask(_DecoderHead):
    task, head_bias = "token", True

    def forward(self, input_ids: Tensor, *, attention_mask: Optional[Tensor] = None,
                labels: Optional[Tensor] = None, output_attentions: bool = False) -> SequenceClassifierOutput:
        """Classify each token, ``logits (B, T, num_labels)``; ``labels (B, T)`` class indices (-100: ignored)
        add the mean cross-entropy."""
        out = super().forward(input_ids, attention_mask=attention_mask, output_attentions=output_attentions)
        loss = None if labels is None else _cross_entropy(out.logits, labels, tuple(input_ids.shape), "labels")
        return SequenceClassifierOutput(out.logits, loss, None, out.attentions)


class _QuestionAnsweringTask(_DecoderHead):
    task, head_name, head_bias = "qa", "qa_outputs", True

    @classmethod
    def _outputs(cls, config: ClassifierConfig) -> int:
        return 2  # start, end: transformers' decoder-only QA heads have 2 outputs whatever num_labels says

    def forward(self, input_ids: Tensor, *, attention_mask: Optional[Tensor] = None,
                start_positions: Optional[Tensor] = None, end_positions: Optional[Tensor] = None,
                output_attentions: bool = False) -> QuestionAnsweringOutput:
        """Span logits ``(B, T)`` each; both positions ``(B,)`` add
        :func:`~attnlab.models.classifier.question_answering_loss`."""
        out = super().forward(input_ids, attention_mask=attention_mask, output_attentions=output_attentions)
        start, end = out.logits.unbind(-1)
        loss = question_answering_loss(start, end, start_positions, end_positions)
        return QuestionAnsweringOutput(start, end, loss, None, out.attentions)


# ---- GPT-2 ------------------------------------------------------------------------------------


class _GPT2Head(GPT2LMHeadModel):
    """GPT-2 (``transformer.*`` in HF) with a task head; the LM head stays tied to ``wte``."""

    def __init__(self, config: ClassifierConfig) -> None:
        check_head_config(type(self), config, GPT2Config)
        super().__init__(config.base)
        self.config = config
        self._add_head(config.base.n_embd, std=0.02)

    def final_norm(self, x: Tensor) -> Tensor:
        return self.ln_f(x)

    @classmethod
    def config_from_hf(cls, d: dict) -> ClassifierConfig:
        """:meth:`ClassifierConfig.from_hf` over :meth:`GPT2Config.from_hf`."""
        return ClassifierConfig.from_hf(d, GPT2Config.from_hf)

    def hf_weight_map(self) -> WeightMap:
        """GPT-2's names (:data:`attnlab.models.gpt.WEIGHT_MAP`) + the head's, the same in HF."""
        m = GPT2_WEIGHT_MAP
        return WeightMap("GPT-2", [*m.rules, *self._head_rules()], tied=m.tied, ignore=m.ignore)

    @classmethod
    def adapt_hf_checkpoint(cls, config: ClassifierConfig, hf: dict[str, Tensor]):
        """Any GPT-2 checkpoint (see :func:`~attnlab.models.classifier.adopt_checkpoint`)."""
        return config, adopt_checkpoint(cls.__name__, hf, prefix="transformer.", body_prefixes=("transformer.",),
                                        head=cls._head_shapes(config, config.base.n_embd), std=0.02,
                                        marker="wte.weight")


class GPT2ForSequenceClassification(_SequenceTask, _GPT2Head):
    """HF ``GPT2ForSequenceClassification``: ``W_s LN_f(h)`` (no bias) at each sequence's last non-pad token."""

    hf_architecture = "GPT2ForSequenceClassification"


class GPT2ForTokenClassification(_TokenTask, _GPT2Head):
    """HF ``GPT2ForTokenClassification``: ``classifier(dropout(LN_f(h)))``, ``(B, T, num_labels)``."""

    hf_architecture = "GPT2ForTokenClassification"
    head_name = "classifier"


class GPT2ForQuestionAnswering(_QuestionAnsweringTask, _GPT2Head):
    """HF ``GPT2ForQuestionAnswering``: ``[start | end] = qa_outputs(LN_f(h))``."""

    hf_architecture = "GPT2ForQuestionAnswering"


# ---- Llama ------------------------------------------------------------------------------------


class _LlamaHead(LlamaForCausalLM):
    """Llama (``model.*`` in HF, or ``body_prefix``) with a task head instead of the LM head."""

    body_prefix = "model."

    def __init__(self, config: ClassifierConfig) -> None:
        check_head_config(type(self), config, LlamaConfig)
        super().__init__(config.base)
        self.config = config
        self.lm_head = None  # a task head has no LM head (nor does transformers' checkpoint of one)
        self._add_head(config.base.hidden_size, std=0.02)

    def final_norm(self, x: Tensor) -> Tensor:
        return self.norm(x)

    @classmethod
    def config_from_hf(cls, d: dict) -> ClassifierConfig:
        """:meth:`ClassifierConfig.from_hf` over :meth:`LlamaConfig.from_hf`."""
        return ClassifierConfig.from_hf(d, LlamaConfig.from_hf)

    def hf_weight_map(self) -> WeightMap:
        """Llama's body names (:func:`attnlab.models.llama.weight_map`, under ``body_prefix``) + the head's."""
        base = llama_weight_map(self.config.base)
        rules = [dataclasses.replace(r, hf=tuple(self.body_prefix + h.removeprefix("model.") for h in r.hf))
                 for r in base.rules if not r.ours.startswith("lm_head.")]
        return WeightMap("Llama", [*rules, *self._head_rules()], ignore=base.ignore)

    @classmethod
    def adapt_hf_checkpoint(cls, config: ClassifierConfig, hf: dict[str, Tensor]):
        """Any Llama checkpoint (see :func:`~attnlab.models.classifier.adopt_checkpoint`)."""
        return config, adopt_checkpoint(cls.__name__, hf, prefix=cls.body_prefix,
                                        body_prefixes=("model.", "transformer."),
                                        head=cls._head_shapes(config, config.base.hidden_size), std=0.02,
                                        marker="embed_tokens.weight")


class LlamaForSequenceClassification(_SequenceTask, _LlamaHead):
    """HF ``LlamaForSequenceClassification``: ``W_s norm(h)`` (no bias) at each sequence's last non-pad token."""

    hf_architecture = "LlamaForSequenceClassification"


class LlamaForTokenClassification(_TokenTask, _LlamaHead):
    """HF ``LlamaForTokenClassification``: ``score(dropout(norm(h)))`` with a bias, ``(B, T, num_labels)``."""

    hf_architecture = "LlamaForTokenClassification"


class LlamaForQuestionAnswering(_QuestionAnsweringTask, _LlamaHead):
    """HF ``LlamaForQuestionAnswering``: ``[start | end] = qa_outputs(norm(h))``; the body is HF's ``transformer.``."""

    hf_architecture = "LlamaForQuestionAnswering"
    body_prefix = "transformer."


extend_family("gpt2", GPT2ForSequenceClassification, GPT2ForTokenClassification, GPT2ForQuestionAnswering)
extend_family("llama", LlamaForSequenceClassification, LlamaForTokenClassification, LlamaForQuestionAnswering)
