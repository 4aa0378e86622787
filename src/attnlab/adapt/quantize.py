"""Post-training int8 and int4 quantisation of linear and embedding layers, for CPU inference.

int8 weights are quantised symmetrically per output row (per channel)::

    s_i = max_j |W_ij| / 127,    Q_ij = round(W_ij / s_i) ∈ [-127, 127],    W ≈ diag(s) Q

Three modes:

- ``"int8"`` — dynamic quantisation (Jacob et al. 2018; ``torch.ao.quantization.quantize_dynamic``'s
  kernels): at run time the activations are quantised too, each row on its own scale (one row's outlier,
  NaN or inf never changes another row's result), the product is computed in int8 × int8 → int32 by fbgemm or
  ``torch._int_mm`` (the ``int8_linear`` choice of :mod:`attnlab._choice`) and rescaled: ``y ≈ s_x s_i (Q_x Q_iᵀ)
  + b``.
- ``"int8-weight"`` — weight-only: activations stay floating point and the kernel
  (``aten._weight_int8pack_mm``) dequantises the weight on the fly: ``y = (x Qᵀ) ⊙ s + b``, computed in
  ``compute_dtype`` (bfloat16 by default: the fast CPU kernel; float32 is exact but slow). Decoding one
  token reads every weight once, so 1-byte weights cut the memory traffic 4× against float32.
- ``"int4"`` — weight-only, 4 bits a weight in groups of ``G`` columns of a row (llama.cpp's Q4_0 rule: the
  group's largest-magnitude value ``m`` maps to -8 exactly, so all 16 levels are used)::

      d_ig = m_ig / -8,    Q_ij = clamp(round(W_ij / d_ig), -8, 7),    W_ij ≈ d_ig Q_ij,   g = j // G

  stored as two's-complement nibbles, four to a 16-bit lane (:func:`quantize_groups`: 4 + 32 / G bits a
  weight, 0.56 bytes at G = 64 against int8's 1). Rows are stored in blocks of 128 columns: a width that is not
  a multiple of 128 pads its last block (a width of 32 takes as many bytes as 128), so int4 pays on wide layers.

A few rows at a time (a decoding step: for int8 up to :meth:`Int8Linear.own_rows`, 64 for int4), on a CPU
where attnlab's native kernel is built, every mode runs it: each row of ``x`` is rounded to 16-bit integers
(``x ≈ s_x Q_x``, ``s_x = max|x| / 32767``, finer than the int8 modes' own rounding of the activations) and the
products are summed in integers, reading the quantised weight once at memory speed
(:func:`attnlab._native.matvec`): ``y = s_x s_i (Q_x Q_iᵀ) + b``, and for int4 each group's sum scaled by its
``d``. More rows of an int4 layer (a prompt) multiply panels of its dequantised weight in float32.

Embeddings are stored the same way (int8 rows + a scale per row; int4 groups) and dequantised row by row on
lookup; an output head tied to the token embedding (GPT-2) shares its quantised matrix, so it is stored once.
Quantised layers keep ``.weight`` (dequantised on access) and ``.bias``, so code that reads them directly still
works. The result is for inference (no gradients).
"""
from __future__ import annotations

import copy
import fnmatch
from typing import Iterable, Optional

import torch
from torch import Tensor, nn

from attnlab import _choice, _native
from attnlab._checks import one_of
# the formats and layers, importable from here as before
from attnlab.adapt.quant_formats import (FLOAT_DTYPES, GROUP_SIZE, INT4_BLOCK, MAX_GROUP, MODES,  # noqa: F401
                                         Int4Embedding, Int4Linear, Int8Embedding, Int8Linear, check_group_size,
                                         dequantize_groups, int_mm_exact, quantize_groups, quantize_rows)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def quantize(model: nn.Module, mode: str, *, compute_dtype: Optional[torch.dtype] = None, embeddings: bool = True,
             exclude: Iterable[str] = (), inplace: bool = False, group_size: int = GROUP_SIZE) -> nn.Module:
    """Replace every ``nn.Linear`` (and ``nn.Embedding``) by an int8 or int4 one, for inference on CPU.

    Args:
        model: a float model on the CPU (float32 for ``"int8"``; float32/bfloat16/float16 for
            ``"int8-weight"`` and ``"int4"``). Merge LoRA layers first (:func:`attnlab.adapt.unload_lora`).
        mode: ``"int8"`` (dynamic: int8 weights and activations), ``"int8-weight"`` (weight-only) or ``"int4"``
            (weight-only, groups of ``group_size`` columns).
        compute_dtype: ``"int8-weight"``'s matmul dtype (default bfloat16; float32 is exact but slow).
        embeddings: also store embedding tables quantised (a head tied to one shares it).
        exclude: glob patterns of module names to keep in floating point (e.g. ``["lm_head"]``).
        inplace: modify ``model`` instead of a deep copy.
        group_size: ``"int4"``'s columns per scale, a multiple of 32 (default 64). A layer whose input width it
            does not divide takes the largest multiple of 32 below it that does.

    Returns:
        The quantised model, in eval mode.

    Raises:
        ValueError: unknown ``mode``; a model already quantised; a layer of an unsupported dtype (named); a model
            not on the CPU; LoRA layers or a packed inference layout present; a weight or bias holding NaN or inf
            (named); a ``compute_dtype`` other than float32/bfloat16/float16;
            a bad ``group_size``; for ``"int4"``, a layer whose input width is not a multiple of 32 (named: exclude it).
    """
    from attnlab.adapt.lora import LoRALinear
    from attnlab.nn.inference import PackedLinear

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    one_of("mode", mode, MODES)
    check_group_size(group_size)
    if compute_dtype not in (None, *FLOAT_DTYPES["int8-weight"]):
        raise ValueError(f"compute_dtype must be None or one of {FLOAT_DTYPES['int8-weight']}, got {compute_dtype!r}")
    packed = [n for n, m in model.named_modules() if isinstance(m, PackedLinear)]
    if packed:  # its float weights are packed for oneDNN: nothing would be quantised
        raise ValueError(f"{packed[0]!r} holds a packed inference layout (optimize_for_inference): quantise the "
                         "float model instead, before or instead of optimize_for_inference")
    if compute_dtype is None:
        compute_dtype = torch.bfloat16
    if mode == "int8-weight" and compute_dtype not in FLOAT_DTYPES["int8-weight"]:
        raise ValueError(f"compute_dtype must be one of {FLOAT_DTYPES['int8-weight']}, got {compute_dtype!r}")
    exclude = [exclude] if isinstance(exclude, str) else exclude
    if not isinstance(exclude, (list, tuple, set)) or not all(isinstance(p, str) for p in exclude):
        raise TypeError(f"exclude must be a glob pattern or a list of them (str), got {exclude!r}")
    done = next((n for n, m in model.named_modules()
                 if isinstance(m, (Int8Linear, Int8Embedding, Int4Linear, Int4Embedding))), None)
    if done is not None:  # its float layers are gone: a second mode would leave these as they are, silently
        raise ValueError(f"model is already quantised ({done!r} is an {type(model.get_submodule(done)).__name__}): "
                         "quantise the float model, once, in the mode wanted")
    targets = {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding, LoRALinear))
               and not any(fnmatch.fnmatchcase(n, p) for p in exclude)}
    groups: dict[str, int] = {}  # int4: each layer's group size
    for name, m in targets.items():
        if isinstance(m, LoRALinear):
            raise ValueError(f"{name!r} is a LoRA layer: merge it into the base first (attnlab.adapt.unload_lora)")
        if m.weight.device.type != "cpu":
            raise ValueError(f"quantize runs on the CPU; {name!r} is on {m.weight.device}")
        if m.weight.dtype not in FLOAT_DTYPES[mode]:
            raise ValueError(f"mode {mode!r} cannot quantise {name!r} of dtype {m.weight.dtype}; supported: "
                             f"{[str(d).removeprefix('torch.') for d in FLOAT_DTYPES[mode]]}")
        bad = [f"{name}.{p}" for p, t in m.named_parameters(recurse=False) if not torch.isfinite(t).all()]
        if bad:  # a NaN or inf has no integer level: it would turn into a finite number, silently
            raise ValueError(f"{bad[0]!r} holds NaN or inf values, which int8/int4 levels cannot represent: "
                             "quantise a model with finite weights")
        if mode == "int4" and (embeddings or isinstance(m, nn.Linear)):
            groups[name] = _group_for(name, m.weight.shape[1], group_size)
    if not inplace:
        model = copy.deepcopy(model)
    modules = dict(model.named_modules())
    shared: dict[int, tuple[Tensor, Tensor]] = {}  # id(float weight) -> its quantised form, for tied layers
    if embeddings:
        for name in targets:
            emb = modules[name]
            if isinstance(emb, nn.Embedding):
                if mode == "int4":
                    new = Int4Embedding.from_embedding(emb, groups[name])
                    shared[id(emb.weight)] = (new.weight_int4, new.weight_scale)
                else:
                    new = Int8Embedding.from_embedding(emb)
                    shared[id(emb.weight)] = (new.weight_int8, new.weight_scale)
                _replace(model, name, new)
    for name in targets:
        lin = modules[name]
        if isinstance(lin, nn.Linear):
            tied = shared.get(id(lin.weight))
            new = (Int4Linear.from_linear(lin, group_size=groups[name], shared=tied) if mode == "int4" else
                   Int8Linear.from_linear(lin, mode=mode, compute_dtype=compute_dtype, shared=tied))
            _replace(model, name, new)
    _probe_int8(model)
    return model.eval()


def _probe_int8(model: nn.Module) -> None:
    """Time the kernel candidates (:mod:`attnlab._choice`) once per mode and shape class of the model's
    :class:`Int8Linear` layers not yet known, each against the float formula of the dequantised weight: first
    (the process's probe budget goes to a decoding step first) ``decode_linear``, ``own`` (attnlab's int8 matvec)
    against ``aten`` (:meth:`Int8Linear.aten`); then, for an ``"int8"`` layer where :func:`int_mm_exact` holds,
    ``int8_linear``, ``fbgemm`` against ``int_mm`` (:meth:`Int8Linear._dynamic`)."""
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    for m in layers:
        if _choice.needs_probe(m.mode, m.in_features, m.out_features) and m._matvec_args():
            _choice.probe_decode(m.mode, m.weight, m.bias, {
                "own": lambda x, m=m: _native.matvec(x, *m._matvec_args()), "aten": m.aten})
    for m in layers:
        if m.mode == "int8" and int_mm_exact() and _choice.needs_probe(m.mode, m.in_features, m.out_features,
                                                                       family="int8_linear"):
            _choice.probe_batch(m.mode, m.weight, m.bias, {c: lambda x, m=m, c=c: m._dynamic(x, c)
                                                           for c in _choice.FAMILIES["int8_linear"]},
                                family="int8_linear")
            m._kernel = None  # (``aten`` above ran the default: the layer reads the choice made now)


def _group_for(name: str, width: int, group_size: int) -> int:
    """The largest multiple of 32 up to ``group_size`` that divides ``width``, or a ValueError naming the layer."""
    for g in range(group_size, 31, -32):
        if width % g == 0:
            return g
    raise ValueError(f"int4 quantises groups of 32 or more columns: {name!r} has {width} inputs, not a multiple of "
                     f"32; keep it in floating point with exclude=[{name!r}], or quantise to int8")


def state_dict_bytes(model: nn.Module) -> int:
    """Bytes of the model's state dict, each storage counted once (tied tensors are stored once)."""
    seen, total = set(), 0
    for t in model.state_dict().values():
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total
