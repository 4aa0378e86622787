"""ONNX export of BERT-style encoders and of decoder-only language models (GPT-2, Llama) with an explicit KV cache.

**Encoders** (BERT, all-MiniLM-L6-v2): the graph takes ``input_ids``, ``attention_mask`` and ``token_type_ids``
(int64, ``(batch, sequence)``) — the input names Hugging Face Optimum uses for BERT — and returns
``last_hidden_state`` ``(batch, sequence, hidden)`` plus ``pooler_output`` ``(batch, hidden)`` when the model has
a pooler, or ``logits`` for :class:`~attnlab.models.bert.BertForMaskedLM`.

**Task heads** on those (``BertForSequenceClassification`` / ``…TokenClassification`` / ``…QuestionAnswering``, and
GPT-2's and Llama's): the encoder's inputs (a decoder head's: ``input_ids`` and ``attention_mask``, no cache) and the
head's ``logits`` (question answering: ``start_logits`` and ``end_logits``).

**Vision Transformers** (``ViTModel``, ``ViTForImageClassification``): ``pixel_values`` ``(batch, channels,
image_size, image_size)`` float32 in, ``last_hidden_state`` (+ ``pooler_output``) or ``logits`` out; only the batch
axis is dynamic (the position table fixes the picture's size).

**Encoder–decoders**: a ``Seq2SeqTransformer`` (a ``multi30k-de-en`` run), ``T5ForConditionalGeneration`` and
``BartForConditionalGeneration`` take ``input_ids``, ``attention_mask`` (source) and ``decoder_input_ids`` and return
the teacher-forced ``logits`` ``(batch, decoder_sequence, vocab)``; no cache (each decoding step runs the whole
graph). Their task heads (``T5For…`` / ``BartForSequenceClassification``, ``…QuestionAnswering``,
``T5ForTokenClassification``) take ``input_ids`` and ``attention_mask`` as their forward does (the decoder is fed
``input_ids`` shifted right inside the graph) and return the head's outputs.

**Decoder-only models** (:class:`~attnlab.models.causal_lm.DecoderOnlyLM`: GPT-2, Llama with GQA) use Optimum's
decoder layout, one graph for the first call and every step after it (``L`` layers, ``Hkv`` key/value heads)::

    inputs   input_ids                    (batch, sequence)                 int64
             attention_mask               (batch, past + sequence)          int64, 1 = token, 0 = padding
             past_key_values.{i}.key      (batch, Hkv, past, head_dim)      float32, i = 0 .. L-1
             past_key_values.{i}.value    (batch, Hkv, past, head_dim)
    outputs  logits                       (batch, sequence, vocab)
             present.{i}.key / .value     (batch, Hkv, past + sequence, head_dim) = concat(past, new) on axis 2

The first call passes past tensors of length 0; each later call passes the previous call's ``present`` and the
mask grown by the new tokens. There is no ``position_ids`` input: positions follow the mask inside the graph as in
our forward (GPT-2: ``p = cumsum(mask) - 1``; Llama: RoPE at ``past .. past + sequence - 1``, exact under left
padding because RoPE is relative), so prompts of different lengths are left-padded. The graph holds the model's
position table (GPT-2's ``n_positions``; Llama's RoPE table, grown to ``max_position_embeddings``): ONNX Runtime
refuses positions beyond it. A model under :func:`~attnlab.adapt.deploy.sliding_window` exports with its window
as a mask; the graph's past still keeps every position (no ring buffer). :class:`OnnxDecoder` runs such a file
behind the decoder protocol of :mod:`attnlab.generation`, so ``generate`` (greedy, sampling, beams) decodes on
ONNX Runtime.

Both are traced with the TorchScript exporter (``torch.onnx.export(..., dynamo=False)``) on a float32 copy of the
model whose attention modules use the ``reference`` backend — ``softmax(Q Kᵀ/√d + mask) V`` written out as
MatMul/Softmax nodes that ONNX Runtime fuses itself. (The ``dynamo`` exporter stops at the models' data-dependent
input checks, e.g. ``input_ids.max() < vocab_size``; the tracer records them as constants, which is harmless
because they only raise errors.) The tracer also fixes Python branches to the example's, so the decoder example has
a padded row, ``sequence > 1`` and a non-empty past: the graph then always applies the padding mask (all-allowed
when nothing is padded) and the causal mask, bottom-right aligned, which leaves one new query free to see every key.
The cache plumbing is :class:`_DecoderWithCache`, a wrapper: the past fills a fresh
:class:`~attnlab.modules.cache.KVCache` per layer and the model's own forward appends to it.
"""
from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from torch import Tensor, nn

from attnlab._checks import is_int
from attnlab._io import atomic_write
from attnlab.modules.cache import KVCache
from attnlab.modules.multihead import MultiheadAttention
from attnlab.models.bert import BertForMaskedLM, BertModel
from attnlab.models.causal_lm import CausalLMOutput, DecoderOnlyLM
from attnlab.models.config import TransformerConfig
from attnlab.models.seq2seq_heads import t5_or_bart
from attnlab.nn.positional import RotaryEmbedding

PathLike = Union[str, os.PathLike]
DEFAULT_OPSET = 17
MAX_EXAMPLE_LENGTH = 512  # the longest traced example of a model without a position table (T5)
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")  # the encoders'
SUPPORTED = ("BERT encoders (BertModel, BertForMaskedLM), decoder-only LMs (GPT2LMHeadModel, LlamaForCausalLM), "
             "the classification / question-answering heads on them (BertForSequenceClassification, ...), ViTs "
             "(ViTModel, ViTForImageClassification), T5 / BART (T5ForConditionalGeneration, "
             "BartForConditionalGeneration: teacher-forced logits; their task heads: the head's logits) and "
             "Seq2SeqTransformer (teacher-forced logits)")


class _Exportable(nn.Module):
    """An encoder or a task head: positional tensors in (passed by their names), a tuple of tensors out: what the
    tracer records."""

    def __init__(self, model: nn.Module, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> None:
        super().__init__()
        self.model, self.inputs, self.outputs = model, inputs, outputs

    def forward(self, *tensors: Tensor) -> tuple[Tensor, ...]:
        out = self.model(**dict(zip(self.inputs, tensors)))
        return tuple(getattr(out, name) for name in self.outputs)


class _DecoderWithCache(nn.Module):
    """``(input_ids, attention_mask, k_0, v_0, …, k_{L-1}, v_{L-1}) -> (logits, k'_0, v'_0, …)``: each layer's
    past fills a fresh growing :class:`KVCache`, the model's forward appends the new keys and values,
    ``k'_i = [k_i; k_new]``."""

    def __init__(self, model: DecoderOnlyLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, attention_mask: Tensor, *past: Tensor) -> tuple[Tensor, ...]:
        caches = self.model.new_cache()
        for i, cache in enumerate(caches):
            cache.self_attn.update(past[2 * i], past[2 * i + 1])
        logits = self.model(input_ids, attention_mask=attention_mask, past_key_values=caches).logits
        return (logits, *(t for cache in caches for t in cache.self_attn.stored()))


class _Seq2SeqLogits(nn.Module):
    """A :class:`~attnlab.models.transformer.Seq2SeqTransformer`: teacher-forced ``logits`` of ``decoder_input_ids``
    over ``input_ids`` (``attention_mask``: 1 = source token, 0 = padding)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, attention_mask: Tensor, decoder_input_ids: Tensor) -> tuple[Tensor]:
        return (self.model(input_ids, decoder_input_ids, src_key_padding_mask=attention_mask == 0),)


def _seq2seq(model: nn.Module) -> bool:
    """A teacher-forced encoder–decoder graph: a Seq2SeqTransformer, or T5 / BART with the LM head."""
    from attnlab.models.transformer import Seq2SeqTransformer

    return isinstance(model, Seq2SeqTransformer) or t5_or_bart(model) and not _task_head(model)


def _cache_names(prefix: str, num_layers: int) -> list[str]:
    return [f"{prefix}.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]


def _task_head(model: nn.Module) -> bool:
    """A classification / question-answering head on a BERT encoder, a decoder-only LM, T5 or BART
    (``config.num_labels``)."""
    return isinstance(model, nn.Module) and hasattr(getattr(model, "config", None), "num_labels") and (
        isinstance(getattr(model, "bert", None), BertModel) or isinstance(model, DecoderOnlyLM)
        or t5_or_bart(model))


def _vit(model: nn.Module) -> bool:
    from attnlab.models.vit import ViTForImageClassification, ViTModel

    return isinstance(model, (ViTModel, ViTForImageClassification))


def input_names(model: nn.Module) -> tuple[str, ...]:
    """The graph inputs :func:`export_onnx` writes for ``model`` (see the module docstring)."""
    if _vit(model):
        return ("pixel_values",)
    if _seq2seq(model):
        return ("input_ids", "attention_mask", "decoder_input_ids")
    if isinstance(model, DecoderOnlyLM) or t5_or_bart(model):
        if _task_head(model):
            return ("input_ids", "attention_mask")
        return ("input_ids", "attention_mask", *_cache_names("past_key_values", len(model.layers)))
    output_names(model)  # raises for what is not supported
    return INPUT_NAMES


def output_names(model: nn.Module) -> tuple[str, ...]:
    """The graph outputs :func:`export_onnx` writes for ``model``."""
    if _seq2seq(model):
        return ("logits",)
    if _vit(model):
        if hasattr(model, "classifier"):
            return ("logits",)
        return ("last_hidden_state",) + (("pooler_output",) if model.pooler is not None else ())
    if _task_head(model):
        qa = type(model).hf_architecture.endswith("ForQuestionAnswering")
        return ("start_logits", "end_logits") if qa else ("logits",)
    if isinstance(model, DecoderOnlyLM):
        return ("logits", *_cache_names("present", len(model.layers)))
    if isinstance(model, BertForMaskedLM):
        return ("logits",)
    if isinstance(model, BertModel):
        return ("last_hidden_state",) + (("pooler_output",) if model.pooler is not None else ())
    raise TypeError(f"export_onnx exports {SUPPORTED}, got {type(model).__name__}")


def _positions(model: nn.Module) -> int:
    """The most positions the model's tables hold (the ``example_length`` bound)."""
    if isinstance(model, DecoderOnlyLM):
        return getattr(model.config, model.positions_field)
    if isinstance(getattr(model, "config", None), TransformerConfig):
        return model.config.max_positions
    # T5's relative positions have no table: any length runs
    return getattr(model.config, "max_position_embeddings", MAX_EXAMPLE_LENGTH)


def _encoder_example(model: nn.Module, length: int) -> tuple[tuple[Tensor, ...], dict]:
    """A padded example batch and the dynamic axes (``batch``, ``sequence``) of an encoder or task-head graph."""
    ids = torch.randint(1, model.config.vocab_size, (2, length))
    mask = torch.ones_like(ids)
    mask[1, length // 2:] = 0  # a padded row, so the mask is traced as data, not folded away
    names = input_names(model)
    dynamic = {name: {0: "batch", 1: "sequence"} for name in names}
    per_sequence = _task_head(model) and getattr(model, "hf_architecture", "").endswith("ForSequenceClassification")
    dynamic.update({name: {0: "batch"} if name == "pooler_output" or per_sequence else {0: "batch", 1: "sequence"}
                    for name in output_names(model)})
    return (ids, mask, torch.zeros_like(ids))[:len(names)], dynamic


def _encoder_decoder_example(model: nn.Module, length: int) -> tuple[tuple[Tensor, ...], dict]:
    """A T5 / BART task head's padded example: ids other than its special ones and one ``eos_token_id`` ending
    each row's tokens (what the sequence heads pool; every row needs the same count of it)."""
    c = model.config
    ids = torch.randint(max(c.pad_token_id, c.eos_token_id) + 1, c.vocab_size, (2, length))
    mask = torch.ones_like(ids)
    mask[1, length // 2:] = 0
    ids[1, length // 2:] = c.pad_token_id
    ids[0, -1] = ids[1, length // 2 - 1] = c.eos_token_id
    (_, _), dynamic = _encoder_example(model, length)
    return (ids, mask), dynamic


def _seq2seq_example(model: nn.Module, length: int) -> tuple[tuple[Tensor, ...], dict]:
    """A padded source batch and a target one token shorter (the two lengths are separate dynamic axes)."""
    c = model.config
    src_vocab, tgt_vocab = (c.src_vocab_size, c.tgt_vocab_size or c.src_vocab_size) \
        if isinstance(c, TransformerConfig) else (c.vocab_size, c.vocab_size)
    ids = torch.randint(1, src_vocab, (2, length))
    mask = torch.ones_like(ids)
    mask[1, length // 2:] = 0
    tgt = torch.randint(1, tgt_vocab, (2, length - 1))
    src, dec = {0: "batch", 1: "encoder_sequence"}, {0: "batch", 1: "decoder_sequence"}
    return (ids, mask, tgt), {"input_ids": src, "attention_mask": src, "decoder_input_ids": dec, "logits": dec}


def _decoder_example(model: DecoderOnlyLM, length: int) -> tuple[tuple[Tensor, ...], dict]:
    """``length`` tokens after one cached position, the second row left-padded; Optimum's axis names."""
    attn = model.layers[0].self_attn
    ids = torch.randint(1, model.config.vocab_size, (2, length))
    mask = torch.ones(2, 1 + length, dtype=torch.long)
    mask[1, :2] = 0  # padding: the mask is traced as data
    past = [torch.randn(2, attn.num_kv_heads, 1, attn.head_dim) for _ in range(2 * len(model.layers))]
    batch, seq, past_len, total = "batch_size", "sequence_length", "past_sequence_length", \
        "past_sequence_length + sequence_length"
    dynamic = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: total}, "logits": {0: batch, 1: seq}}
    dynamic.update({name: {0: batch, 2: past_len} for name in input_names(model)[2:]})
    dynamic.update({name: {0: batch, 2: total} for name in output_names(model)[1:]})
    return (ids, mask, *past), dynamic


def export_onnx(model: nn.Module, path: PathLike, *, opset: Optional[int] = None,
                example_length: Optional[int] = None) -> Path:
    """Write ``model`` as an ONNX file with dynamic batch and length axes (atomically).

    Args:
        model: one of :data:`SUPPORTED` (e.g. from ``attnlab.from_pretrained``); exported in eval
            mode, float32, on the CPU, from a copy (``model`` is left as it was). The graphs' inputs and outputs
            are in the module docstring (:func:`input_names`, :func:`output_names`).
        path: the ``.onnx`` file to write (its folder is created).
        opset: ONNX opset (default 17; at least 14, where SDPA's pieces are expressible).
        example_length: sequence length of the example input that is traced (any length works after;
            default 16, or the model's positions where it holds fewer).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        TypeError: ``model`` is not a supported encoder or decoder.
        ValueError: the model was quantised or packed for inference (export before that); ``opset`` outside
            [14, the exporter's newest],
            ``example_length`` outside ``[2, positions]`` (a decoder's example also holds one cached position), or
            ``path`` is a folder.
    """
    outputs = output_names(model)
    converted = sorted({type(m).__name__ for m in model.modules()
                        if type(m).__name__ in ("Int8Linear", "Int8Embedding", "Int4Linear", "Int4Embedding",
                                                "PackedLinear")})
    if converted:  # their kernels (int8 matmuls, oneDNN's packed weights) have no ONNX form here
        raise ValueError(f"export_onnx: the model holds {', '.join(converted)} layers (from quantize() or "
                         "optimize_for_inference()); export the float model first, then quantise the ONNX file "
                         "(onnxruntime.quantization.quantize_dynamic)")
    opset = DEFAULT_OPSET if opset is None else opset
    from torch.onnx._constants import ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET as newest  # the exporter's newest

    if not (is_int(opset) and 14 <= opset <= newest):
        raise ValueError(f"opset must be an int in [14, {newest}] (the exporter's range from SDPA's pieces up), "
                         f"got {opset!r}")
    decoder = isinstance(model, DecoderOnlyLM) and not _task_head(model)  # a graph with the KV cache
    if _vit(model):  # a fixed picture size: only the batch varies
        c = model.config
        example = (torch.randn(2, c.num_channels, c.image_size, c.image_size),)
        dynamic = {name: {0: "batch"} for name in input_names(model) + outputs}
    else:
        limit = _positions(model) - (1 if decoder else 0)
        if example_length is None:
            example_length = min(16, limit)
        if not (isinstance(example_length, int) and 2 <= example_length <= limit):
            raise ValueError(f"example_length must be an int in [2, {limit}], got {example_length!r}")
        make_example = (_decoder_example if decoder else _seq2seq_example if _seq2seq(model)
                        else _encoder_decoder_example if t5_or_bart(model) else _encoder_example)
        example, dynamic = make_example(model, example_length)
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"export_onnx: path {path} is a folder: give the .onnx file to write")
    traced = copy.deepcopy(model).eval().float().cpu()
    for m in traced.modules():
        if isinstance(m, MultiheadAttention):
            m.backend = "reference"  # softmax(QKᵀ/√d + mask)V as plain ops; the tracer cannot take SDPA's GQA flag
        if isinstance(m, RotaryEmbedding) and m.cached_positions < _positions(model):
            m._grow(_positions(model))  # the graph keeps the cos/sin table as a constant: make it cover every position
    wrapper = (_DecoderWithCache(traced) if decoder else _Seq2SeqLogits(traced) if _seq2seq(model)
               and not t5_or_bart(model) else _Exportable(traced, input_names(model), outputs))

    def write(tmp: str) -> None:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tracer warnings about Python bools from input checks
            torch.onnx.export(wrapper, example, tmp, input_names=list(input_names(model)), output_names=list(outputs),
                              dynamic_axes=dynamic, opset_version=opset, dynamo=False)

    atomic_write(path, write)
    return path


class OnnxDecoder:
    """A decoder-only model exported by :func:`export_onnx`, run by ONNX Runtime behind the decoder protocol of
    :mod:`attnlab.generation`: ``OnnxDecoder(path).generate(ids, attention_mask=mask, max_new_tokens=20)`` (greedy,
    sampling or beams, as :func:`attnlab.generation.generate`) decodes on the ONNX graph.

    Its cache is one :class:`~attnlab.modules.cache.KVCache` per layer holding the last call's ``present`` tensors,
    fed back as the next call's ``past_key_values`` (beam search reorders them as any cache). Each call copies the
    cache into ONNX Runtime and back; ``max_length`` (a static cache) changes nothing here.

    Args:
        path: the ``.onnx`` file.
        providers: ONNX Runtime execution providers (default ``["CPUExecutionProvider"]``).

    Raises:
        ImportError: onnxruntime is not installed (``pip install 'attnlab[export]'``).
        FileNotFoundError: no such file.
        ValueError: the file is not a decoder graph with the inputs of the module docstring.
    """

    max_positions = None  # the graph refuses positions beyond its table itself

    def __init__(self, path: PathLike, *, providers: Optional[Sequence[str]] = None) -> None:
        try:
            import onnxruntime as ort
        except ImportError as e:
            raise ImportError("OnnxDecoder needs onnxruntime: pip install 'attnlab[export]'") from e
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"OnnxDecoder: no such file {str(path)!r}")
        self.session = ort.InferenceSession(str(path), providers=list(providers or ["CPUExecutionProvider"]))
        inputs = self.session.get_inputs()
        names = [i.name for i in inputs]
        self.num_layers = (len(names) - 2) // 2
        expected = ["input_ids", "attention_mask", *_cache_names("past_key_values", self.num_layers)]
        if self.num_layers < 1 or names != expected:
            raise ValueError(f"{path} is not a decoder exported by export_onnx: its inputs are {names}, expected "
                             "input_ids, attention_mask, past_key_values.{i}.key / .value")
        _, self.num_kv_heads, _, self.head_dim = inputs[2].shape  # (batch, Hkv, past, head_dim)

    def new_cache(self, *, max_length: Optional[int] = None) -> list[KVCache]:
        """One empty growing cache per layer (``max_length`` is accepted for the protocol and ignored)."""
        return [KVCache() for _ in range(self.num_layers)]

    def __call__(self, input_ids: Tensor, *, attention_mask: Optional[Tensor] = None,
                 past_key_values: Optional[list[KVCache]] = None, use_cache: bool = False) -> CausalLMOutput:
        """Logits ``(B, T, V)`` of ``input_ids (B, T)`` after the cached prefix; ``past_key_values`` (from
        :meth:`new_cache` or an earlier call) is updated in place; ``attention_mask`` ``(B, past + T)`` or None."""
        caches = self.new_cache() if past_key_values is None else past_key_values
        B, T = input_ids.shape
        past = caches[0].length
        if attention_mask is None:
            attention_mask = torch.ones(B, past + T, dtype=torch.long)
        feed = {"input_ids": input_ids.long().cpu().numpy(), "attention_mask": attention_mask.long().cpu().numpy()}
        empty = torch.zeros(B, self.num_kv_heads, 0, self.head_dim)
        for i, cache in enumerate(caches):
            k, v = cache.stored() if cache.filled else (empty, empty)
            feed[f"past_key_values.{i}.key"] = k.contiguous().numpy()
            feed[f"past_key_values.{i}.value"] = v.contiguous().numpy()
        logits, *present = self.session.run(None, feed)
        for i, cache in enumerate(caches):
            cache.reset()
            cache.update(torch.from_numpy(present[2 * i]), torch.from_numpy(present[2 * i + 1]))
        return CausalLMOutput(torch.from_numpy(logits), caches if use_cache else None)

    def generate(self, input_ids: Tensor, **kwargs) -> Tensor:
        """:func:`attnlab.generation.generate` on this graph (same arguments)."""
        from attnlab.generation import generate
        return generate(self, input_ids, **kwargs)
