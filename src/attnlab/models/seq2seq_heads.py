"""Task heads on the encoder–decoders, BART and T5, as transformers defines them. The sequence and span
heads run the whole model with the decoder fed ``input_ids`` shifted right (behind
``decoder_start_token_id``) and read the decoder's output ``d``; T5's token head reads the encoder's ``e``::

    ...ForSequenceClassification   r = d[b, last eos of b]     (eos pooling: the last position whose id is
                                                                eos_token_id; every row needs the same count)
                                   logits = W_o dropout(tanh(W_d dropout(r) + b_d)) + b_o     (B, num_labels)
    ...ForQuestionAnswering        [start | end] = W_qa d + b_qa                             (B, L) each
    T5ForTokenClassification       logits = W_c dropout(e) + b_c                             (B, L, num_labels)

Dropout is ``classifier_dropout`` (default 0, the families' default in transformers). Losses:
:mod:`attnlab.models.classifier`. HF tensor names: the body under ``model.`` (BART), ``transformer.`` (T5's
sequence and token heads; the token head's body is the encoder alone) or at the top (T5's QA head), the heads
as ``classification_head.dense`` / ``.out_proj``, ``qa_outputs`` and ``classifier``. A task head has no LM
head (BART's ``lm_head`` and ``final_logits_bias``, T5's ``lm_head``, are removed), so it does not generate.
Any checkpoint of the family (the bare model, the LM, another head) loads with a freshly initialised task
head and one warning line (:func:`~attnlab.models.classifier.adopt_checkpoint`).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Optional

import torch
from torch import Tensor, nn

from attnlab.models.bart import WEIGHT_MAP as BART_WEIGHT_MAP, BartConfig, BartForConditionalGeneration, \
    shift_tokens_right
from attnlab.models.classifier import (ClassifierConfig, QuestionAnsweringOutput, SequenceClassifierOutput,
                                       _cross_entropy, adopt_checkpoint, classification_loss, extend_family,
                                       question_answering_loss)
from attnlab.models.decoder_heads import check_head_config
from attnlab.models.hub import WeightMap, rename
from attnlab.models.t5 import T5Config, T5ForConditionalGeneration, weight_map as t5_weight_map
from attnlab.nn.dropout import Dropout


class ClassificationHead(nn.Module):
    """``W_o dropout(tanh(W_d dropout(r) + b_d)) + b_o``: ``(B, d_model)`` -> ``(B, num_labels)``."""

    def __init__(self, d_model: int, num_labels: int, dropout: float) -> None:
        super().__init__()
        self.dense = nn.Linear(d_model, d_model)
        self.dropout = Dropout(dropout)
        self.out_proj = nn.Linear(d_model, num_labels)

    def forward(self, r: Tensor) -> Tensor:
        return self.out_proj(self.dropout(torch.tanh(self.dense(self.dropout(r)))))


def _dropout(config: ClassifierConfig) -> float:
    return 0.0 if config.classifier_dropout is None else config.classifier_dropout


# ---- the tasks (the family class provides encode, _decoder_output, and the body's names) ------------------


class _EosClassification:
    head_name = "classification_head"
    label_tensors = ("classification_head.out_proj.weight", "classification_head.out_proj.bias")

    @classmethod
    def _head_shapes(cls, config: ClassifierConfig) -> dict[str, tuple[int, ...]]:
        E, n = config.d_model, config.num_labels
        return {"classification_head.dense.weight": (E, E), "classification_head.dense.bias": (E,),
                "classification_head.out_proj.weight": (n, E), "classification_head.out_proj.bias": (n,)}

    def _add_head(self) -> list[nn.Linear]:
        self.classification_head = ClassificationHead(self.config.d_model, self.config.num_labels,
                                                      _dropout(self.config))
        return [self.classification_head.dense, self.classification_head.out_proj]

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                decoder_input_ids: Optional[Tensor] = None, decoder_attention_mask: Optional[Tensor] = None,
                labels: Optional[Tensor] = None) -> SequenceClassifierOutput:
        """Classify each row of ``input_ids (B, S)`` (``attention_mask`` 1 = token, 0 = padding); ``labels``
        ``(B,)`` add ``loss`` (:func:`~attnlab.models.classifier.classification_loss`).

        Raises:
            ValueError: rows with different numbers of ``eos_token_id`` or none; inputs the model refuses.
        """
        d = self._decoder_output(input_ids, attention_mask, decoder_input_ids, decoder_attention_mask)
        eos = input_ids == self.config.eos_token_id  # (B, S)
        counts = eos.sum(-1)
        if bool((counts != counts[0]).any()) or int(counts[0]) == 0:
            raise ValueError(f"input_ids must hold the same number (>= 1) of eos tokens (eos_token_id="
                             f"{self.config.eos_token_id}) in every row, got {counts.tolist()}")
        B, _, E = d.shape
        r = d[eos].view(B, -1, E)[:, -1]  # (B, E): each row's last eos
        logits = self.classification_head(r)  # (B, num_labels)
        loss = None if labels is None else classification_loss(logits, labels, self.config)
        return SequenceClassifierOutput(logits, loss)


class _SpanPrediction:
    head_name = "qa_outputs"

    @classmethod
    def _head_shapes(cls, config: ClassifierConfig) -> dict[str, tuple[int, ...]]:
        if config.num_labels != 2:
            raise ValueError(f"{cls.__name__} needs num_labels=2 (start, end), got {config.num_labels}")
        return {"qa_outputs.weight": (2, config.d_model), "qa_outputs.bias": (2,)}

    def _add_head(self) -> list[nn.Linear]:
        self._head_shapes(self.config)  # refuses num_labels != 2
        self.qa_outputs = nn.Linear(self.config.d_model, 2)
        return [self.qa_outputs]

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                decoder_input_ids: Optional[Tensor] = None, decoder_attention_mask: Optional[Tensor] = None,
                start_positions: Optional[Tensor] = None, end_positions: Optional[Tensor] = None
                ) -> QuestionAnsweringOutput:
        """Span logits ``(B, L)`` each; both positions ``(B,)`` add
        :func:`~attnlab.models.classifier.question_answering_loss`."""
        d = self._decoder_output(input_ids, attention_mask, decoder_input_ids, decoder_attention_mask)
        start, end = self.qa_outputs(d).unbind(-1)
        return QuestionAnsweringOutput(start, end, question_answering_loss(start, end, start_positions, end_positions))


class _TokenClassification:
    head_name = "classifier"

    @classmethod
    def _head_shapes(cls, config: ClassifierConfig) -> dict[str, tuple[int, ...]]:
        return {"classifier.weight": (config.num_labels, config.d_model), "classifier.bias": (config.num_labels,)}

    def _add_head(self) -> list[nn.Linear]:
        self.head_dropout = Dropout(_dropout(self.config))
        self.classifier = nn.Linear(self.config.d_model, self.config.num_labels)
        return [self.classifier]

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                labels: Optional[Tensor] = None) -> SequenceClassifierOutput:
        """Classify each token of ``input_ids (B, L)`` from the encoder; ``labels (B, L)`` class indices
        (-100: ignored) add the mean cross-entropy."""
        logits = self.classifier(self.head_dropout(self.encode(input_ids, attention_mask)))  # (B, L, num_labels)
        loss = None if labels is None else _cross_entropy(logits, labels, tuple(input_ids.shape), "labels")
        return SequenceClassifierOutput(logits, loss)


def t5_or_bart(model: nn.Module) -> bool:
    """T5 or BART: the LM (``…ForConditionalGeneration``) or a task head on it (the heads subclass the LMs)."""
    return isinstance(model, (T5ForConditionalGeneration, BartForConditionalGeneration))


# ---- the families --------------------------------------------------------------------------------------


class _Seq2SeqHead:
    """What the family classes share: the head built and initialised, the checkpoint adopted."""

    body_prefix = "model."
    base_config: type = object

    def _setup(self, config: ClassifierConfig, std: float) -> None:
        self.config = config
        for m in self._add_head():  # N(0, std) weights, zero biases
            nn.init.normal_(m.weight, std=std)
            nn.init.zeros_(m.bias)

    @classmethod
    def config_from_hf(cls, d: dict) -> ClassifierConfig:
        """:meth:`ClassifierConfig.from_hf` over the family's."""
        return ClassifierConfig.from_hf(d, cls.base_config.from_hf)

    def _weight_map(self, family: str, base: WeightMap, skip: tuple[str, ...], prefix: str) -> WeightMap:
        """``base``'s rules but those of ours starting with ``skip``, HF names under ``prefix`` (the
        ``^``-anchored ignore patterns too) + the head's tensors, the same names in HF."""
        p = prefix
        rules = [dataclasses.replace(r, hf=tuple(p + h for h in r.hf))
                 for r in base.rules if not r.ours.startswith(skip)]
        ignore = [("^" + re.escape(p) + i[1:]) if i.startswith("^") else i for i in base.ignore]
        return WeightMap(family, [*rules, *(rename(k, k) for k in self._head_shapes(self.config))], ignore=ignore)

    @classmethod
    def _adopt(cls, config: ClassifierConfig, hf: dict[str, Tensor], std: float):
        return config, adopt_checkpoint(cls.__name__, hf, prefix=cls.body_prefix,
                                        body_prefixes=("model.", "transformer."), head=cls._head_shapes(config),
                                        std=std, marker="shared.weight")


class _BartHead(_Seq2SeqHead, BartForConditionalGeneration):
    base_config = BartConfig

    def __init__(self, config: ClassifierConfig) -> None:
        check_head_config(type(self), config, BartConfig)
        BartForConditionalGeneration.__init__(self, config.base)
        del self.lm_head, self.final_logits_bias  # (the LM head is tied to `shared`: nothing of it is lost)
        self._setup(config, std=config.base.init_std)

    def hf_weight_map(self) -> WeightMap:
        """BART's body names (:data:`attnlab.models.bart.WEIGHT_MAP`, already under ``model.``; without the LM
        head) + the head's."""
        return self._weight_map("BART", BART_WEIGHT_MAP, ("final_logits_bias",), prefix="")

    @classmethod
    def adapt_hf_checkpoint(cls, config: ClassifierConfig, hf: dict[str, Tensor]):
        """Any BART checkpoint (see :func:`~attnlab.models.classifier.adopt_checkpoint`)."""
        return cls._adopt(config, hf, config.base.init_std)

    def _decoder_output(self, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask) -> Tensor:
        """The last decoder layer's output ``(B, T, d_model)``, the decoder fed ``input_ids`` shifted right."""
        memory = self.encode(input_ids, attention_mask)
        if decoder_input_ids is None:
            decoder_input_ids = shift_tokens_right(input_ids, self.config.decoder_start_token_id)
        return self._decoder_states(decoder_input_ids, memory, attention_mask, decoder_attention_mask, None, False)[0]


class _T5Head(_Seq2SeqHead, T5ForConditionalGeneration):
    base_config = T5Config
    body_prefix = "transformer."
    encoder_only = False

    def __init__(self, config: ClassifierConfig) -> None:
        check_head_config(type(self), config, T5Config)
        T5ForConditionalGeneration.__init__(self, config.base)
        self.lm_head = None  # (tied or not, a task head has none)
        if self.encoder_only:
            del self.decoder
        self._setup(config, std=config.base.d_model ** -0.5)

    def hf_weight_map(self) -> WeightMap:
        """T5's body names (:func:`attnlab.models.t5.weight_map`, without the LM head) + the head's."""
        skip = ("lm_head.", "decoder.") if self.encoder_only else ("lm_head.",)
        return self._weight_map("T5", t5_weight_map(self.config.base), skip, prefix=self.body_prefix)

    @classmethod
    def adapt_hf_checkpoint(cls, config: ClassifierConfig, hf: dict[str, Tensor]):
        """Any T5 checkpoint (see :func:`~attnlab.models.classifier.adopt_checkpoint`); the token head drops
        the decoder's tensors."""
        if cls.encoder_only:
            hf = {k: v for k, v in hf.items() if not re.match(r"(transformer\.)?decoder\.", k)}
        return cls._adopt(config, hf, config.base.d_model ** -0.5)

    def _decoder_output(self, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask) -> Tensor:
        """The decoder stack's output ``(B, T, d_model)`` (no LM scaling), fed ``input_ids`` shifted right."""
        memory = self.encode(input_ids, attention_mask)
        if decoder_input_ids is None:
            decoder_input_ids = self.shift_right(input_ids)
        return self._decoder_states(decoder_input_ids, memory, attention_mask, decoder_attention_mask, None, False)[0]


class BartForSequenceClassification(_EosClassification, _BartHead):
    """HF ``BartForSequenceClassification``: the classification head on the decoder's output at each row's last eos."""

    hf_architecture = "BartForSequenceClassification"


class BartForQuestionAnswering(_SpanPrediction, _BartHead):
    """HF ``BartForQuestionAnswering``: ``[start | end] = qa_outputs(d)`` (``num_labels`` = 2, as transformers sets)."""

    hf_architecture = "BartForQuestionAnswering"


class T5ForSequenceClassification(_EosClassification, _T5Head):
    """HF ``T5ForSequenceClassification``: the classification head on the decoder's output at each row's last eos."""

    hf_architecture = "T5ForSequenceClassification"


class T5ForTokenClassification(_TokenClassification, _T5Head):
    """HF ``T5ForTokenClassification``: ``classifier(dropout(e))`` on the encoder alone (HF's ``T5EncoderModel``)."""

    hf_architecture = "T5ForTokenClassification"
    encoder_only = True


class T5ForQuestionAnswering(_SpanPrediction, _T5Head):
    """HF ``T5ForQuestionAnswering``: ``[start | end] = qa_outputs(d)``; its body's names are at the top in HF."""

    hf_architecture = "T5ForQuestionAnswering"
    body_prefix = ""


extend_family("bart", BartForSequenceClassification, BartForQuestionAnswering)
extend_family("t5", T5ForSequenceClassification, T5ForTokenClassification, T5ForQuestionAnswering)
