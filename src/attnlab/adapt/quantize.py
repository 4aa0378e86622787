"""Post-training int8 and int4 quantisation of linear and embedding layers, for CPU inference.

int8 weights are quantised symmetrically per output row (per channel)::

    s_i = max_j |W_ij| / 127,    Q_ij = round(W_ij / s_i) ∈ [-127, 127],    W ≈ diag(s) Q

Three modes:

- ``"int8"`` — dynamic quantisation (Jacob et al. 2018; ``torch.ao.quantization.quantize_dynamic``'s
  kernels): at run time the activations are quantised too, each row on its own scale (one row's outlier,
  NaN or inf never changes another row's result), the product is computed in int8 × int8 → int32 by fbgemm and
  rescaled: ``y ≈ s_x s_i (Q_x Q_iᵀ) + b``.
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
import warnings
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab import _choice, _native
from attnlab._checks import one_of

MODES = ("int8", "int8-weight", "int4")
FLOAT_DTYPES = {"int8": (torch.float32,), "int8-weight": (torch.float32, torch.bfloat16, torch.float16),
                "int4": (torch.float32, torch.bfloat16, torch.float16)}
GROUP_SIZE = 64  # int4's default columns per scale
MAX_GROUP = 32768  # int4's largest group (the kernel's int32 sums of a group stay exact)
INT4_BLOCK = 128  # int4 columns packed per 64 bytes (quantize_groups)


def quantize_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """``(Q int8 (out, in), s float32 (out,))`` with ``W ≈ diag(s) Q`` (symmetric, per row; zero rows get s = 1)."""
    w = w.detach().float()
    s = w.abs().amax(dim=1) / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, s


def check_group_size(group_size: int, in_features: Optional[int] = None, *, name: str = "group_size") -> None:
    """ValueError unless ``group_size`` is a multiple of 32 up to 32768 (the kernel's runs) dividing ``in_features``."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or not (
            0 < group_size <= MAX_GROUP and group_size % 32 == 0):
        raise ValueError(f"{name} must be a positive multiple of 32 up to {MAX_GROUP}, got {group_size!r}")
    if in_features is not None and in_features % group_size:
        raise ValueError(f"{name}={group_size} does not divide in_features={in_features}")


def quantize_groups(w: Tensor, group_size: int = GROUP_SIZE) -> tuple[Tensor, Tensor]:
    """int4 in groups (module docstring): ``(packed uint8 (out, ⌈in/128⌉·64), d float32 (out, in / G))`` with
    ``W[i, j] ≈ d[i, j // G] · Q[i, j]``, ``Q`` a two's-complement nibble; a group of zeros gets ``d = 1``.

    Packing, in blocks of 128 columns (64 bytes, 32 little-endian 16-bit lanes): nibble ``r`` of lane ``t`` (bits
    ``4r .. 4r + 3``) holds column ``32 r + t`` of the block, so the kernel gets four runs of 32 consecutive columns
    from a block by two shifts each. See :func:`dequantize_groups`."""
    w = w.detach().float()
    out, k = w.shape
    check_group_size(group_size, k)
    g = w.reshape(out, k // group_size, group_size)
    extreme = g.gather(-1, g.abs().argmax(dim=-1, keepdim=True))  # the signed value of largest magnitude
    d = extreme / -8.0
    d = torch.where(d != 0, d, torch.ones_like(d))
    q = (torch.round(g / d).clamp_(-8, 7).to(torch.int8) & 15).to(torch.uint8).reshape(out, k)  # two's complement
    blocks = -(-k // INT4_BLOCK)
    q = F.pad(q, (0, blocks * INT4_BLOCK - k)).reshape(out, blocks, 4, 32)  # (row, block, run r, lane t)
    low, high = q[:, :, 0] | (q[:, :, 1] << 4), q[:, :, 2] | (q[:, :, 3] << 4)  # a lane's two bytes
    packed = torch.stack([low, high], dim=-1)  # (row, block, lane, byte)
    return packed.reshape(out, blocks * INT4_BLOCK // 2).contiguous(), d.squeeze(-1).contiguous()


def dequantize_groups(packed: Tensor, scale: Tensor, in_features: int) -> Tensor:
    """The float32 ``(rows, in_features)`` that :func:`quantize_groups`'s ``(packed, d)`` stand for (in one call of
    attnlab's kernels where they serve, else in PyTorch's operations)."""
    if packed.device.type == "cpu" and _native.available():
        return _native.int4_dequantize(packed.contiguous(), scale.float().contiguous(), in_features)
    rows = packed.shape[0]
    p = packed.reshape(rows, -1, 32, 2)  # (row, block, lane, byte)
    q = torch.stack([p[..., 0] & 15, p[..., 0] >> 4, p[..., 1] & 15, p[..., 1] >> 4], dim=2)  # (row, block, run, lane)
    q = q.reshape(rows, -1)[:, :in_features].to(torch.int8)
    q = q - ((q & 8) << 1)  # the nibbles' two's complement: 8..15 -> -8..-1
    groups = scale.shape[-1]
    w = q.reshape(rows, groups, in_features // groups).float() * scale.float()[..., None]
    return w.reshape(rows, in_features)


class _NativeArgs(nn.Module):
    """What the quantised layers share: the arguments of attnlab's matvec, kept until the buffers change."""

    def __init__(self) -> None:
        super().__init__()
        self._native = None  # attnlab's matvec arguments, or False where it cannot run (_matvec_args)

    def _arguments(self) -> tuple:  # (W, scale, bias) as the op takes them
        raise NotImplementedError

    def _matvec_args(self):
        """The kernel's arguments where it can run (CPU, built), else False."""
        if self._native is None:
            args = self._arguments()
            self._native = args[0].device.type == "cpu" and _native.available() and args
        return self._native

    def _reset(self) -> None:
        self._native = None

    def _load_from_state_dict(self, *args, **kwargs):
        self._reset()
        super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, recurse=True):
        self._reset()
        return super()._apply(fn, recurse)


class Int8Linear(_NativeArgs):
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
                self._packed = torch.ops.quantized.linear_prepack(q, None)  # the bias is added after the row scales
        return self._packed

    def _arguments(self) -> tuple:
        return (self.weight_int8.contiguous(), self.weight_scale.float().contiguous(),
                None if self.bias is None else self.bias.float().contiguous())

    def own_rows(self) -> int:
        """The rows of ``x`` up to which attnlab's matvec computes the product: the ``decode_linear`` choice for this
        layer's mode and shape class (:mod:`attnlab._choice`: forced, probed or cached; by default
        :data:`attnlab._native.MAX_ROWS`)."""
        if getattr(self, "_rows", None) is None:
            self._rows = _choice.decode_rows(self.mode, self.in_features, self.out_features, _native.MAX_ROWS)[0]
        return self._rows

    def matvec_args(self, x: Tensor) -> Optional[tuple]:
        """``(Q, s, bias)`` for :func:`attnlab._native.matvec` where it serves ``x`` (few rows, on the CPU), else None."""
        if x.numel() <= self.own_rows() * self.in_features and x.device.type == "cpu":
            return self._matvec_args() or None
        return None

    def forward(self, x: Tensor) -> Tensor:
        args = self.matvec_args(x)
        if args is not None:  # a decoding step: attnlab's int8 matvec (module docstring)
            if x.dtype == torch.float32 and x.is_contiguous():
                return _native.matvec(x, *args)
            return _native.matvec(x.float().contiguous(), *args).to(x.dtype)
        return self.aten(x)

    def aten(self, x: Tensor) -> Tensor:
        """The product without attnlab's kernel: fbgemm's (``"int8"``) or ``aten._weight_int8pack_mm``'s."""
        if self.mode == "int8":
            return self._dynamic(x)
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(self.compute_dtype)  # (N, in)
        y = torch.ops.aten._weight_int8pack_mm(x2, self.weight_int8, self.weight_scale.to(self.compute_dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def _dynamic(self, x: Tensor) -> Tensor:
        """``"int8"`` on many rows: fbgemm's int8 product, each row of ``x`` rounded on a scale of its own. fbgemm
        takes one activation scale per call, so each row is divided by its largest magnitude ``r_i`` and two rows of
        1 and -1 fix the call's range at ``[-1, 1]``: ``y_i = r_i ((x_i / r_i) Wᵀ) + b``, a row's result independent
        of every other row. A row holding NaN or inf is computed in floating point, as the float layer computes it
        (its NaN or inf reaches its own outputs, no other row's)."""
        x2 = x.reshape(-1, self.in_features).float()
        r = x2.abs().amax(dim=1, keepdim=True)
        finite = torch.isfinite(r)
        r = torch.where(finite & (r > 0), r, torch.ones_like(r))
        unit = torch.where(finite, x2 / r, torch.zeros_like(x2))
        ends = torch.ones(2, self.in_features, device=x.device)
        ends[1] = -1.0
        y = torch.ops.quantized.linear_dynamic(torch.cat([unit, ends]), self._fbgemm(), True)[:-2].mul_(r)
        if self.bias is not None:
            y += self.bias
        if not finite.all():
            rows = ~finite.squeeze(1)
            y[rows] = F.linear(x2[rows], self.weight, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def _reset(self) -> None:
        self._packed = self._native = self._rows = None

    def extra_repr(self) -> str:
        extra = f", compute_dtype={self.compute_dtype}" if self.mode == "int8-weight" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode!r}{extra}"


class _Table(nn.Module):
    """What the quantised embedding tables share: the floating dtype of the rows they return, which follows the
    model's ``.to(dtype)`` / ``.double()`` / ``.half()`` as a float table's would."""

    out_dtype: torch.dtype

    def _apply(self, fn, recurse=True):
        self.out_dtype = fn(torch.empty(0, dtype=self.out_dtype)).dtype  # (the conversion, probed on nothing)
        return super()._apply(fn, recurse)


class Int8Embedding(_Table):
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


class Int4Linear(_NativeArgs):
    """A linear layer with int4 weights in groups: ``y ≈ x Ŵᵀ + b``, ``Ŵ[i, j] = d[i, j // G] Q[i, j]``.

    Buffers: ``weight_int4`` (packed nibbles, :func:`quantize_groups`), ``weight_scale (out, in / G)``, ``bias``.
    On the CPU with attnlab's kernels built, :func:`attnlab._native.matvec` multiplies the nibbles: a decoding step's
    rows in integers (x rounded to 16-bit integers per row, as int8's), many rows (a prompt) by panels of ``Ŵ``
    dequantised in cache. Elsewhere ``Ŵ`` is dequantised whole and multiplied in float32 (``F.linear``).
    """

    def __init__(self, weight_int4: Tensor, weight_scale: Tensor, bias: Optional[Tensor], in_features: int) -> None:
        super().__init__()
        self.register_buffer("weight_int4", weight_int4)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.in_features, self.out_features = in_features, weight_int4.shape[0]
        self.group_size = in_features // weight_scale.shape[1]

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group_size: int = GROUP_SIZE,
                    shared: Optional[tuple[Tensor, Tensor]] = None) -> "Int4Linear":
        """Quantise ``linear``; ``shared`` reuses an already quantised ``(packed, d)`` of the same weight (tied)."""
        packed, d = shared if shared is not None else quantize_groups(linear.weight, group_size)
        bias = None if linear.bias is None else linear.bias.detach().float()
        return cls(packed, d, bias, linear.in_features)

    @property
    def weight(self) -> Tensor:
        """The dequantised weight ``Ŵ`` (float32)."""
        return dequantize_groups(self.weight_int4, self.weight_scale, self.in_features)

    def _arguments(self) -> tuple:
        return (self.weight_int4.contiguous(), self.weight_scale.float().contiguous(),
                None if self.bias is None else self.bias.float().contiguous())

    def matvec_args(self, x: Tensor) -> Optional[tuple]:
        """``(packed, d, bias)`` for :func:`attnlab._native.matvec` where its integer kernel serves ``x`` (≤
        :data:`attnlab._native.INT4_ROWS` rows on the CPU: a decoding step's batch, which the fused decoder step then
        takes whole, faster than the panels there), else None."""
        if x.numel() <= _native.INT4_ROWS * self.in_features and x.device.type == "cpu":
            return self._matvec_args() or None
        return None

    def forward(self, x: Tensor) -> Tensor:
        args = self._matvec_args() if x.device.type == "cpu" else None
        if args:
            if x.dtype == torch.float32 and x.is_contiguous():
                return _native.matvec(x, *args)
            return _native.matvec(x.float().contiguous(), *args).to(x.dtype)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight, bias).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


class Int4Embedding(_Table):
    """An embedding table stored as int4 groups (:func:`quantize_groups`), each looked-up row dequantised."""

    def __init__(self, weight_int4: Tensor, weight_scale: Tensor, embedding_dim: int, *,
                 out_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.register_buffer("weight_int4", weight_int4)
        self.register_buffer("weight_scale", weight_scale)
        self.num_embeddings, self.embedding_dim = weight_int4.shape[0], embedding_dim
        self.out_dtype = out_dtype

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group_size: int = GROUP_SIZE) -> "Int4Embedding":
        packed, d = quantize_groups(emb.weight, group_size)
        return cls(packed, d, emb.embedding_dim, out_dtype=emb.weight.dtype)

    @property
    def weight(self) -> Tensor:
        """The dequantised table."""
        return dequantize_groups(self.weight_int4, self.weight_scale, self.embedding_dim).to(self.out_dtype)

    def forward(self, ids: Tensor) -> Tensor:
        flat = ids.reshape(-1)
        rows = dequantize_groups(F.embedding(flat, self.weight_int4), F.embedding(flat, self.weight_scale),
                                 self.embedding_dim)
        return rows.reshape(*ids.shape, self.embedding_dim).to(self.out_dtype)

    def extra_repr(self) -> str:
        group = self.embedding_dim // self.weight_scale.shape[1]
        return f"{self.num_embeddings}, {self.embedding_dim}, group_size={group}"


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
        ValueError: unknown ``mode``; a layer of an unsupported dtype (named); a model not on the CPU;
            LoRA layers or a packed inference layout present; a weight or bias holding NaN or inf (named); a
            ``compute_dtype`` other than float32/bfloat16/float16;
            a bad ``group_size``; for ``"int4"``, a layer whose input width is not a multiple of 32 (named: exclude it).
    """
    from attnlab.adapt.lora import LoRALinear
    from attnlab.nn.inference import PackedLinear

    one_of("mode", mode, MODES)
    check_group_size(group_size)
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
    """Time the ``decode_linear`` candidates (:mod:`attnlab._choice`) once per mode and shape class of the model's
    :class:`Int8Linear` layers not yet known: ``own`` (attnlab's int8 matvec) against ``aten``
    (:meth:`Int8Linear.aten`), each against the float formula of the dequantised weight."""
    for m in model.modules():
        if isinstance(m, Int8Linear) and _choice.needs_probe(m.mode, m.in_features, m.out_features) \
                and m._matvec_args():
            _choice.probe_decode(m.mode, m.weight, m.bias, {
                "own": lambda x, m=m: _native.matvec(x, *m._matvec_args()), "aten": m.aten})


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
