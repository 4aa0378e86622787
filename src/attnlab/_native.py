"""attnlab's own C++ CPU kernels (``src/attnlab/csrc/``), built once per machine, with PyTorch's kernels as the fallback.

:func:`matvec` is the few-row linear product of a decoding step, ``y = s ⊙ (x Wᵀ) + b`` with ``W`` in float32,
bfloat16 or int8 (``s``: one scale per row), or int4 in groups, streamed at memory bandwidth (``csrc/matvec.cpp``), and
:func:`gated_matvec` a gated FFN's two products and gate in one pass. :func:`rms_norm` and :func:`attend_decode`
(``csrc/decode.cpp``) are the rest of a decoding step's layer in two calls: RMSNorm, and RoPE + the KV-cache
write + the attention over the cache.

The library is compiled with :func:`torch.utils.cpp_extension.load` (a C++ compiler and ``ninja``) into
``$ATTNLAB_NATIVE_DIR`` or ``~/.cache/attnlab/native/<torch version>-<source hash>``: ``make setup`` builds it
(``python -m attnlab._native``), otherwise the first use does (~30 s, once per machine, logged). Where it cannot
be built or loaded (no compiler, ``ATTNLAB_NATIVE=0``), :func:`available` is False, one log line says why, and
callers use PyTorch's kernels: the same products up to float32 summation order.

The training passes' wrappers (the short backend's softmax, RMSNorm, RoPE, an FFN's activation, int8 roundings;
``csrc/train.cpp``, ``int8_quantize.cpp``, ``int8_product.cpp``, ``int8_train.cpp``, ``short_attention.cpp``,
``gpt_block.cpp``) are
:mod:`attnlab._native_train`; this module loads the library and holds the rest.

The library chooses its instruction set itself, once per process (:func:`isa`): AVX-512, AVX2 + FMA or portable C++,
the best the CPU supports, capped by ``ATEN_CPU_CAPABILITY`` as ATen caps its own (``ATEN_CPU_CAPABILITY=avx2`` runs
the AVX2 code here as it does in ATen). No argument of an op chooses it, so no call runs an instruction the CPU lacks.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# compiled; they include CSRC's headers
SOURCES = tuple(CSRC / f for f in ("matvec.cpp", "decode.cpp", "flash_forward.cpp", "flash_backward.cpp", "train.cpp",
                                    "int8_quantize.cpp", "int8_product.cpp", "int8_train.cpp", "short_attention.cpp",
                                    "gpt_block.cpp"))
# the kernel's regime by default (nothing forced or probed: attnlab._choice): a decode step's rows (batch), by weight
# dtype — up to where it beat the GEMM kernels on GPT-2's matrices (fp32 up to 8 rows; bf16 and int8 up to 4)
MAX_ROWS = 4
MAX_ROWS_FP32 = 8
# matvec.cpp's: an int4 product of more rows than this multiplies panels of the dequantised weight (at::mm): up to
# 64 rows the integer kernel is faster than the panels, past it the panels are within a few % of F.linear on float32
INT4_ROWS = 64
_ISA_CODES = {"AVX512": 2, "AVX2": 1}
_ISA_NAMES = {2: "AVX-512", 1: "AVX2 + FMA", 0: "portable C++"}
_state: dict = {}  # "loaded": bool, "why": str, and the loaded ops
CFLAGS = ("-O3", "-fopenmp")
LDFLAGS = ("-fopenmp",)


def _flags() -> tuple[tuple, tuple]:
    """The compiler's and the linker's flags: :data:`CFLAGS` and :data:`LDFLAGS`, and with
    ``$ATTNLAB_NATIVE_SANITIZE`` (e.g. ``address,undefined``: ``make test-sanitize``) those sanitizers, every report
    fatal (the library's folder is keyed by the flags: a build of its own). Python itself is not instrumented: run
    with ``LD_PRELOAD=$(gcc -print-file-name=libasan.so)`` for AddressSanitizer."""
    sanitize = os.environ.get("ATTNLAB_NATIVE_SANITIZE")
    if not sanitize:
        return CFLAGS, LDFLAGS
    extra = (f"-fsanitize={sanitize}", "-fno-sanitize=vptr", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer",
             "-g")
    return CFLAGS + extra, LDFLAGS + extra[:2]


def max_rows(dtype: torch.dtype) -> int:
    """How many rows of x the kernel takes by default for a weight of ``dtype`` before a GEMM kernel is faster (the
    probed crossover replaces it: :func:`attnlab.nn.inference.native_rows`)."""
    return MAX_ROWS_FP32 if dtype == torch.float32 else MAX_ROWS


def build_directory() -> Path:
    """Where the library is built: ``$ATTNLAB_NATIVE_DIR``, else the user cache, keyed by torch, Python, the
    sources, the flags and the compiler (a change of any builds anew)."""
    if os.environ.get("ATTNLAB_NATIVE_DIR"):
        return Path(os.environ["ATTNLAB_NATIVE_DIR"])
    sources = b"".join(p.read_bytes() for p in sorted(CSRC.iterdir()) if p.is_file())
    digest = hashlib.sha256(sources + repr((_flags(), _compiler())).encode()).hexdigest()[:12]
    tag = f"torch{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}-{digest}"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "attnlab" / "native" / tag


def _compiler() -> tuple:
    """The C++ compiler ``cpp_extension`` runs (``$CXX``, else ``c++``) as its resolved path, size and modification
    time: a new or upgraded compiler changes the key without running it (no process spawned on every import)."""
    found = shutil.which(os.environ.get("CXX", "c++"))
    if found is None:
        return (os.environ.get("CXX", "c++"), None)
    real = os.path.realpath(found)
    st = os.stat(real)
    return (real, st.st_size, st.st_mtime_ns)


def _load_built(so: Path) -> bool:
    """Load the library built before for these very sources and flags (the directory's name is their digest) without
    ``cpp_extension.load``, whose import and ninja run cost ~160 ms of every process that uses the kernels. False
    where there is none to load, it is not a whole 64-bit ELF file (a link interrupted by a kill: the dynamic loader
    would crash the process on it; cpp_extension.load relinks it), or the folder is ``$ATTNLAB_NATIVE_DIR`` (not
    keyed: ninja decides there)."""
    if os.environ.get("ATTNLAB_NATIVE_DIR") or not so.is_file() or not _whole_elf(so):
        return False
    try:
        torch.ops.load_library(str(so))
    except OSError:
        return False
    return True


def _whole_elf(path: Path) -> bool:
    """Whether ``path`` is a little-endian 64-bit ELF file that reaches its section header table (which the linker
    writes at the end: a truncated file stops short of it)."""
    with open(path, "rb") as f:
        head = f.read(64)
    if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
        return False
    shoff = int.from_bytes(head[0x28:0x30], "little")
    shentsize, shnum = int.from_bytes(head[0x3A:0x3C], "little"), int.from_bytes(head[0x3C:0x3E], "little")
    return path.stat().st_size >= shoff + shentsize * shnum


@contextlib.contextmanager
def _build_lock(where: Path):
    """Hold an exclusive ``flock`` on ``where/build.flock`` while building. The kernel releases it when its holder
    dies, so a build killed half-way never blocks the next one; ``cpp_extension``'s own lock file (``where/lock``),
    which a killed build leaves behind and which would make every later build wait for ever, is removed while we
    hold ours (nobody else can be building then)."""
    import fcntl

    with open(where / "build.flock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            (where / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _load() -> None:
    if os.environ.get("ATTNLAB_NATIVE", "1") == "0":
        _state.update(loaded=False, why="disabled by ATTNLAB_NATIVE=0")
        return
    try:
        where = build_directory()
        if not _load_built(where / "attnlab_native.so"):
            from torch.utils import cpp_extension

            venv_bin = Path(sys.executable).parent  # the ninja of attnlab's dependencies, in an unactivated venv
            if shutil.which("ninja") is None and (venv_bin / "ninja").exists():
                os.environ["PATH"] = f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"
            where.mkdir(parents=True, exist_ok=True)
            with _build_lock(where):
                if not _load_built(where / "attnlab_native.so"):  # another process may have built it meanwhile
                    if not any(where.glob("attnlab_native*.so")):
                        log.warning("attnlab: building the native CPU kernels in %s (once per machine, ~30 s)", where)
                    cflags, ldflags = _flags()
                    cpp_extension.load(name="attnlab_native", sources=[str(p) for p in SOURCES],
                                       build_directory=str(where), extra_cflags=list(cflags),
                                       extra_ldflags=list(ldflags), is_python_module=False, verbose=False)
        ops = torch.ops.attnlab  # the overloads: no resolution per call
        _state.update(loaded=True, why="", op=ops.matvec.default, gated=ops.gated_matvec.default,
                      rms_norm=ops.rms_norm.default, decoder_step=ops.decoder_step.default,
                      attend_decode=ops.attend_decode.default, flash_forward=ops.flash_forward.default,
                      flash_backward=ops.flash_backward.default, activate=ops.activate.default,
                      int4_dequantize=ops.int4_dequantize.default,
                      rms_norm_train=ops.rms_norm_train.default,
                      rms_norm_train_backward=ops.rms_norm_train_backward.default, rope_train=ops.rope_train.default,
                      act_train=ops.act_train.default, act_train_backward=ops.act_train_backward.default,
                      clip_grad_norm_=ops.clip_grad_norm_.default, short_attention=ops.short_attention.default,
                      short_attention_backward=ops.short_attention_backward.default,
                      quantize_rows=ops.quantize_rows.default, quantize_rows_cols=ops.quantize_rows_cols.default,
                      dequantize=ops.dequantize.default, int8_product=ops.int8_product.default,
                      int8_linear=ops.int8_linear.default, int8_linear_backward=ops.int8_linear_backward.default,
                      int8_kernel=ops.int8_kernel.default, all_finite=ops.all_finite.default,
                      short_attention_packed=ops.short_attention_packed.default,
                      gpt_block_train=ops.gpt_block_train.default, cpu_isa=ops.cpu_isa.default,
                      limit_isa=ops.limit_isa.default)
        from attnlab import _native_library

        _native_library.register()  # the fakes (torch.compile) and the training passes' autograd
    except Exception as e:  # no compiler, no ninja, a failed build: PyTorch's kernels serve instead
        why = " ".join(str(e).split())  # the compiler's message is at the end
        why = why if len(why) <= 300 else "…" + why[-300:]
        _state.update(loaded=False, why=f"{type(e).__name__}: {why}")
        log.warning("attnlab: native CPU kernels unavailable, using PyTorch's (%s)", _state["why"])


def available() -> bool:
    """Whether the native kernels are loaded (building them on the first call if needed)."""
    if "loaded" not in _state:
        _load()
    return _state["loaded"]


def status() -> str:
    """One line for ``attnlab env``: loaded (with the instruction set used) or why not."""
    if available():
        return f"loaded ({_ISA_NAMES[isa()]}; {build_directory()})"
    return f"unavailable: {_state['why']}"


def isa() -> int:
    """The instruction set the kernels use, as the C++ library chose it (``csrc/native.h``: what the CPU and its
    operating system support, capped by ``ATEN_CPU_CAPABILITY`` as ATen caps its own): 2 = AVX-512, 1 = AVX2 + FMA,
    0 = portable C++ (also where the kernels are not :func:`available`)."""
    return _state["cpu_isa"]() if available() else 0


def limit_isa(level: int) -> int:
    """Make the kernels use at most instruction set ``level`` (0-2; 2 lifts the limit) and return the set they use
    now, ``min(level, what the CPU allows)``: it can only lower the set, never raise it above what the CPU runs. The
    tests run each lower set's kernels in one process with it.

    Raises:
        RuntimeError: ``level`` is not 0, 1 or 2, or the native kernels are not :func:`available`.
    """
    _need()
    return _state["limit_isa"](level)


def matvec(x: Tensor, w: Tensor, scale: Optional[Tensor] = None, bias: Optional[Tensor] = None) -> Tensor:
    """``y[m, n] = s[n] · Σ_k W[n, k] x[m, k] + b[n]``: ``x (..., K)`` float32 (its rows m), ``w (N, K)`` float32 /
    bfloat16 / int8 (then ``scale (N,)`` float32 is required), ``bias (N,)`` float32; returns ``(..., N)`` float32.
    int4 weights: ``w`` uint8 nibbles ``(N, ⌈K/128⌉·64)`` with their group scales ``scale (N, K / G)``
    (:func:`attnlab.adapt.quantize.quantize_groups`); more rows than :data:`INT4_ROWS` run as panels of the
    dequantised weight through ``at::mm``.

    The inputs must be contiguous CPU tensors (the op checks).

    Raises:
        RuntimeError: the native kernels are not :func:`available` (callers check that first).
    """
    op = _state.get("op")  # lean on purpose: a decode step calls this ~50 times
    if op is None:
        if not available():
            raise RuntimeError(f"attnlab's native kernels are unavailable here: {_state['why']}")
        op = _state["op"]
    return op(x, w, scale, bias)


def int4_dequantize(w: Tensor, scale: Tensor, in_features: int) -> Tensor:
    """The float32 ``(N, in_features)`` that int4 nibbles ``w (N, ⌈K/128⌉·64)`` uint8 and their group scales ``scale
    (N, K / G)`` stand for (:func:`attnlab.adapt.quantize.quantize_groups`' layout), in parallel over the rows.

    Raises:
        RuntimeError: the native kernels are not :func:`available` (callers check that first).
    """
    _need()
    return _state["int4_dequantize"](w, scale, in_features)


# FeedForward's gated activations -> the op's code, and its plain ones (csrc/native.h: Act)
GATES = {"glu": 0, "geglu": 1, "geglu_tanh": 2, "swiglu": 3, "relu2_glu": 6}
ACTIVATIONS = {"relu": 4, "gelu": 1, "gelu_tanh": 2, "quick_gelu": 5, "relu2": 6}


def gated_matvec(x: Tensor, first: tuple, second: tuple, activation: str) -> Tensor:
    """A gated FFN's hidden activation ``act(x W₁ᵀ ⊙ s₁ + b₁) ⊙ (x W₃ᵀ ⊙ s₃ + b₃)`` in one call: ``first`` and
    ``second`` are :func:`matvec`'s ``(w, scale, bias)`` for ``W₁`` and ``W₃`` (same shape and dtype), ``activation``
    one of :data:`GATES` (GLU's sigmoid, GELU, GELU-tanh, SiLU, ReLU²). ``x (..., K)`` float32 -> ``(..., N)`` float32.

    Raises:
        RuntimeError: the native kernels are not :func:`available` (callers check that first).
    """
    _need()
    return _state["gated"](x, *first, *second, GATES[activation])


# the activations whose vectorised kernel beats PyTorch's on a large tensor (erf GELU and SiLU stay PyTorch's)
FASTER_ACTIVATIONS = ("gelu_tanh",)


def activate(x: Tensor, activation: str) -> Tensor:
    """``act(x)`` for a plain FFN activation (:data:`ACTIVATIONS`), a new tensor; ``x`` a contiguous float32 CPU tensor
    (the op checks). Vectorised (``decode_body.h``: e^x within ~1 ulp, erf within 1.5e-7), forward only.

    Raises:
        RuntimeError: the native kernels are not :func:`available` (callers check that first).
    """
    _need()
    return _state["activate"](x, None, ACTIVATIONS[activation])


def transformed(t: Tensor) -> bool:
    """Whether ``t`` is wrapped by a ``torch.func`` transform (``grad``, ``vmap``, ``jacrev``, …): our autograd
    Functions (no ``setup_context``) and C++ kernels (no data pointer) cannot run there; PyTorch's operations can.
    False while ``torch.compile`` traces (its tensors are fakes, which no transform wraps)."""
    return not torch.compiler.is_compiling() and torch._C._functorch.is_functorch_wrapped_tensor(t)


def runs_on(x: Tensor) -> bool:
    """Whether attnlab's C++ kernels may read ``x`` at all: eager mode or a graph that ``torch.compile`` or
    ``torch.export`` traces (each op has a fake, :mod:`attnlab._native_library`, so the graph records it), not one
    that ``torch.jit.trace`` traces (as ``torch.onnx.export``'s TorchScript exporter does: it records PyTorch's
    operations), ``x`` not wrapped by a ``torch.func`` transform (:func:`transformed`), the kernels
    :func:`available`. The callers add what their kernels need of the dtype, device and layout."""
    return not torch.jit.is_tracing() and not transformed(x) and available()


def trainable(*xs: Optional[Tensor], contiguous: bool = True) -> bool:
    """Whether the training passes (:mod:`attnlab._native_train`) may take ``xs`` (None entries skipped):
    float32 or bfloat16 CPU tensors of one dtype, contiguous (unless ``contiguous=False``), :func:`runs_on` each."""
    xs = [x for x in xs if x is not None]
    return xs[0].dtype in (torch.float32, torch.bfloat16) and all(
        x.device.type == "cpu" and x.dtype == xs[0].dtype and (x.is_contiguous() or not contiguous) and runs_on(x)
        for x in xs)


def usable(x: Tensor) -> bool:
    """Whether an inference kernel may take ``x``: float32 on the CPU, no gradient wanted through it (the kernels have
    no backward), :func:`runs_on` it."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and not (x.requires_grad and torch.is_grad_enabled())
            and runs_on(x))


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """``y = x / sqrt(mean(x²) + ε) · w`` row by row: ``x (..., E)`` and ``w (E,)`` contiguous float32 CPU tensors (the op
    checks), forward only (no autograd). :class:`attnlab.nn.RMSNorm` calls it in inference.

    Raises:
        RuntimeError: the native kernels are not :func:`available` (callers check that first).
    """
    _need()
    return _state["rms_norm"](x, w, eps)


def attend_decode(qkv: Tensor, k_cache: Tensor, v_cache: Tensor, position: int, heads: int, kv_heads: int,
                  cos: Optional[Tensor], sin: Optional[Tensor], interleaved: bool, scale: float) -> Tensor:
    """One decoding step's attention from its packed projection: ``qkv (B, 1, (H + 2 Hkv) · D)`` (q's heads, then
    k's, then v's) is rotated at ``position`` (RoPE with the angles' ``cos``, ``sin`` ``(R/2,)`` rows, pairs laid out
    as :func:`~attnlab.functional.positional.apply_rope`'s ``interleaved``; none without them), k and v are written
    into the cache buffers ``k_cache, v_cache (B, Hkv, capacity, D)`` at ``position``, and each query head ``h``
    attends to key/value head ``h // (H / Hkv)`` over positions ``0 .. position``:
    ``softmax(scale · q Kᵀ) V`` -> ``(B, 1, H · D)``. float32 contiguous CPU tensors (the op checks).

    Raises:
        RuntimeError: the native kernels are not :func:`available` (callers check that first).
    """
    _need()
    return _state["attend_decode"](qkv, k_cache, v_cache, position, heads, kv_heads, cos, sin, interleaved, scale)


def decoder_step(x: Tensor, tensors: list, *, rms: bool, eps: tuple[float, float], heads: int, kv_heads: int,
                 position: int, interleaved: bool, scale: float, activation: str) -> Tensor:
    """A pre-norm decoder-only layer's decoding step in one call, ``x (B, 1, E)`` -> ``(B, 1, E)``::

        x₁ = x + W_o attend_decode(W_qkv norm₁(x))          (RoPE, the cache write and the attention at ``position``)
        x₂ = x₁ + W₂ f(norm₂(x₁)),  f = act(W₁ ·) ⊙ W₃ ·  (gated ``activation``, :data:`GATES`) or act(W₁ ·)

    with RMSNorm (``rms``) or LayerNorm and every product as :func:`matvec` computes it. ``tensors``, 23 in this
    order (None where absent): norm₁ weight, bias; then ``(w, scale, bias)`` of W_qkv and W_o; norm₂ weight, bias;
    ``(w, scale, bias)`` of W₁, W₃ (None ×3 unless gated), W₂; the K and V cache buffers (:func:`attend_decode`);
    cos, sin. Returns an empty tensor, with nothing written, where W_qkv norm₁(x) holds a NaN or ±inf.

    Raises:
        RuntimeError: the native kernels are not :func:`available` (callers check that first).
    """
    _need()
    gated = activation in GATES
    act = GATES[activation] if gated else ACTIVATIONS[activation]
    t = list(tensors)
    k_cache, v_cache = t.pop(19), t.pop(19)  # (the op declares them written: Tensor(a!))
    return _state["decoder_step"](x, k_cache, v_cache, t, rms, eps[0], eps[1], heads, kv_heads, position, interleaved,
                                  scale, act, gated)


MODS = {None: 0, "alibi": 1, "alibi_symmetric": 2, "softcap": 3}  # the score mods csrc/flash.h computes itself
# who computes csrc/flash.h's block products: its choice (ours with AVX-512, else ATen's), ATen's addmm (the BLAS torch
# links), our register-tiled kernel
PRODUCTS = {"auto": -1, "aten": 0, "own": 2}


def _code(table: dict, name: str, value):
    """``table[value]``, or a ValueError naming the argument and its choices."""
    if value not in table:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, table))}, got {value!r}")
    return table[value]


def own_products() -> bool:
    """Whether csrc/flash.h computes its block products itself (``products="auto"`` with AVX-512: faster there than the
    BLAS) rather than with ATen's addmm (the BLAS torch links)."""
    return available() and isa() >= 2


def flash_forward(q: Tensor, k: Tensor, v: Tensor, *, scale: float, causal: bool, window: Optional[int],
                  block_q: int, block_k: int, spans: Optional[Tensor] = None, layout: Optional[Tensor] = None,
                  granularity: int = 1, mod: Optional[str] = None, slopes: Optional[Tensor] = None, cap: float = 0.0,
                  products: str = "auto") -> tuple[Tensor, Tensor]:
    """Exact softmax attention with interval masks and a few score mods, ``(out (B, H, Lq, Dv), lse (B, H, Lq))``:
    FlashAttention's forward pass in one call (``csrc/flash_forward.cpp``)::

        O = softmax(mod(scale · Q Kᵀ) + mask) V,   LSE_i = log Σ_j e^(s_ij)   (-inf and O = 0 on a row that sees nothing)

    ``q (B, H, Lq, D)``, ``k (B, Hkv, Lk, D)``, ``v (B, Hkv, Lk, Dv)`` contiguous float32 CPU tensors (the op checks);
    query row i sits at position ``p = i + Lk - Lq`` and sees the keys ``j`` that ``causal`` (``j ≤ p``), ``window``
    (``p - j < w``, or ``|p - j| < w`` without causal) and ``spans`` (``(1 or B, 2, Lk)`` int64: ``spans[b, 0, p] ≤ j <
    spans[b, 1, p]``, both bounds non-decreasing in p, ``Lq ≤ Lk``) allow, and a block ``layout`` (``(query blocks, key
    blocks)`` uint8 of ``granularity`` G, BigBird's: ``layout[p // G, j // G]``; ``block_q`` must be G) keeps. ``mod``: ``"alibi"`` ``s + m_h (j - p)``,
    ``"alibi_symmetric"`` ``s - m_h |j - p|`` (``slopes`` ``(H,)`` float32), ``"softcap"`` ``c · tanh(s / c)``
    (``cap = c``). ``products`` (:data:`PRODUCTS`) picks who computes the block products (the tests run each).
    Forward only: :mod:`attnlab.backends.tiled` wraps both passes.

    Raises:
        RuntimeError: the native kernels are not :func:`available` (callers check that first).
    """
    _need()
    return _state["flash_forward"](q, k, v, scale, causal, -1 if window is None else window, spans, layout,
                                   granularity, _code(MODS, "mod", mod), slopes, cap, block_q, block_k,
                                   _code(PRODUCTS, "products", products))


def flash_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, d_out: Tensor, *, scale: float,
                   causal: bool, window: Optional[int], block_q: int, block_k: int, spans: Optional[Tensor] = None,
                   layout: Optional[Tensor] = None, granularity: int = 1, mod: Optional[str] = None,
                   slopes: Optional[Tensor] = None, cap: float = 0.0,
                   products: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of :func:`flash_forward` (the same mask and mod arguments; with a ``layout`` ``block_k``, the
    key tile, must be its granularity) given its ``out``, ``lse`` and
    the gradient ``d_out``, recomputing each block's probabilities from the LSE (nothing ``O(Lq · Lk)`` is kept)::

        P = e^(S - LSE);  dV = Pᵀ dO;  dS = P ∘ (dO Vᵀ - rowsum(dO ∘ O)) ∘ mod'(s);  dQ = scale · dS K;  dK = scale · dSᵀ Q

    Raises:
        RuntimeError: the native kernels are not :func:`available` (callers check that first).
    """
    _need()
    return _state["flash_backward"](q, k, v, out, lse, d_out, scale, causal, -1 if window is None else window, spans,
                                    layout, granularity, _code(MODS, "mod", mod), slopes, cap, block_q, block_k,
                                    _code(PRODUCTS, "products", products))


def _need() -> None:
    if not available():
        raise RuntimeError(f"attnlab's native kernels are unavailable here: {_state['why']}")


if __name__ == "__main__":  # ``python -m attnlab._native [--require]``: build now (make setup), say the outcome
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"attnlab native kernels: {status()}")
    # --require (CI, which has a compiler): a failed build is an error, not kernels' tests that skip
    sys.exit(1 if "--require" in sys.argv[1:] and not available() else 0)
