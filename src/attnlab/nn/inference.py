"""Inference layouts for ``nn.Linear``: the weight stored the way the CPU matrix–vector kernels read fastest.

Decoding one token at batch 1 turns every ``y = x Wᵀ + b`` into a matrix–vector product that reads
each weight once, so its speed is the speed at which the kernel streams ``W`` from memory, and on
CPU that depends on the layout:

- MKL's fp32 GEMV (what ``F.linear`` calls at batch 1) runs on **one** thread; it streams a
  column-major ``W`` (``(in, out)`` in memory, Hugging Face GPT-2's ``Conv1D`` layout) up to 2×
  faster than ``nn.Linear``'s ``(out, in)`` rows when ``out >= in``.
- oneDNN's inner product on a weight **pre-packed** once into its blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight``) splits the product over all threads, with no
  per-call reorder; on many rows (an encoder's batch) its fp32 GEMM also beats MKL's on AVX-512
  CPUs. :class:`PackedLinear` holds that, in float32 or bfloat16 (half the bytes), and falls back
  to the column-major layout where oneDNN is missing. In bf16 only the weight is bf16: the input
  is rounded to bf16, the product accumulates in fp32 and the bf16 output is cast back, so norms,
  softmax, the residual stream and the KV cache keep fp32.

- attnlab's own matrix–vector kernel (:func:`attnlab._native.matvec`, C++) streams a plain row-major ``W``
  (float32, or bfloat16 widened in registers) over all threads at the speed of memory; where it is built
  (``make setup``) a layer packed for few rows (``rows`` ≤ :func:`native_rows`, a decoder's step: the rows up to
  which the kernel is faster, probed once per machine and shape class by :mod:`attnlab._choice`) keeps ``W``
  plain for it and multiplies more rows (a prompt's prefill) with oneDNN's inner product on
  the plain rows or ``F.linear``, whichever the ``batch_linear`` choice takes for the shape class (probed beside the
  decoding step's; ``F.linear`` without oneDNN). In bf16 its
  input and output stay float32 (only the weight is rounded), where the many-row bf16 product rounds them
  too: a decoding step's logits and a full forward's then agree to bf16 rounding, not float32's.

:class:`InferenceLayoutMixin` gives a model ``optimize_for_inference(dtype=...)``, which converts
every linear layer at once. Without that call, :func:`decode_view` gives the decoding loops
(:func:`attnlab.generation.generate`) the same kernels on the model's own float32 weights, without a copy.
"""
from __future__ import annotations

import weakref
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab import _choice, _native
from attnlab._checks import one_of, positive_int

INFERENCE_DTYPES = (torch.float32, torch.bfloat16)
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}  # the dtypes' names in attnlab._choice's classes
try:  # oneDNN's inner product on a packed weight (the overload itself: no per-call overload resolution)
    _ONEDNN_LINEAR = torch.ops.mkldnn._linear_pointwise.default if torch.backends.mkldnn.is_available() else None
except (AttributeError, RuntimeError):  # a build without the op
    _ONEDNN_LINEAR = None


def _packable(weight: Tensor) -> bool:
    """oneDNN's packed inner product: CPU builds with MKL-DNN (and, for bf16, a CPU that runs it)."""
    if weight.device.type != "cpu" or _ONEDNN_LINEAR is None or weight.dtype not in INFERENCE_DTYPES:
        return False
    return weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def native_rows(weight: Tensor) -> int:
    """How many rows of ``x`` attnlab's matrix–vector kernel multiplies by ``weight`` before ATen's product takes over
    (0: none): the ``decode_linear`` choice for the weight's shape class (:mod:`attnlab._choice`: forced, probed or
    cached; by default :func:`~attnlab._native.max_rows`), on the CPU where the kernel is built."""
    if weight.device.type != "cpu" or weight.dtype not in INFERENCE_DTYPES or not _native.available():
        return 0
    out_features, in_features = weight.shape
    return _choice.decode_rows(DTYPE_NAMES[weight.dtype], in_features, out_features,
                               _native.max_rows(weight.dtype))[0]


def batch_onednn(weight: Tensor) -> bool:
    """Whether oneDNN's inner product on the plain ``weight`` multiplies more rows than a decoding step's (else
    ``F.linear``): where oneDNN runs the weight's dtype, the ``batch_linear`` choice for its shape class
    (:mod:`attnlab._choice`: forced, probed or cached; by default oneDNN)."""
    if not _packable(weight):
        return False
    out_features, in_features = weight.shape
    return _choice.batch_kernel(DTYPE_NAMES[weight.dtype], in_features, out_features, "onednn")[0] == "onednn"


def _native_rows(weight: Tensor, rows: Optional[int]) -> bool:
    """attnlab's matrix–vector kernel serves a layer packed for a few rows on the CPU, where it is built and
    faster."""
    return rows is not None and rows <= native_rows(weight)


def probe_linears(module: nn.Module, *, dtype: torch.dtype, rows: Optional[int]) -> list[dict]:
    """Time the kernel candidates (:mod:`attnlab._choice`) once per shape class of ``module``'s ``nn.Linear``
    layers not yet known, on the first layer of each class in ``dtype``. ``decode_linear``: ``own`` (attnlab's matvec
    on the plain weight) against ``aten`` (the layer as :class:`PackedLinear` computes it without the kernel:
    oneDNN's packed weight, or ``F.linear``); then, for a class the matvec serves, ``batch_linear``: its products at
    more rows, ``onednn`` (oneDNN's inner product on the plain weight) against ``aten`` (``F.linear``). Nothing where
    ``rows`` (the packing's) is not a decoding step's or the kernel is not built. Returns the new entries."""
    if rows is None or rows > _choice.DECODE_ROWS or not _native.available():
        return []
    entries, name = [], DTYPE_NAMES[dtype]
    for m in module.modules():
        if not isinstance(m, nn.Linear) or m.weight.device.type != "cpu":
            continue
        shape = m.in_features, m.out_features
        decode, batch = _choice.needs_probe(name, *shape), _choice.needs_probe(name, *shape, family="batch_linear")
        if not (decode or batch):
            continue
        w = m.weight.detach().to(dtype).contiguous()
        bias = None if m.bias is None else m.bias.detach().to(dtype)
        bias32 = None if bias is None else bias.float()
        if decode:
            aten = PackedLinear(m, dtype=dtype)  # rows=None: never the kernel
            entries.append(_choice.probe_decode(name, w.float(), bias32, {
                "own": lambda x, w=w, b=bias32: _native.matvec(x, w, None, b), "aten": aten}))
        if batch and native_rows(w) >= 1 and _packable(w):  # the plain weight's many-row products
            entries.append(_choice.probe_batch(name, w.float(), bias32, {
                "onednn": lambda x, w=w, b=bias: _ONEDNN_LINEAR(x.to(dtype), w, b, "none", [], "").float(),
                "aten": lambda x, w=w, b=bias: F.linear(x.to(dtype), w, b).float()}))
    return entries


class PackedLinear(nn.Module):
    """``y = x Wᵀ + b`` with ``W`` pre-packed for oneDNN's inner product, in ``dtype`` (inference only).

    ``x`` keeps its dtype: with a bfloat16 ``W`` it is rounded to bf16 for the product (fp32
    accumulation) and ``y`` is cast back. Where oneDNN cannot run it (another device, a build
    without MKL-DNN) ``W`` is kept plain — column-major when ``out >= in`` — and ``F.linear``
    computes the same product.

    The state dict holds ``weight`` and ``bias`` as ordinary tensors (in ``dtype``), so
    ``state_dict`` and ``save_pretrained`` work as before; loading one repacks it. ``module.to(...)``,
    ``.double()``, ``.cuda()`` apply to the dense weight and bias, which are then repacked for where they
    end (oneDNN's packed layout only on a CPU, in float32 or bfloat16; plain otherwise).

    Args:
        linear: the layer to convert (its weights are copied; it is not modified).
        dtype: ``torch.float32`` or ``torch.bfloat16``.
        rows: the number of rows ``x`` will have (the product's M) the packing is tuned for:
            1 for a decode step, None for any (the layout still serves every M).
        pack: False keeps ``W`` plain (column-major when ``out >= in``), *sharing* the weight's storage when it
            already has that layout and dtype: a tied output layer then reads the embedding's table, one copy.

    Raises:
        TypeError: ``linear`` is not an ``nn.Linear``.
        ValueError: ``dtype`` is not one of :data:`INFERENCE_DTYPES`.
    """

    def __init__(self, linear: nn.Linear, *, dtype: torch.dtype = torch.float32, rows: Optional[int] = None,
                 pack: bool = True) -> None:
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        one_of("dtype", dtype, INFERENCE_DTYPES)
        positive_int("rows", rows, optional=True)
        self.in_features, self.out_features, self.dtype, self.rows = linear.in_features, linear.out_features, dtype, rows
        self.pack = bool(pack)
        self._pack(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())

    def _pack(self, weight: Tensor, bias: Optional[Tensor]) -> None:
        w = weight.to(self.dtype)  # (out, in); the same tensor when it already has the dtype
        self.bias_: Optional[Tensor] = None if bias is None else bias.to(self.dtype).contiguous()  # (out,)
        self.native = _native_rows(w, self.rows)
        self.max_rows = native_rows(w)  # x's rows the native kernel takes (a decoding step's batch)
        self.bias32 = None if bias is None or not self.native else self.bias_.float()  # the kernel's (rounded) bias
        self.packed = self.pack and not self.native and _packable(w)
        self.onednn = self.packed or (self.native and batch_onednn(w))  # many rows: oneDNN (on plain rows too)
        if self.native:  # plain rows for attnlab's matvec (F.linear for many rows): a copy, or shared without pack
            copied = w is not weight  # .to() made a new tensor already (another dtype)
            self.weight_ = w.contiguous() if not self.pack or copied else w.clone(memory_format=torch.contiguous_format)
        elif self.packed:  # oneDNN's opaque blocked tensor
            self.weight_ = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), self.rows)
        else:  # column-major (no copy when it already is) for MKL's GEMV, else rows
            self.weight_ = w.t().contiguous().t() if self.out_features >= self.in_features else w.contiguous()

    def _apply(self, fn, recurse: bool = True):
        """``fn`` (what ``.to``, ``.double``, ``.cuda`` apply to every tensor) on the dense weight and bias, then
        repacked: oneDNN's layout has no storage to move or cast. ``dtype`` becomes the weight's new dtype."""
        w = fn(self.weight)
        b = None if self.bias_ is None else fn(self.bias_)
        self.dtype = w.dtype
        self._pack(w, b)
        return self

    @property
    def weight(self) -> Tensor:
        """The dense ``(out, in)`` weight, in ``dtype`` (unpacked on each access)."""
        return self.weight_.to_dense() if self.packed else self.weight_

    @property
    def bias(self) -> Optional[Tensor]:
        return self.bias_

    def matvec_args(self, x: Tensor) -> Optional[tuple]:
        """``(w, scale, bias)`` for :func:`attnlab._native.matvec` where it serves ``x`` (few rows, this layer packed
        for them), else None: for a caller that fuses this product with another (``FeedForward``)."""
        if self.native and x.numel() <= self.max_rows * self.in_features:
            return self.weight_, None, self.bias32
        return None

    def forward(self, x: Tensor) -> Tensor:
        # lean on purpose: a decode step calls this ~50 times, so each avoidable op shows
        if x.shape[-1] != self.in_features:
            raise ValueError(f"PackedLinear expected last dim {self.in_features}, got shape {tuple(x.shape)}")
        args = self.matvec_args(x)
        if args is not None:  # a decoding step: (..., in) as it is
            if x.dtype == torch.float32 and x.is_contiguous():
                return _native.matvec(x, *args)
            return _native.matvec(x.float().contiguous(), *args).to(x.dtype)
        xw = x.reshape(-1, self.in_features)  # (N, in)
        if xw.dtype != self.dtype:
            xw = xw.to(self.dtype)
        if self.onednn:  # the packed weight, or the native layout's plain rows (reordered per call, still faster
            y = _ONEDNN_LINEAR(xw, self.weight_, self.bias_, "none", [], "")  # than MKL's GEMM for a prefill)
        else:
            y = F.linear(xw, self.weight_, self.bias_)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y.view(x.shape[:-1] + (self.out_features,))  # (..., out)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        destination[prefix + "weight"] = self.weight
        if self.bias_ is not None:
            destination[prefix + "bias"] = self.bias_

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        names = ["weight"] + ([] if self.bias_ is None else ["bias"])
        missing = [prefix + n for n in names if prefix + n not in state_dict]
        missing_keys.extend(missing)
        if missing:
            return
        w, b = state_dict[prefix + "weight"], state_dict.get(prefix + "bias")
        if tuple(w.shape) != (self.out_features, self.in_features):
            error_msgs.append(f"size mismatch for {prefix}weight: expected {(self.out_features, self.in_features)}, "
                              f"got {tuple(w.shape)}")
            return
        self._pack(w, b)

    def __getstate__(self) -> dict:
        """For ``copy.deepcopy`` and pickling: the dense weight (oneDNN's packed tensor has no storage)."""
        return {**self.__dict__, "weight_": self.weight}

    def __setstate__(self, state: dict) -> None:
        state.setdefault("pack", True)  # pickled before ``pack`` existed
        super().__setstate__(state)
        self._pack(self.weight_, self.bias_)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias_ is not None}, "
                f"dtype={self.dtype}, packed={self.packed}, native={self.native}, rows={self.rows}")


def optimize_linears_(module: nn.Module, *, dtype: torch.dtype = torch.float32, rows: Optional[int] = None,
                      share_tied: bool = True) -> nn.Module:
    """Replace every ``nn.Linear`` inside ``module`` by a :class:`PackedLinear` (``dtype``, ``rows``), in
    place; returns ``module``.

    A linear layer whose weight *is* an ``nn.Embedding``'s table (a tied LM head) keeps one copy with
    ``share_tied`` in float32 and reads the table in place: as it is (row-major) where attnlab's matvec serves
    the layer (``rows`` ≤ :func:`native_rows`, the kernel built: every thread), else stored column-major (MKL's GEMV
    streams that layout fastest; the embedding's lookups read it as well). Otherwise, and for other shared
    weights, each layer gets its own copy. With ``rows`` a decoding step's, the kernels are first probed once per
    shape class not yet known on this machine (:func:`probe_linears`).

    Raises:
        ValueError: ``dtype`` is not one of :data:`INFERENCE_DTYPES`.
    """
    one_of("dtype", dtype, INFERENCE_DTYPES)
    probe_linears(module, dtype=dtype, rows=rows)
    tables = {id(m.weight): m.weight for m in module.modules() if isinstance(m, nn.Embedding)}
    targets = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        table = tables.get(id(child.weight)) if share_tied and dtype == torch.float32 else None
        # attnlab's matvec reads the table's rows as they are; MKL's GEMV streams it column-major fastest
        if table is not None and table.dtype == dtype and not table.t().is_contiguous() \
                and not _native_rows(table, rows):
            with torch.no_grad():
                table.data = table.data.t().contiguous().t()  # column-major, same values: one copy, now
        setattr(parent, name, PackedLinear(child, dtype=dtype, rows=rows, pack=table is None))
    return module


class InferenceLayoutMixin:
    """Adds :meth:`optimize_for_inference` to an ``nn.Module`` model; ``packed_rows`` is the product
    size its packing is tuned for (1 for a decoder's one-token steps, None for an encoder's batches)."""

    packed_rows: Optional[int] = None

    def optimize_for_inference(self, *, dtype: Union[torch.dtype, str] = "auto", share_tied: bool = True):
        """Give every linear layer its fast inference layout, in place, and switch to eval; returns ``self``.

        Each ``nn.Linear`` becomes a :class:`PackedLinear`: for a decoder (``packed_rows`` = 1) its weight kept
        plain for attnlab's C++ matvec where that is built (the module docstring), else pre-packed for oneDNN,
        whose inner product uses every thread at batch 1 (MKL's GEMV, behind ``F.linear``, uses one) and whose
        fp32 GEMM is faster than MKL's on AVX-512 CPUs.

        - ``"auto"`` (default): bfloat16 where this machine computes it natively and faster, else
          float32 (:func:`attnlab._runtime.resolve_dtype`; ``attnlab env`` shows the choice).
        - ``float32``: the same products up to float32 summation order (≈1e-6 relative), the same
          state dict.
        - ``bfloat16``: bf16 weights (half the bytes to read); embeddings, norms, attention, the
          residual stream, the KV cache and the outputs stay float32 (weight-only bf16).

        Inference only: the packed layers have no trainable parameters. A tied output layer (GPT-2's head)
        shares the embedding's table in float32 (``share_tied``, :func:`optimize_linears_`): one copy of the
        ``V × E`` weights instead of two, multiplied on every thread by attnlab's matvec where it is built.
        Without it, MKL's GEMV on the shared table uses one thread (measured ~1.2 ms slower per token for GPT-2's
        154 MB head on a 2-core AVX2 machine) and ``share_tied=False`` gives the head a packed copy of its own,
        which oneDNN multiplies on every thread. Call it after loading weights.

        Raises:
            ValueError: ``dtype`` is not "auto", float32 or bfloat16.
        """
        if not isinstance(dtype, torch.dtype):
            from attnlab._runtime import check_dtype_name, resolve_dtype, torch_dtype

            if check_dtype_name(dtype) in ("auto", "fp32", "bf16"):
                device = next((p.device for p in self.parameters()), torch.device("cpu"))
                dtype = torch_dtype(resolve_dtype(dtype, device)[0])
        elif dtype == torch.bfloat16:
            from attnlab._runtime import resolve_dtype

            resolve_dtype("bf16", next((p.device for p in self.parameters()), torch.device("cpu")))  # warns if emulated
        optimize_linears_(self, dtype=dtype, rows=self.packed_rows, share_tied=share_tied)
        return self.eval()


_VIEWS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()  # model -> (key, view)


def decode_view(model: nn.Module) -> nn.Module:
    """``model`` as a decoding loop should run it: a decoder (``packed_rows`` = 1, :class:`InferenceLayoutMixin`) in
    eval mode whose float32 CPU linear layers attnlab's matvec serves (:func:`native_rows`: the kernels built, the
    ``decode_linear`` choice) gets a *view*: the same modules, except that each such ``nn.Linear`` is a
    :class:`PackedLinear` reading the layer's own weight and bias in place (``pack=False``; a decoding step then
    runs in one native call per layer, as after :meth:`~InferenceLayoutMixin.optimize_for_inference` in float32).
    Anything else — training mode, another dtype or device, a layer with hooks, no kernels, nothing to convert — is
    returned as it is.

    The view copies no weight: its memory is that of its module objects (a few hundred bytes each), held while the
    model lives. Its layers read the model's tensors, so a weight edited in place is seen at once; the view is kept
    per model under a key of every parameter's and buffer's identity, storage and version counter and every
    module's mode and hooks, and is built again when any of them changed (``load_state_dict``, an optimizer step,
    ``.to()``, ``train()``, a new hook). Results equal the model's own forward up to float32 summation order. The
    first view of a model probes the ``decode_linear`` kernels on its shapes (:func:`probe_linears`), once per
    machine (cached)."""
    if not isinstance(model, InferenceLayoutMixin) or model.packed_rows != 1 or model.training \
            or not _native.available():
        return model
    key = _view_key(model)
    held = _VIEWS.get(model)
    if held is not None and held[0] == key:
        return held[1]
    with torch.no_grad():
        probe_linears(model, dtype=torch.float32, rows=1)
        view = _viewed(model, {}) if any(_served(m) for m in model.modules()) else model
    _VIEWS[model] = (key, view)
    return view


def _view_key(model: nn.Module) -> tuple:
    """What a :func:`decode_view` depends on: each parameter's and buffer's identity, storage and version, each
    module's identity, mode and hooks."""
    tensors = tuple((id(t), t.data_ptr(), t.dtype, t.device, 0 if t.is_inference() else t._version)
                    for t in (*model.parameters(), *model.buffers()))
    modules = tuple((id(m), m.training, len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules())
    return tensors, modules


def _served(m: nn.Module) -> bool:
    """An ``nn.Linear`` (exactly) that a :class:`PackedLinear` with ``pack=False`` serves with attnlab's matvec on
    its own storage: contiguous float32 CPU weight (and bias), no hooks, the kernel chosen for a decoding step."""
    if type(m) is not nn.Linear or m._forward_hooks or m._forward_pre_hooks:
        return False
    if any(t is not None and (t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous())
           for t in (m.weight, m.bias)):
        return False
    return _native_rows(m.weight, 1)


def _viewed(m: nn.Module, memo: dict) -> nn.Module:
    """A shallow copy of the module tree ``m`` (one copy per module however often it appears), its
    :func:`_served` linear layers replaced by storage-sharing :class:`PackedLinear` s."""
    if id(m) in memo:
        return memo[id(m)]
    if _served(m):
        c = PackedLinear(m, dtype=torch.float32, rows=1, pack=False)
        c.train(m.training)
        if c.weight_.data_ptr() != m.weight.data_ptr():  # (not expected: _served holds) never a copy of a weight
            c = m
    else:
        c = m.__class__.__new__(m.__class__)
        c.__dict__.update(m.__dict__)  # the same parameters, buffers, hooks and settings
        c.__dict__["_modules"] = {}
        memo[id(m)] = c  # before the children: a module that holds itself
        c.__dict__["_modules"] = {name: None if ch is None else _viewed(ch, memo) for name, ch in m._modules.items()}
    memo[id(m)] = c
    return c


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes of weights one decoding step reads: every linear layer's weights (packed, int8 or int4 rows and their
    scales, or plain), one row of each embedding table (the tied LM head reads the table whole, as a linear
    layer), and every other parameter once; tensors shared by several modules count once.

    The step's floor on a memory-bound machine is ``decode_weight_bytes(model) / bandwidth``.
    """
    seen: set[int] = set()
    total = 0

    def add(t, nbytes=None):
        nonlocal total
        if t is not None and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size() if nbytes is None else nbytes

    for m in model.modules():  # linear layers first: the tied LM head reads the token table whole
        if isinstance(m, nn.Linear):
            add(m.weight), add(m.bias)
        elif isinstance(m, PackedLinear):
            if m.packed:  # oneDNN's tensor has no data pointer
                total += m.in_features * m.out_features * m.weight_.element_size()
            else:  # plain: perhaps an embedding's table (a tied head), counted once
                add(m.weight_)
            add(m.bias_)
        elif hasattr(m, "weight_int8") or hasattr(m, "weight_int4"):  # attnlab.adapt.quantize's Int8/Int4Linear
            add(getattr(m, "weight_int8", None)), add(getattr(m, "weight_int4", None)), add(m.weight_scale)
            add(getattr(m, "bias", None))
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            add(m.weight, m.weight.shape[1] * m.weight.element_size())  # one row
    for p in model.parameters():
        add(p)
    return total
