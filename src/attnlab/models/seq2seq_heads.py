"""Task heads on BART, as transformers defines them: the whole encoder–decoder runs with the decoder fed
``input_ids`` shifted right (behind ``decoder_start_token_id``), and the head reads the decoder's output ``d``::

    BartForSequenceClassification   r = d[b, last eos of b]     (eos pooling: the last position whose id is
                                                                 eos_token_id; every row needs the same count)
                                    logits = W_o dropout(tanh(W_d dropout(r) + b_d)) + b_o      (B, num_labels)
    BartForQuestionAnswering        [start | end] = W_qa d + b_qa                              (B, L) each

Dropout is ``classifier_dropout`` (default 0, transformers' BART default). Losses:
:mod:`attnlab.models.classifier`. HF tensor names: the body under ``model.`` (as in
``BartForConditionalGeneration``), the heads as ``classification_head.dense`` / ``.out_proj`` and
``qa_outputs``. A task head has no LM head: ``lm_head`` (tied to ``shared``) and ``final_logits_bias``
are removed, so such a model encodes and classifies but does not generate. Any BART checkpoint (the bare
``BartModel``, the LM, another head) loads with a freshly initialised task head and one warning line.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from attnlab.models.bart import WEIGHT_MAP as BART_WEIGHT_MAP, BartConfig, BartForConditionalGeneration, \
    shift_tokens_right
from attnlab.models.classifier import (ClassifierConfig, QuestionAnsweringOutput, SequenceClassifierOutput,
                                       adopt_checkpoint, classification_loss, extend_family, question_answering_loss)
from attnlab.models.decoder_heads import check_head_config
from attnlab.models.hub import WeightMap, rename
from attnlab.nn.dropout import Dropout


class BartClassificationHead(nn.Module):
    """``W_o dropout(tanh(W_d dropout(r) + b_d)) + b_o``: ``(B, d_model)`` -> ``(B, num_labels)``."""

    def __init__(self, d_model: int, num_labels: int, dropout: float) -> None:
        super().__init__()
        self.dense = nn.Linear(d_model, d_model)
        self.dropout = Dropout(dropout)
        self.out_proj = nn.Linear(d_model, num_labels)

    def forward(self, r: Tensor) -> Tensor:
        return self.out_proj(self.dropout(torch.tanh(self.dense(self.dropout(r)))))


class _BartHead(BartForConditionalGeneration):
    """BART's encoder–decoder (``model.*`` in HF) with a task head instead of the LM head."""

    def __init__(self, config: ClassifierConfig) -> None:
        check_head_config(type(self), config, BartConfig)
        super().__init__(config.base)
        self.config = config
        del self.lm_head, self.final_logits_bias  # (the LM head is tied to `shared`: nothing of it is lost)
        self._add_head()
        for m in self.head_modules():  # HF's init: N(0, init_std) weights, zero biases
            nn.init.normal_(m.weight, std=config.base.init_std)
            nn.init.zeros_(m.bias)

    @classmethod
    def config_from_hf(cls, d: dict) -> ClassifierConfig:
        """:meth:`ClassifierConfig.from_hf` over :meth:`BartConfig.from_hf`."""
        return ClassifierConfig.from_hf(d, BartConfig.from_hf)

    def hf_weight_map(self) -> WeightMap:
        """BART's body names (:data:`attnlab.models.bart.WEIGHT_MAP`, without the LM head) + the head's."""
        m = BART_WEIGHT_MAP
        rules = [r for r in m.rules if r.ours != "final_logits_bias"]
        return WeightMap("BART", [*rules, *self.head_rules], ignore=m.ignore)

    @classmethod
    def adapt_hf_checkpoint(cls, config: ClassifierConfig, hf: dict[str, Tensor]):
        """Any BART checkpoint (see :func:`~attnlab.models.classifier.adopt_checkpoint`)."""
        return config, adopt_checkpoint(cls.__name__, hf, prefix="model.", body_prefixes=("model.",),
                                        head=cls._head_shapes(config), std=config.base.init_std,
                                        marker="shared.weight")

    def _decoder_output(self, input_ids: Tensor, attention_mask: Optional[Tensor],
                        decoder_input_ids: Optional[Tensor], decoder_attention_mask: Optional[Tensor]) -> Tensor:
        """The last decoder layer's output ``(B, T, d_model)``; the decoder input defaults to ``input_ids``
        shifted right, as transformers'."""
        memory = self.encode(input_ids, attention_mask)
        if decoder_input_ids is None:
            decoder_input_ids = shift_tokens_right(input_ids, self.config.decoder_start_token_id)
        return self._decoder_states(decoder_input_ids, memory, attention_mask, decoder_attention_mask, None, False)[0]


class BartForSequenceClassification(_BartHead):
    """HF ``BartForSequenceClassification``: the classification head on the decoder's output at each row's
    last ``eos_token_id``."""

    hf_architecture = "BartForSequenceClassification"
    head_name = "classification_head"
    label_tensors = ("classification_head.out_proj.weight", "classification_head.out_proj.bias")
    head_rules = [rename("classification_head.{m:dense|out_proj}.{p}", "classification_head.{m}.{p}")]

    def _add_head(self) -> None:
        p = self.config.classifier_dropout
        self.classification_head = BartClassificationHead(self.config.d_model, self.config.num_labels,
                                                          0.0 if p is None else p)

    def head_modules(self) -> list[nn.Linear]:
        return [self.classification_head.dense, self.classification_head.out_proj]

    @classmethod
    def _head_shapes(cls, config: ClassifierConfig) -> dict[str, tuple[int, ...]]:
        E, n = config.base.d_model, config.num_labels
        return {"classification_head.dense.weight": (E, E), "classification_head.dense.bias": (E,),
                "classification_head.out_proj.weight": (n, E), "classification_head.out_proj.bias": (n,)}

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                decoder_input_ids: Optional[Tensor] = None, decoder_attention_mask: Optional[Tensor] = None,
                labels: Optional[Tensor] = None) -> SequenceClassifierOutput:
        """Classify each row of ``input_ids (B, S)`` (``attention_mask`` 1 = token, 0 = padding); ``labels``
        ``(B,)`` add ``loss`` (:func:`~attnlab.models.classifier.classification_loss`).

        Raises:
            ValueError: rows with different numbers of ``eos_token_id`` or none; inputs as BART refuses them.
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


class BartForQuestionAnswering(_BartHead):
    """HF ``BartForQuestionAnswering``: ``[start | end] = qa_outputs(d)`` on the decoder's output (2 outputs:
    transformers sets ``num_labels = 2``)."""

    hf_architecture = "BartForQuestionAnswering"
    head_name = "qa_outputs"
    head_rules = [rename("qa_outputs.{p}", "qa_outputs.{p}")]

    def __init__(self, config: ClassifierConfig) -> None:
        if isinstance(config, ClassifierConfig) and config.num_labels != 2:
            raise ValueError(f"BartForQuestionAnswering needs num_labels=2 (start, end), got {config.num_labels}")
        super().__init__(config)

    def _add_head(self) -> None:
        self.qa_outputs = nn.Linear(self.config.d_model, 2)

    def head_modules(self) -> list[nn.Linear]:
        return [self.qa_outputs]

    @classmethod
    def _head_shapes(cls, config: ClassifierConfig) -> dict[str, tuple[int, ...]]:
        return {"qa_outputs.weight": (2, config.base.d_model), "qa_outputs.bias": (2,)}

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                decoder_input_ids: Optional[Tensor] = None, decoder_attention_mask: Optional[Tensor] = None,
                start_positions: Optional[Tensor] = None, end_positions: Optional[Tensor] = None
                ) -> QuestionAnsweringOutput:
        """Span logits ``(B, L)`` each; both positions ``(B,)`` add
        :func:`~attnlab.models.classifier.question_answering_loss`."""
        d = self._decoder_output(input_ids, attention_mask, decoder_input_ids, decoder_attention_mask)
        start, end = self.qa_outputs(d).unbind(-1)
        return QuestionAnsweringOutput(start, end, question_answering_loss(start, end, start_positions, end_positions))


extend_family("bart", BartForSequenceClassification, BartForQuestionAnswering)
