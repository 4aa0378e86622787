"""Task heads on BERT, as Hugging Face's: sequence and token classification, extractive QA; and the one
entry point for every family's heads (the decoder-only ones live in :mod:`attnlab.models.decoder_heads`,
BART's in :mod:`attnlab.models.seq2seq_heads`, all importable from here).

::

    BertForSequenceClassification   logits = W_c dropout(pooler) + b_c                  (B, num_labels)
    BertForTokenClassification      logits = W_c dropout(h) + b_c                       (B, L, num_labels)
    BertForQuestionAnswering        [start | end] = W_qa h + b_qa                       (B, L) each

Losses, as transformers computes them (``problem_type`` from ``config.json``, else inferred):
``num_labels == 1`` → regression, ``MSE(logits, labels)``; integer labels → cross-entropy
``-log softmax(logits)[label]`` (label ``-100`` is ignored); float ``(B, num_labels)`` labels →
multi-label ``BCEWithLogits``. QA: ``(CE(start_logits, start) + CE(end_logits, end)) / 2`` with
positions clamped to ``[0, L]`` and ``L`` ignored.

A head's config is a :class:`ClassifierConfig`: the family's config (``base``) plus ``id2label``,
``label2id``, ``problem_type``, ``classifier_dropout`` and ``pad_token_id`` (decoder-only heads), all read
from and written back to ``config.json``. A checkpoint of the bare encoder or of another head (e.g.
all-MiniLM-L6-v2's ``BertModel``, ``gpt2``'s LM head) loads with a freshly initialised task head and
one warning line naming it, as transformers does.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Optional

import torch
from torch import Tensor, nn

from attnlab.models.classifier import (PROBLEM_TYPES, ClassifierConfig, QuestionAnsweringOutput,  # noqa: F401
                                       SequenceClassifierOutput, classification_loss, _cross_entropy, extend_family,
                                       question_answering_loss)
from attnlab._checks import stored_dtype
from attnlab.models.bert import BertConfig, BertModel, _BertBase, weight_map as bert_weight_map
from attnlab.models.decoder_heads import (GPT2ForQuestionAnswering, GPT2ForSequenceClassification,  # noqa: F401
                                          GPT2ForTokenClassification, LlamaForQuestionAnswering,
                                          LlamaForSequenceClassification, LlamaForTokenClassification, _SequenceTask)
from attnlab.models.hub import WeightMap, rename
from attnlab.models.seq2seq_heads import (BartForQuestionAnswering, BartForSequenceClassification,  # noqa: F401
                                          T5ForQuestionAnswering, T5ForSequenceClassification,
                                          T5ForTokenClassification)
from attnlab.nn.dropout import Dropout

def _prefixed(rules, prefix: str):
    """``rules`` with ``prefix`` put before our side's template."""
    return [dataclasses.replace(r, ours=prefix + r.ours) for r in rules]


# ---- BERT -------------------------------------------------------------------------------------


class _BertHead(_BertBase):
    """``self.bert`` (:class:`BertModel`, with a pooler when ``with_pooler``) + one linear head ``head_name``."""

    heads = ("task",)
    with_pooler = False
    head_name = "classifier"

    def __init__(self, config: ClassifierConfig) -> None:
        super().__init__()
        if not isinstance(config, ClassifierConfig) or not isinstance(config.base, BertConfig):
            raise TypeError(f"config must be a ClassifierConfig of a BertConfig, got {type(config).__name__}")
        self.config = config
        self.bert = BertModel(config.base, add_pooling_layer=self.with_pooler)
        p = config.classifier_dropout
        self.dropout = Dropout(config.base.hidden_dropout_prob if p is None else p)
        setattr(self, self.head_name, nn.Linear(config.base.hidden_size, self._outputs(config)))
        self._init_weights(config.base.initializer_range)

    @classmethod
    def _outputs(cls, config: ClassifierConfig) -> int:
        """The head's number of outputs."""
        return config.num_labels

    @classmethod
    def config_from_hf(cls, d: dict) -> ClassifierConfig:
        """:meth:`ClassifierConfig.from_hf` over :meth:`BertConfig.from_hf`."""
        return ClassifierConfig.from_hf(d, BertConfig.from_hf)

    def hf_weight_map(self) -> WeightMap:
        """BERT's names under ``bert.`` (:func:`attnlab.models.bert.weight_map`) + the head, same name in HF."""
        base = bert_weight_map(pooler=self.with_pooler, heads=self.heads)
        return WeightMap("BERT", [*base.rules, rename(f"{self.head_name}.{{p}}", f"{self.head_name}.{{p}}")],
                         ignore=base.ignore)

    @classmethod
    def adapt_hf_checkpoint(cls, config: ClassifierConfig, hf: dict[str, Tensor]):
        """Any BERT checkpoint into this head: the encoder's tensors (with or without ``bert.``) are kept,
        other heads' (``cls.*``) dropped, a pooler added or dropped as this head needs, and a missing
        task head freshly initialised (N(0, initializer_range), zero bias) with one warning line."""
        prefixed = any(k.startswith("bert.") for k in hf)
        head = {k: v for k, v in hf.items() if k.startswith(cls.head_name + ".")}
        enc = {k[5:]: v for k, v in hf.items() if k.startswith("bert.")} if prefixed else \
            {k: v for k, v in hf.items() if not k.startswith(("cls.", "classifier.", "qa_outputs."))}
        pooler = ("pooler.dense.weight", "pooler.dense.bias")
        if cls.with_pooler:
            _, enc = BertModel.adapt_hf_checkpoint(config.base, enc)
        else:
            enc = {k: v for k, v in enc.items() if k not in pooler}
        if not head and "embeddings.word_embeddings.weight" in enc:
            dtype = enc["embeddings.word_embeddings.weight"].dtype
            n, E = cls._outputs(config), config.base.hidden_size
            warnings.warn(f"the checkpoint has no {cls.head_name}.weight / .bias: {cls.__name__}'s head is freshly "
                          f"initialised ({n} outputs), train it before use", stacklevel=3)
            head = {f"{cls.head_name}.weight": torch.randn(n, E).mul_(config.base.initializer_range).to(dtype),
                    f"{cls.head_name}.bias": torch.zeros(n, dtype=dtype)}
        return config, {**{"bert." + k: v for k, v in enc.items()}, **head}

    def _encode(self, input_ids, attention_mask, token_type_ids, output_attentions, output_hidden_states):
        return self.bert(input_ids, attention_mask, token_type_ids, output_attentions=output_attentions,
                         output_hidden_states=output_hidden_states)


class BertForSequenceClassification(_BertHead):
    """HF ``BertForSequenceClassification``: ``logits = W_c dropout(pooler_output) + b_c``, ``(B, num_labels)``."""

    hf_architecture = "BertForSequenceClassification"
    with_pooler = True
    label_tensors = ("classifier.weight", "classifier.bias")

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                token_type_ids: Optional[Tensor] = None, labels: Optional[Tensor] = None, *,
                output_attentions: bool = False, output_hidden_states: bool = False) -> SequenceClassifierOutput:
        """Classify each sequence; ``labels`` ``(B,)`` (class indices, or floats for regression) adds ``loss``
        (:func:`classification_loss`). Inputs as :meth:`BertModel.forward`."""
        out = self._encode(input_ids, attention_mask, token_type_ids, output_attentions, output_hidden_states)
        logits = self.classifier(self.dropout(out.pooler_output))  # (B, num_labels)
        loss = None if labels is None else classification_loss(logits, labels, self.config)
        return SequenceClassifierOutput(logits, loss, out.hidden_states, out.attentions)


class BertForTokenClassification(_BertHead):
    """HF ``BertForTokenClassification``: ``logits = W_c dropout(h) + b_c``, ``(B, L, num_labels)``; no pooler."""

    hf_architecture = "BertForTokenClassification"

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                token_type_ids: Optional[Tensor] = None, labels: Optional[Tensor] = None, *,
                output_attentions: bool = False, output_hidden_states: bool = False) -> SequenceClassifierOutput:
        """Classify each token; ``labels`` ``(B, L)`` class indices (-100: ignored) add the mean cross-entropy."""
        out = self._encode(input_ids, attention_mask, token_type_ids, output_attentions, output_hidden_states)
        logits = self.classifier(self.dropout(out.last_hidden_state))  # (B, L, num_labels)
        loss = None if labels is None else _cross_entropy(logits, labels, tuple(input_ids.shape), "labels")
        return SequenceClassifierOutput(logits, loss, out.hidden_states, out.attentions)


class BertForQuestionAnswering(_BertHead):
    """HF ``BertForQuestionAnswering``: ``[start | end] = W_qa h + b_qa`` (``qa_outputs`` has ``num_labels`` = 2
    outputs, as HF's); no pooler, no dropout."""

    hf_architecture = "BertForQuestionAnswering"
    head_name = "qa_outputs"

    @classmethod
    def _outputs(cls, config: ClassifierConfig) -> int:
        """2 (start, end); another ``num_labels`` is refused."""
        if config.num_labels != 2:
            raise ValueError(f"BertForQuestionAnswering needs num_labels=2 (start, end), got {config.num_labels}")
        return 2

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                token_type_ids: Optional[Tensor] = None, start_positions: Optional[Tensor] = None,
                end_positions: Optional[Tensor] = None, *, output_attentions: bool = False,
                output_hidden_states: bool = False) -> QuestionAnsweringOutput:
        """Span logits; ``start_positions`` and ``end_positions`` ``(B,)`` add
        ``loss = (CE(start) + CE(end)) / 2`` (positions clamped to ``[0, L]``, ``L`` ignored, as HF)."""
        out = self._encode(input_ids, attention_mask, token_type_ids, output_attentions, output_hidden_states)
        start, end = self.qa_outputs(out.last_hidden_state).unbind(-1)  # (B, L) each
        loss = question_answering_loss(start, end, start_positions, end_positions)
        return QuestionAnsweringOutput(start, end, loss, out.hidden_states, out.attentions)


SEQUENCE_CLASSIFIERS = {"bert": BertForSequenceClassification, "gpt2": GPT2ForSequenceClassification,
                        "llama": LlamaForSequenceClassification, "bart": BartForSequenceClassification,
                        "t5": T5ForSequenceClassification}


def classifier_from_pretrained(path, id2label: dict, *, problem_type: Optional[str] = None,
                               pad_token_id: Optional[int] = None, dtype: Optional[torch.dtype] = None):
    """A sequence classifier with the labels ``id2label`` from any checkpoint of its family (a bare
    model, an LM, another classifier): the body's weights are loaded, the head is freshly initialised
    (one warning line) unless the checkpoint's head already has one output per label.

    Args:
        path: an HF-format folder or Hub id (:func:`attnlab.models.hub.resolve_pretrained`).
        id2label: ``{index: name}`` of the new head.
        pad_token_id: a decoder-only model's padding id when its config has none (e.g. the tokenizer's;
            else its ``eos_token_id``, as is common).

    Raises:
        ValueError: a ``model_type`` with no sequence-classification head here, or the loader's refusals.
    """
    from attnlab.models.hub import load_weights, read_config, resolve_pretrained

    folder = resolve_pretrained(path)
    raw, family = read_config(folder)
    cls = SEQUENCE_CLASSIFIERS.get(family.model_type)
    if cls is None:
        raise ValueError(f"{str(folder)!r} holds a {family.model_type!r} model; sequence classification is "
                         f"available for {sorted(SEQUENCE_CLASSIFIERS)}")
    config = cls.config_from_hf(raw)
    pad = config.pad_token_id if config.pad_token_id is not None else pad_token_id
    if issubclass(cls, _SequenceTask) and pad is None:
        pad = config.base.eos_token_id  # GPT-2 has no padding token; its end-of-text serves, as is common
    config = ClassifierConfig(config.base, id2label=id2label, problem_type=problem_type,
                              classifier_dropout=config.classifier_dropout, pad_token_id=pad)
    head = cls.label_tensors
    weights = {k: v for k, v in load_weights(folder).items()
               if k not in head or v.shape[0] == config.num_labels}  # a head of another size: replaced
    config, hf = cls.adapt_hf_checkpoint(config, weights)
    model = cls(config)
    for name, t in model.to_hf_state_dict().items():
        if name in hf:
            stored_dtype(f"{name!r} of checkpoint {str(folder)!r}", hf[name], t)
    model.load_state_dict(model.from_hf_state_dict(hf), strict=True)
    if dtype is None:
        dtype = next(v.dtype for v in hf.values() if v.is_floating_point())
    return model.to(dtype)


extend_family("bert", BertForSequenceClassification, BertForTokenClassification, BertForQuestionAnswering)
