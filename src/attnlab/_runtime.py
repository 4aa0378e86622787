"""What this machine computes natively (:func:`probe`), the precision that follows (:func:`resolve_dtype`),
and the process-wide CPU memory setting for long-running commands (:func:`reuse_freed_memory`).

PyTorch's CPU tensors come from ``malloc``. glibc serves a block larger than ``M_MMAP_THRESHOLD``
with a fresh ``mmap`` and gives the top of its heap back to the kernel once more than
``M_TRIM_THRESHOLD`` is free, so a training step that frees and re-allocates the same activations
touches new pages each time: the kernel zero-fills every 4 KiB page on its first write (a "minor
fault"): thousands of faults per step of the default ``shakespeare-char`` recipe, ~1 with the thresholds
below, and 15–20 % faster steps.

The price is resident memory: up to ``trim_threshold`` of freed memory stays mapped for reuse.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

__all__ = ["reuse_freed_memory", "reuse_large_blocks", "Capability", "probe", "resolve_dtype", "check_dtype_name", "torch_dtype",
           "DTYPE_CHOICES", "model_dtype", "cpu_float32_only", "progress_bar"]

# mallopt(3) parameter numbers (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def reuse_freed_memory(*, mmap_threshold: int = 32 << 20, trim_threshold: int = 256 << 20,
                       top_pad: int = 64 << 20) -> bool:
    """Make glibc keep freed memory for reuse instead of returning it to the kernel.

    Sets ``M_MMAP_THRESHOLD`` (blocks below it come from the heap, not a fresh ``mmap``; glibc's
    largest allowed value on 64-bit is 32 MiB), ``M_TRIM_THRESHOLD`` (free heap top kept before
    trimming) and ``M_TOP_PAD`` (extra heap grown per request). Affects the whole process.

    Returns:
        True when applied; False where the C library is not glibc (nothing is changed).
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    ok = [libc.mallopt(param, int(value)) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, mmap_threshold), (_M_TRIM_THRESHOLD, trim_threshold), (_M_TOP_PAD, top_pad))]
    return all(ok)


# ---- what this machine computes natively, and the precision that follows -------------------------

@dataclass(frozen=True)
class Capability:
    """The facts of this machine that decide precision and speed (see :func:`probe`).

    ``isa`` is the instruction set torch's CPU kernels use (``torch.backends.cpu.get_cpu_capability()``,
    which honours ``ATEN_CPU_CAPABILITY``); ``bf16_native`` says whether the CPU has bf16 dot-product instructions
    (AVX512_BF16 or AMX-BF16, from its flags) that oneDNN may use (honours ``ONEDNN_MAX_CPU_ISA``): oneDNN also
    runs bf16 on a plain AVX-512 CPU, by conversion, which is no faster than fp32; ``fp16_native`` whether oneDNN
    computes fp16 in hardware; ``amx`` whether the CPU has AMX tiles oneDNN may use. The measured figures are None
    unless the probe was asked to measure: they are reported, never used to decide.
    """

    torch_version: str
    cpu: str
    isa: str
    bf16_native: bool
    fp16_native: bool
    amx: bool
    cores: int
    threads: int
    cuda: Optional[str]
    fp32_gflops: Optional[float] = None
    bf16_gflops: Optional[float] = None
    copy_gbps: Optional[float] = None

    def as_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        """One line for a benchmark header: CPU, ISA, native bf16, threads, torch, measured rates."""
        parts = [f"{self.cpu}", f"ISA {self.isa}", f"bf16 {'native' if self.bf16_native else 'emulated'}",
                 f"AMX {'yes' if self.amx else 'no'}", f"{self.threads} threads", f"torch {self.torch_version}"]
        if self.fp32_gflops is not None:
            parts.append(f"matmul fp32 {self.fp32_gflops:.0f} / bf16 {self.bf16_gflops:.0f} GFLOP/s")
        if self.copy_gbps is not None:
            parts.append(f"copy {self.copy_gbps:.1f} GB/s")
        if self.cuda:
            parts.append(f"CUDA {self.cuda}")
        return " | ".join(parts)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _matmul_gflops(dtype, *, n: int = 512, seconds: float = 0.1, at_least: int = 8) -> float:
    """GFLOP/s of an ``n × n`` product in ``dtype`` (2n³ flops per product), the best of the products that fit in
    ``seconds`` (``at_least`` of them however slow)."""
    import torch

    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return product_gflops(torch.matmul, a, b, seconds=seconds, at_least=at_least)


def product_gflops(product, a, b, *, seconds: float = 0.1, at_least: int = 8) -> float:
    """GFLOP/s of ``product(a, b)`` for ``a (m, k)``, ``b (k, n)`` (2mkn flops each), the best of the calls that fit
    in ``seconds`` (``at_least`` however slow), after one warm-up call (the first picks the kernel)."""
    product(a, b)
    best, end, done = float("inf"), time.perf_counter() + seconds, 0
    while time.perf_counter() < end or done < at_least:
        done += 1
        t = time.perf_counter()
        product(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * a.shape[0] * a.shape[1] * b.shape[1] / best / 1e9


def _copy_gbps(*, mib: int = 64, repeats: int = 5) -> float:
    """GB/s of a ``mib`` MiB tensor copy, counting the bytes read and written."""
    import torch

    src = torch.ones(mib << 18)  # float32: 4 bytes each
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best / 1e9


@functools.lru_cache(maxsize=1)
def product_rates() -> tuple[float, float]:
    """Measured ``(fp32, bf16)`` GFLOP/s of a 512² product, the best of those that fit in ~0.03 s each (at least 8):
    what :func:`probe` reports and an explicit bf16 without native support warns with. Never a choice's reason: a
    busy machine reads a fraction of its speed. Cached per process."""
    import torch

    return (round(_matmul_gflops(torch.float32, seconds=0.03), 1),
            round(_matmul_gflops(torch.bfloat16, seconds=0.03), 1))


@functools.lru_cache(maxsize=2)
def probe(*, measure: bool = False) -> Capability:
    """What this process's torch computes natively; with ``measure=True`` also ~0.13 s of measured figures
    (fp32 and bf16 GFLOP/s of a 512² product, :func:`product_rates`; copy GB/s). Cached per process.

    Honours the standard overrides, read by torch and oneDNN at start-up: ``ATEN_CPU_CAPABILITY``
    (e.g. ``avx2``) and ``ONEDNN_MAX_CPU_ISA`` (e.g. ``AVX2``), so an AVX-512 machine started with both
    reports — and behaves — as an AVX2 one.
    """
    import torch

    isa = torch.backends.cpu.get_cpu_capability()
    onednn_isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    flags, unlimited = _cpu_flags(), not onednn_isa or onednn_isa in ("ALL", "DEFAULT")
    amx = bool({"amx_bf16", "amx_tile"} & flags) and (unlimited or "AMX" in onednn_isa)
    # bf16 dot products in hardware: AVX512_BF16 (oneDNN's AVX512_CORE_BF16 and every set above it) or AMX
    bf16_isa = unlimited or any(s in onednn_isa for s in ("BF16", "FP16", "AVX10"))
    bf16_ops = amx or ("avx512_bf16" in flags and bf16_isa)
    bf16 = bf16_ops and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    fp16 = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    cap = Capability(torch_version=torch.__version__, cpu=_cpu_name(), isa=isa, bf16_native=bf16,
                     fp16_native=fp16, amx=amx, cores=os.cpu_count() or 1, threads=torch.get_num_threads(),
                     cuda=cuda)
    if measure:
        fp32, bf16 = product_rates()
        cap = replace(cap, fp32_gflops=fp32, bf16_gflops=bf16, copy_gbps=round(_copy_gbps(), 1))
    return cap


DTYPE_NAMES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16",
               "fp16": "fp16", "float16": "fp16", "half": "fp16"}
DTYPE_CHOICES = ("auto", "fp32", "bf16", "fp16")


def check_dtype_name(value, *, name: str = "dtype") -> str:
    """``value`` as one of ``auto``, ``fp32``, ``bf16``, ``fp16`` (long names and torch dtypes accepted).

    Raises:
        ValueError: anything else, naming ``name`` and the valid values.
    """
    import torch

    if isinstance(value, torch.dtype):
        value = str(value).removeprefix("torch.")
    if isinstance(value, str) and (value == "auto" or value.lower() in DTYPE_NAMES):
        return "auto" if value == "auto" else DTYPE_NAMES[value.lower()]
    raise ValueError(f"{name} must be one of {', '.join(DTYPE_CHOICES)} (or float32, bfloat16, float16), "
                     f"got {value!r}")


_WARNED: set[str] = set()


def resolve_dtype(value="auto", device="cpu", *, name: str = "dtype", source: str = "asked for") -> tuple[str, str]:
    """The precision to compute in, and why: ``(dtype, reason)`` with dtype one of fp32, bf16, fp16.

    ``auto`` on a CPU = bf16 where the CPU has bf16 dot-product instructions (:func:`probe`'s ``bf16_native``:
    AVX512_BF16 or AMX), else fp32 — decided from the CPU's capabilities alone, never from a timing, so the same
    machine makes the same choice however busy it is; on CUDA, bf16 where the device supports it, else fp32. An
    explicit ``bf16`` on a CPU without native bf16 is honoured with one warning (once per process)
    saying how much slower it is measured to be; ``fp16`` needs CUDA. An explicit value's reason is ``source``
    (where the value came from: the default "asked for", or e.g. "recipe default").

    Raises:
        ValueError: an unknown ``value`` (naming ``name`` and the valid values), or fp16 on a CPU.
    """
    import torch

    dtype = check_dtype_name(value, name=name)
    device = torch.device(device if device not in (None, "auto") else "cpu")
    if device.type == "cuda":
        if dtype == "auto":
            return ("bf16", "CUDA with bf16") if torch.cuda.is_bf16_supported() else ("fp32", "CUDA without bf16")
        return dtype, source
    if dtype == "fp16":
        raise ValueError(f"{name}=fp16 needs a CUDA device; on a CPU use fp32 or bf16 (or auto)")
    cap = probe()
    if dtype == "auto":
        if not cap.bf16_native:
            return "fp32", f"no native bf16 ({cap.isa})"
        return "bf16", f"native bf16 ({cap.isa}, {'AMX' if cap.amx else 'AVX512_BF16'})"
    if dtype == "bf16" and not cap.bf16_native and "bf16" not in _WARNED:
        _WARNED.add("bf16")
        fp32, bf16 = product_rates()
        slower = fp32 / max(bf16, 1e-9)
        # (a probe starved by other work can read almost nothing: a ratio past 100 is not a measurement to quote)
        how = f"about {slower:.0f}x" if slower <= 100 else "over 100x"
        warnings.warn(f"{name}=bf16 on a CPU without native bf16 ({cap.isa}): matrix products run {how} "
                      f"slower than fp32 here; {name}=auto would choose fp32", stacklevel=2)
    return dtype, source


def torch_dtype(name: str):
    """``"fp32"``/``"bf16"``/``"fp16"`` -> the torch dtype."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


_LARGE_BLOCKS = {"applied": False}
LARGE_TENSOR_BYTES = 8 << 20


def reuse_large_blocks(*tensors) -> bool:
    """Keep freed blocks of long-sequence kernels for reuse, applied by the library itself, once per process.

    A block of 32 MiB or more (e.g. ``(1, 8, 16384, 64)`` in fp32) is above glibc's largest dynamic
    mmap threshold: each call maps it afresh and the kernel zero-fills every page on first touch, so
    long sequences cost more than their size (causal linear attention fwd+bwd at N=16384: ~270,000
    minor faults per call with glibc's defaults, ~10,000 after this; N=16384/N=2048 time 12× → ≤ 10×).
    The first call whose tensors hold at least ``LARGE_TENSOR_BYTES`` each sets ``M_MMAP_THRESHOLD`` and
    ``M_TRIM_THRESHOLD`` to 1 GiB (:func:`reuse_freed_memory`); the price is that up to 1 GiB of freed
    memory stays mapped for reuse. ``ATTNLAB_KEEP_MALLOC=1`` in the environment leaves glibc's settings
    alone. Called by the ``tiled`` backend and :func:`attnlab.linear_attention`.

    Returns:
        True when the setting is in force (now or from an earlier call).
    """
    if _LARGE_BLOCKS["applied"] or os.environ.get("ATTNLAB_KEEP_MALLOC") == "1":
        return _LARGE_BLOCKS["applied"]
    if not any(t.device.type == "cpu" and t.numel() * t.element_size() >= LARGE_TENSOR_BYTES for t in tensors):
        return False
    _LARGE_BLOCKS["applied"] = reuse_freed_memory(mmap_threshold=1 << 30, trim_threshold=1 << 30)
    return _LARGE_BLOCKS["applied"]


# ---- the command line's --device / --dtype, shared by the subcommands (cli.py sits above them all)

def model_dtype(args):
    """A subcommand's ``--dtype`` as a torch dtype (float32 when not given; ``auto`` resolved for ``--device``)."""
    import torch

    if args.dtype == "auto":
        return torch_dtype(resolve_dtype("auto", args.device or "cpu", name="--dtype")[0])
    return getattr(torch, args.dtype or "float32")


def cpu_float32_only(args) -> None:
    """For commands that measure on the CPU in float32: refuse ``--device``/``--dtype`` in one line
    (``--dtype auto`` is accepted: it resolves to float32 for them)."""
    for flag, value, ok in (("--device", args.device, ("cpu", None)),
                            ("--dtype", args.dtype, ("float32", "auto", None))):
        if value not in ok:
            raise ValueError(f"attnlab {args.command} runs on the CPU in float32; {flag} {value} is not supported")


def progress_bar(*args, **kwargs):
    """A ``tqdm`` bar: the notebook widget inside a Jupyter kernel that has ``ipywidgets``, the text bar everywhere
    else (``tqdm.auto`` warns "IProgress not found" into the notebook when ``ipywidgets`` is missing)."""
    from tqdm import tqdm as text_bar

    if _in_kernel():
        try:
            import ipywidgets  # noqa: F401
        except ImportError:
            return text_bar(*args, **kwargs)
        from tqdm.notebook import tqdm as widget_bar
        return widget_bar(*args, **kwargs)
    return text_bar(*args, **kwargs)


def _in_kernel() -> bool:
    """Whether this process is a Jupyter kernel's (IPython's shell runs under an ``IPKernelApp``), as ``tqdm.auto``
    decides: a process that merely imported ipykernel (a test runner executing notebooks) is not."""
    ipython = sys.modules.get("IPython")
    try:
        shell = ipython.get_ipython() if ipython is not None else None
        return shell is not None and "IPKernelApp" in shell.config
    except Exception:  # an IPython without get_ipython, a shell without a config: not a kernel
        return False
