"""Text (or text pair) classification with a sequence-classification head: encode, predict, score.

::

    single-label:  p = softmax(logits)          label = argmax p
    multi-label:   p = sigmoid(logits)          (each label on its own)
    regression:    value = logits[0]            (num_labels == 1)

A pair is encoded with the tokenizer's pair template (BERT: ``[CLS] a [SEP] b [SEP]``, token types
0 then 1), both parts truncated longest-first to ``max_length``. Used by ``attnlab predict`` and the
``classify`` training recipe.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from attnlab._checks import positive_int
from attnlab._limits import check_forward_memory


@dataclass
class EncodedBatch:
    """``input_ids``, ``attention_mask``, ``token_type_ids``: ``(B, L)`` int64, right-padded."""

    input_ids: Tensor
    attention_mask: Tensor
    token_type_ids: Tensor


def is_sequence_classifier(model: nn.Module) -> bool:
    """Whether ``model`` is one of the sequence-classification heads of :mod:`attnlab.models.heads`."""
    return getattr(model, "hf_architecture", "").endswith("ForSequenceClassification") \
        and hasattr(model.config, "id2label")


def encode_texts(tokenizer, texts: Sequence[str], texts_b: Optional[Sequence[str]] = None, *,
                 pad_id: int, max_length: int = 512) -> EncodedBatch:
    """Token ids of ``texts`` (or of the pairs ``(texts[i], texts_b[i])``) with the tokenizer's special
    tokens, truncated to ``max_length`` and right-padded with ``pad_id``.

    Args:
        tokenizer: a :class:`~attnlab.data.tokenizers.TextTokenizer` (a ``tokenizer.json``).

    Raises:
        ValueError: no texts, ``texts_b`` of another length, ``max_length`` < 1, a non-string text.
    """
    from tokenizers import Tokenizer

    positive_int("max_length", max_length)
    texts = list(texts)
    if not texts:
        raise ValueError("texts must hold at least one text")
    if texts_b is not None:
        texts_b = list(texts_b)
        if len(texts_b) != len(texts):
            raise ValueError(f"texts_b must pair each of the {len(texts)} texts, got {len(texts_b)}")
    bad = next((t for t in texts + (texts_b or []) if not isinstance(t, str)), None)
    if bad is not None:
        raise ValueError(f"texts must be strings, got {type(bad).__name__}")
    tok = Tokenizer.from_str(tokenizer.tokenizer.to_str())  # a copy: truncation set here only
    tok.enable_truncation(max_length, strategy="longest_first")
    encs = tok.encode_batch(texts if texts_b is None else list(zip(texts, texts_b)), add_special_tokens=True)
    L = max(1, max(len(e.ids) for e in encs))
    ids = torch.full((len(encs), L), pad_id, dtype=torch.long)
    mask = torch.zeros(len(encs), L, dtype=torch.long)
    types = torch.zeros(len(encs), L, dtype=torch.long)
    for b, e in enumerate(encs):
        n = len(e.ids)
        ids[b, :n], mask[b, :n], types[b, :n] = torch.tensor(e.ids), 1, torch.tensor(e.type_ids)
    return EncodedBatch(ids, mask, types)


def pad_id_for(model: nn.Module, tokenizer) -> int:
    """The id to pad with: the model config's ``pad_token_id``, else the tokenizer's ``[PAD]``/``<pad>``, else 0
    (a decoder-only head without ``pad_token_id`` is then run one text at a time, see :func:`logits_of`)."""
    pad = getattr(model.config, "pad_token_id", None)
    if pad is None:
        pad = tokenizer.pad_id
    return 0 if pad is None else int(pad)


def forward_logits(model: nn.Module, batch: EncodedBatch) -> Tensor:
    """``(B, num_labels)`` logits of a sequence classifier on an encoded batch (a GPT-2 or Llama head without
    ``pad_token_id`` reads one sequence at a time)."""
    if hasattr(model, "bert"):
        return model(batch.input_ids, batch.attention_mask, batch.token_type_ids).logits
    if getattr(model.config, "pad_token_id", None) is None and batch.input_ids.shape[0] > 1:
        return torch.cat([forward_logits(model, EncodedBatch(*(t[b:b + 1, :int(batch.attention_mask[b].sum())]
                                                         for t in (batch.input_ids, batch.attention_mask,
                                                                   batch.token_type_ids))))
                          for b in range(batch.input_ids.shape[0])])
    return model(batch.input_ids, attention_mask=batch.attention_mask).logits


def logits_of(model: nn.Module, tokenizer, texts: Sequence[str], texts_b: Optional[Sequence[str]] = None, *,
              batch_size: int = 32, max_length: int = 512) -> Tensor:
    """``(N, num_labels)`` logits of a sequence classifier on ``texts`` (or pairs), in batches, without grad.

    Raises:
        ValueError: ``model`` is not a sequence classifier; bad texts as :func:`encode_texts`.
    """
    if not is_sequence_classifier(model):
        raise ValueError(f"a sequence-classification model is needed (e.g. BertForSequenceClassification), "
                         f"got {type(model).__name__}")
    positive_int("batch_size", batch_size)
    device = next(model.parameters()).device
    pad = pad_id_for(model, tokenizer)
    out = []
    with torch.no_grad():
        for i in range(0, len(texts), batch_size):
            b = encode_texts(tokenizer, texts[i:i + batch_size], None if texts_b is None else texts_b[i:i + batch_size],
                             pad_id=pad, max_length=max_length)
            rows, length = b.input_ids.shape
            check_forward_memory(f"batch_size={batch_size} (a batch of {rows} texts of up to {length} tokens)",
                                 model.config, batch=rows, seq=length, device=device)
            b = EncodedBatch(*(t.to(device) for t in (b.input_ids, b.attention_mask, b.token_type_ids)))
            out.append(forward_logits(model, b).float().cpu())
    return torch.cat(out)


def probabilities(logits: Tensor, config) -> Tensor:
    """softmax (single-label), sigmoid (``problem_type="multi_label_classification"``) or the value itself
    (regression, ``num_labels == 1``) of ``logits (N, num_labels)``."""
    if config.num_labels == 1 or config.problem_type == "regression":
        return logits
    if config.problem_type == "multi_label_classification":
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)
