"""Post-training int8 quantisation of linear and embedding layers, for CPU inference.

Weights are quantised symmetrically per output row (per channel)::

    s_i = max_j |W_ij| / 127,    Q_ij = round(W_ij / s_i) ∈ [-127, 127],    W ≈ diag(s) Q

Two modes:

- ``"int8"`` — dynamic quantisation (Jacob et al. 2018; ``torch.ao.quantization.quantize_dynamic``'s
  kernels): at run time the activations are quantised too (one affine scale per call), the product
  is computed in int8 × int8 → int32 by fbgemm and rescaled: ``y ≈ s_x s_i (Q_x Q_iᵀ) + b``.
- ``"int8-weight"`` — weight-only: activations stay floating point and the kernel
  (``aten._weight_int8pack_mm``) dequantises the weight on the fly: ``y = (x Qᵀ) ⊙ s + b``, computed in
  ``compute_dtype`` (bfloat16 by default: the fast CPU kernel; float32 is exact but slow). Decoding one
  token reads every weight once, so 1-byte weights cut the memory traffic 4× against float32.

A few rows at a time (a decoding step: at most :data:`attnlab._native.MAX_ROWS`), on a CPU where attnlab's
native kernel is built, both modes run it instead: each row of ``x`` is rounded to 16-bit integers
(``x ≈ s_x Q_x``, ``s_x = max|x| / 32767``, finer than either mode's own rounding of the activations) and
``y = s_x s_i (Q_x Q_iᵀ) + b`` is summed in integers, reading the int8 weight once at memory speed
(:func:`attnlab._native.matvec`).

Embeddings are stored the same way (int8 rows + a scale per row) and dequantised row by row on
lookup; an output head tied to the token embedding (GPT-2) shares its int8 matrix, so it is
stored once. Quantised layers keep ``.weight`` (dequantised on access) and ``.bias``, so code that
reads them directly still works. The result is for inference (no gradients).
"""
from __future__ import annotations

import copy
import fnmatch
import warnings
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab import _native
from attnlab._checks import one_of

MODES = ("int8", "int8-weight")
FLOAT_DTYPES = {"int8": (torch.float32,), "int8-weight": (torch.float32, torch.bfloat16, torch.float16)}


def quantize_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """``(Q int8 (out, in), s float32 (out,))`` with ``W ≈ diag(s) Q`` (symmetric, per row; zero rows get s = 1)."""
    w = w.detach().float()
    s = w.abs().amax(dim=1) / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, s


class Int8Linear(nn.Module):
    """A linear layer with int8 weights: ``y ≈ x (diag(s) Q)ᵀ + b`` (see the module docstring).

    Build with :meth:`from_linear`. Buffers: ``weight_int8 (out, in)``, ``weight_scale (out,)``, ``bias``.
    """

    def __init__(self, weight_int8: Tensor, weight_scale: Tensor, bias: Optional[Tensor], *, mode: str,
                 compute_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        one_of("mode", mode, MODES)
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.mode, self.compute_dtype = mode, compute_dtype
        self.in_features, self.out_features = weight_int8.shape[1], weight_int8.shape[0]
        self._packed = None  # fbgemm's packed weight ("int8" mode), built on first use
        self._native = None  # attnlab's matvec arguments, or False where it cannot run (_matvec_args)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, mode: str, compute_dtype: torch.dtype = torch.bfloat16,
                    shared: Optional[tuple[Tensor, Tensor]] = None) -> "Int8Linear":
        """Quantise ``linear``; ``shared`` reuses an already quantised ``(Q, s)`` of the same weight (tied)."""
        q, s = shared if shared is not None else quantize_rows(linear.weight)
        bias = None if linear.bias is None else linear.bias.detach().float()
        return cls(q, s, bias, mode=mode, compute_dtype=compute_dtype)

    @property
    def weight(self) -> Tensor:
        """The dequantised weight ``diag(s) Q`` (float32)."""
        return self.weight_int8.float() * self.weight_scale[:, None]

    def _fbgemm(self):
        if self._packed is None:
            with warnings.catch_warnings():  # torch marks quantized-tensor creation deprecated (torchao's successor)
                warnings.simplefilter("ignore", UserWarning)
                q = torch._make_per_channel_quantized_tensor(
                    self.weight_int8, self.weight_scale.double(),
                    torch.zeros(self.out_features, dtype=torch.long), 0)
                self._packed = torch.ops.quantized.linear_prepack(q, self.bias)
        return self._packed

    def _matvec_args(self):
        """``(Q, s, float32 bias)`` for attnlab's matvec where it can run (CPU, built), else False; kept until the
        buffers change (``_apply``, ``load_state_dict``)."""
        if self._native is None:
            ok = self.weight_int8.device.type == "cpu" and _native.available()
            self._native = ok and (self.weight_int8.contiguous(), self.weight_scale.float().contiguous(),
                                   None if self.bias is None else self.bias.float().contiguous())
        return self._native

    def matvec_args(self, x: Tensor) -> Optional[tuple]:
        """``(Q, s, bias)`` for :func:`attnlab._native.matvec` where it serves ``x`` (few rows, on the CPU), else None."""
        if x.numel() <= _native.MAX_ROWS * self.in_features and x.device.type == "cpu":
            return self._matvec_args() or None
        return None

    def forward(self, x: Tensor) -> Tensor:
        args = self.matvec_args(x)
        if args is not None:  # a decoding step: attnlab's int8 matvec (module docstring)
            if x.dtype == torch.float32 and x.is_contiguous():
                return _native.matvec(x, *args)
            return _native.matvec(x.float().contiguous(), *args).to(x.dtype)
        if self.mode == "int8":
            return torch.ops.quantized.linear_dynamic(x.float(), self._fbgemm(), True).to(x.dtype)
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(self.compute_dtype)  # (N, in)
        y = torch.ops.aten._weight_int8pack_mm(x2, self.weight_int8, self.weight_scale.to(self.compute_dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def _load_from_state_dict(self, *args, **kwargs):
        self._packed = self._native = None
        super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, recurse=True):
        self._packed = self._native = None
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        extra = f", compute_dtype={self.compute_dtype}" if self.mode == "int8-weight" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode!r}{extra}"


class Int8Embedding(nn.Module):
    """An embedding table stored as int8 rows and a scale per row: ``E[i] ≈ s_i Q_i``."""

    def __init__(self, weight_int8: Tensor, weight_scale: Tensor, *, out_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("weight_scale", weight_scale)
        self.num_embeddings, self.embedding_dim = weight_int8.shape
        self.out_dtype = out_dtype

    @classmethod
    def from_embedding(cls, emb: nn.Embedding) -> "Int8Embedding":
        q, s = quantize_rows(emb.weight)
        return cls(q, s, out_dtype=emb.weight.dtype)

    @property
    def weight(self) -> Tensor:
        """The dequantised table ``diag(s) Q``."""
        return (self.weight_int8.float() * self.weight_scale[:, None]).to(self.out_dtype)

    def forward(self, ids: Tensor) -> Tensor:
        rows = F.embedding(ids, self.weight_int8)  # (..., E) int8
        return (rows.float() * F.embedding(ids, self.weight_scale[:, None])).to(self.out_dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def quantize(model: nn.Module, mode: str, *, compute_dtype: Optional[torch.dtype] = None, embeddings: bool = True,
             exclude: Iterable[str] = (), inplace: bool = False) -> nn.Module:
    """Replace every ``nn.Linear`` (and ``nn.Embedding``) by an int8 one, for inference on CPU.

    Args:
        model: a float model on the CPU (float32 for ``"int8"``; float32/bfloat16/float16 for
            ``"int8-weight"``). Merge LoRA layers first (:func:`attnlab.adapt.unload_lora`).
        mode: ``"int8"`` (dynamic: int8 weights and activations) or ``"int8-weight"`` (weight-only).
        compute_dtype: ``"int8-weight"``'s matmul dtype (default bfloat16; float32 is exact but slow).
        embeddings: also store embedding tables in int8 (a head tied to one shares it).
        exclude: glob patterns of module names to keep in floating point (e.g. ``["lm_head"]``).
        inplace: modify ``model`` instead of a deep copy.

    Returns:
        The quantised model, in eval mode.

    Raises:
        ValueError: unknown ``mode``; a layer of an unsupported dtype (named); a model not on the CPU;
            LoRA layers or a packed inference layout present; a ``compute_dtype`` other than float32/bfloat16/float16.
    """
    from attnlab.adapt.lora import LoRALinear
    from attnlab.nn.inference import PackedLinear

    one_of("mode", mode, MODES)
    packed = [n for n, m in model.named_modules() if isinstance(m, PackedLinear)]
    if packed:  # its float weights are packed for oneDNN: nothing would be quantised
        raise ValueError(f"{packed[0]!r} holds a packed inference layout (optimize_for_inference): quantise the "
                         "float model instead, before or instead of optimize_for_inference")
    if compute_dtype is None:
        compute_dtype = torch.bfloat16
    if mode == "int8-weight" and compute_dtype not in FLOAT_DTYPES["int8-weight"]:
        raise ValueError(f"compute_dtype must be one of {FLOAT_DTYPES['int8-weight']}, got {compute_dtype!r}")
    exclude = [exclude] if isinstance(exclude, str) else list(exclude)
    targets = {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding, LoRALinear))
               and not any(fnmatch.fnmatchcase(n, p) for p in exclude)}
    for name, m in targets.items():
        if isinstance(m, LoRALinear):
            raise ValueError(f"{name!r} is a LoRA layer: merge it into the base first (attnlab.adapt.unload_lora)")
        if m.weight.device.type != "cpu":
            raise ValueError(f"quantize runs on the CPU; {name!r} is on {m.weight.device}")
        if m.weight.dtype not in FLOAT_DTYPES[mode]:
            raise ValueError(f"mode {mode!r} cannot quantise {name!r} of dtype {m.weight.dtype}; supported: "
                             f"{[str(d).removeprefix('torch.') for d in FLOAT_DTYPES[mode]]}")
    if not inplace:
        model = copy.deepcopy(model)
    modules = dict(model.named_modules())
    shared: dict[int, tuple[Tensor, Tensor]] = {}  # id(float weight) -> its (Q, s), for tied layers
    if embeddings:
        for name in targets:
            emb = modules[name]
            if isinstance(emb, nn.Embedding):
                new = Int8Embedding.from_embedding(emb)
                shared[id(emb.weight)] = (new.weight_int8, new.weight_scale)
                _replace(model, name, new)
    for name in targets:
        lin = modules[name]
        if isinstance(lin, nn.Linear):
            _replace(model, name, Int8Linear.from_linear(lin, mode=mode, compute_dtype=compute_dtype,
                                                         shared=shared.get(id(lin.weight))))
    return model.eval()


def state_dict_bytes(model: nn.Module) -> int:
    """Bytes of the model's state dict, each storage counted once (tied tensors are stored once)."""
    seen, total = set(), 0
    for t in model.state_dict().values():
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total
