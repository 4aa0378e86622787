"""The int8 and int4 weight formats and the layers that hold them (:mod:`attnlab.adapt.quantize` walks a model and
swaps its layers for these; its docstring states the formats and the modes).

- int8: :func:`quantize_rows` (symmetric, a scale per output row); :class:`Int8Linear` (modes ``"int8"`` and
  ``"int8-weight"``) and :class:`Int8Embedding`.
- int4: :func:`quantize_groups` / :func:`dequantize_groups` (groups of ``G`` columns, nibbles packed in blocks of 128
  columns); :class:`Int4Linear` and :class:`Int4Embedding`.
"""
from __future__ import annotations

import functools
import os
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab import _choice, _native, _native_train
from attnlab._checks import one_of, tensor
from attnlab._runtime import _cpu_flags

MODES = ("int8", "int8-weight", "int4")
FLOAT_DTYPES = {"int8": (torch.float32,), "int8-weight": (torch.float32, torch.bfloat16, torch.float16),
                "int4": (torch.float32, torch.bfloat16, torch.float16)}
GROUP_SIZE = 64  # int4's default columns per scale
MAX_GROUP = 32768  # int4's largest group (the kernel's int32 sums of a group stay exact)
INT4_BLOCK = 128  # int4 columns packed per 64 bytes (quantize_groups)
# the longest sum of int8 products at ±127 × ±127 an int32 holds exactly: int_mm sums longer rows in parts
INT8_INNER = (2 ** 31 - 1) // (127 * 127)


def int_mm_exact() -> bool:
    """Whether the ``int8_linear`` family (:mod:`attnlab._choice`) offers ``int_mm`` here: this torch has
    ``torch._int_mm``, attnlab's kernels are built (they round the rows and rescale the sums), and oneDNN may use
    a VNNI instruction (:func:`_onednn_vnni`). Without VNNI oneDNN adds ``u8 × s8`` pairs in 16 bits, which
    saturate where both operands reach ±127: the sums would not be exact."""
    return _onednn_vnni() and hasattr(torch, "_int_mm") and _native.available()


@functools.lru_cache(maxsize=None)
def _onednn_vnni() -> bool:
    """AVX512-VNNI or AVX-VNNI, and no ``ONEDNN_MAX_CPU_ISA`` / ``DNNL_MAX_CPU_ISA`` capping oneDNN to AVX2 or
    below (``csrc/int8_product.cpp``'s ``onednn_has_vnni``, the same rule)."""
    caps = {os.environ.get(name, "").strip().upper() for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}
    return bool({"avx512_vnni", "avx_vnni"} & _cpu_flags()) and not caps & {"SSE41", "AVX", "AVX2"}


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
    tensor("w", w, kind="floating", ndim=2, shape="(out, in)")
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

    def _refuse_training(self, x: Tensor) -> None:
        """A quantised layer is for inference: trained through (training mode, an input that needs a gradient), it
        would pass no gradient to the layers before it, silently; refused by name instead."""
        if self.training and x.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{type(self).__name__} is an inference layer (attnlab.adapt.quantize returns a model in "
                             "eval mode): training through it gives the layers before it no gradient; train the float "
                             "model (or LoRA on it) and quantise afterwards")

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

    def int8_kernel(self) -> str:
        """The ``int8_linear`` candidate (``"fbgemm"`` or ``"int_mm"``) that computes the ``"int8"`` product past
        :meth:`own_rows` rows: forced, probed or cached (:mod:`attnlab._choice`), by default ``"fbgemm"``; ``int_mm``
        only where :func:`int_mm_exact` holds (a cached ``int_mm`` elsewhere runs ``fbgemm``).

        Raises:
            ValueError: ``int_mm`` forced where :func:`int_mm_exact` does not hold.
        """
        if getattr(self, "_kernel", None) is None:
            cand, source = _choice.batch_kernel("int8", self.in_features, self.out_features, "fbgemm",
                                                family="int8_linear")
            if cand == "int_mm" and not int_mm_exact():
                if source == "forced":
                    raise ValueError("ATTNLAB_FORCE_INT8_LINEAR / ATTNLAB_KERNELS: int8_linear=int_mm needs "
                                     "torch._int_mm, attnlab's C++ kernels and a CPU with VNNI that oneDNN may use; "
                                     "here only 'fbgemm' runs")
                cand = "fbgemm"
            self._kernel = cand
        return self._kernel

    def matvec_args(self, x: Tensor) -> Optional[tuple]:
        """``(Q, s, bias)`` for :func:`attnlab._native.matvec` where it serves ``x`` (few rows, on the CPU), else None."""
        if x.numel() <= self.own_rows() * self.in_features and x.device.type == "cpu":
            return self._matvec_args() or None
        return None

    def forward(self, x: Tensor) -> Tensor:
        self._refuse_training(x)
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

    def _dynamic(self, x: Tensor, kernel: Optional[str] = None) -> Tensor:
        """``"int8"`` on many rows, each row of ``x`` rounded to int8 on a scale of its own (a row's result
        independent of every other row), by the ``int8_linear`` candidate ``kernel`` (None: :meth:`int8_kernel`):

        - ``"fbgemm"``: fbgemm's dynamic product. It takes one activation scale per call, so each row is divided by
          its largest magnitude ``r_i`` and two rows of 1 and -1 fix the call's range at ``[-1, 1]``:
          ``y_i = r_i ((x_i / r_i) Wᵀ) + b`` (fbgemm rounds to 128 levels of that range);
        - ``"int_mm"``: ``x_i ≈ s_i q_i``, ``s_i = max|x_i| / 127`` (:func:`attnlab._native_train.quantize_rows`),
          ``y = diag(s_x) (Q_x Qᵀ) diag(s) + b``: ``torch._int_mm``'s exact int32 sums rescaled in one pass
          (:func:`attnlab._native_train.int8_product`).

        A row holding NaN or inf is computed in floating point, as the float layer computes it (its NaN or inf
        reaches its own outputs, no other row's)."""
        x2 = x.reshape(-1, self.in_features).float().contiguous()
        if (kernel or self.int8_kernel()) == "int_mm" and self._matvec_args():
            qw, sw, bias = self._matvec_args()
            q, r = _native_train.quantize_rows(x2, 127)  # r: NaN on a row holding NaN or inf
            finite = ~r.isnan()
            y = _native_train.int8_product(q, qw.t(), r, sw, bias, max_inner=INT8_INNER)
        else:
            r = x2.abs().amax(dim=1, keepdim=True)
            finite = torch.isfinite(r)
            r = torch.where(finite & (r > 0), r, torch.ones_like(r))
            unit = torch.where(finite, x2 / r, torch.zeros_like(x2))
            ends = torch.ones(2, self.in_features, device=x.device)
            ends[1] = -1.0
            y = torch.ops.quantized.linear_dynamic(torch.cat([unit, ends]), self._fbgemm(), True)[:-2].mul_(r)
            if self.bias is not None:
                y += self.bias
            finite = finite.squeeze(1)
        if not finite.all():
            y[~finite] = F.linear(x2[~finite], self.weight, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def _reset(self) -> None:
        self._packed = self._native = self._rows = self._kernel = None

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
        self._refuse_training(x)
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
