"""ONNX export of BERT-style encoders (BERT, all-MiniLM-L6-v2) with dynamic batch size and length.

The graph takes ``input_ids``, ``attention_mask`` and ``token_type_ids`` (int64, ``(batch, sequence)``)
— the input names Hugging Face Optimum uses for BERT — and returns ``last_hidden_state``
``(batch, sequence, hidden)`` plus ``pooler_output`` ``(batch, hidden)`` when the model has a pooler, or
``logits`` for :class:`~attnlab.models.bert.BertForMaskedLM`.

It is traced with the TorchScript exporter (``torch.onnx.export(..., dynamo=False)``) on a copy of the
model whose attention modules use the ``reference`` backend — ``softmax(Q Kᵀ/√d + mask) V`` written out
as MatMul/Softmax nodes that ONNX Runtime fuses itself. (The ``dynamo`` exporter stops at the models'
data-dependent input checks, e.g. ``input_ids.max() < vocab_size``; the tracer records them as
constants, which is harmless because they only raise errors.)
"""
from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path
from typing import Optional, Union

import torch
from torch import Tensor, nn

from attnlab._checks import int_at_least
from attnlab._io import atomic_write
from attnlab.modules.multihead import MultiheadAttention
from attnlab.models.bert import BertForMaskedLM, BertModel

PathLike = Union[str, os.PathLike]
DEFAULT_OPSET = 17
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")


class _Exportable(nn.Module):
    """Positional tensors in, a tuple of tensors out: what the tracer records."""

    def __init__(self, model: nn.Module, outputs: tuple[str, ...]) -> None:
        super().__init__()
        self.model, self.outputs = model, outputs

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor) -> tuple[Tensor, ...]:
        out = self.model(input_ids, attention_mask, token_type_ids)
        return tuple(getattr(out, name) for name in self.outputs)


def output_names(model: nn.Module) -> tuple[str, ...]:
    """The graph outputs :func:`export_onnx` writes for ``model``."""
    if isinstance(model, BertForMaskedLM):
        return ("logits",)
    if isinstance(model, BertModel):
        return ("last_hidden_state",) + (("pooler_output",) if model.pooler is not None else ())
    raise TypeError(f"export_onnx exports BERT encoders (BertModel, BertForMaskedLM), got {type(model).__name__}")


def export_onnx(model: nn.Module, path: PathLike, *, opset: Optional[int] = None, example_length: int = 16) -> Path:
    """Write ``model`` as an ONNX file with dynamic ``batch`` and ``sequence`` axes (atomically).

    Args:
        model: a :class:`~attnlab.models.bert.BertModel` / ``BertForMaskedLM`` (e.g. from
            ``attnlab.from_pretrained``); exported in eval mode, float32.
        path: the ``.onnx`` file to write (its folder is created).
        opset: ONNX opset (default 17; at least 14, where SDPA's pieces are expressible).
        example_length: sequence length of the example input that is traced (any length works after).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        TypeError: ``model`` is not a supported encoder.
        ValueError: the model was quantised or packed for inference (export before that); ``opset`` < 14, or ``example_length`` outside ``[2, max_position_embeddings]``.
    """
    outputs = output_names(model)
    converted = sorted({type(m).__name__ for m in model.modules()
                        if type(m).__name__ in ("Int8Linear", "Int8Embedding", "PackedLinear")})
    if converted:  # their kernels (int8 matmuls, oneDNN's packed weights) have no ONNX form here
        raise ValueError(f"export_onnx: the model holds {', '.join(converted)} layers (from quantize() or "
                         "optimize_for_inference()); export the float model first, then quantise the ONNX file "
                         "(onnxruntime.quantization.quantize_dynamic)")
    opset = DEFAULT_OPSET if opset is None else opset
    int_at_least("opset", opset, 14)
    cfg = model.config
    if not 2 <= example_length <= cfg.max_position_embeddings:
        raise ValueError(f"example_length must be in [2, {cfg.max_position_embeddings}], got {example_length}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = torch.randint(1, cfg.vocab_size, (2, example_length))
    mask = torch.ones_like(ids)
    mask[1, example_length // 2:] = 0  # a padded row, so the mask is traced as data, not folded away
    example = (ids, mask, torch.zeros_like(ids))
    dynamic = {name: {0: "batch", 1: "sequence"} for name in INPUT_NAMES}
    dynamic.update({name: {0: "batch", 1: "sequence"} if name != "pooler_output" else {0: "batch"}
                    for name in outputs})
    traced = copy.deepcopy(model).eval().float()
    for m in traced.modules():
        if isinstance(m, MultiheadAttention):
            m.backend = "reference"  # softmax(QKᵀ/√d + mask)V as plain ops; the tracer cannot take SDPA's GQA flag
    wrapper = _Exportable(traced, outputs)

    def write(tmp: str) -> None:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tracer warnings about Python bools from input checks
            torch.onnx.export(wrapper, example, tmp, input_names=list(INPUT_NAMES), output_names=list(outputs),
                              dynamic_axes=dynamic, opset_version=opset, dynamo=False)

    atomic_write(path, write)
    return path
