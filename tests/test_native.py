"""attnlab's C++ kernels (attnlab._native): the matvec op against a float64 oracle on every instruction set this
CPU runs, its errors, the loader's fallback, and the layers that call it.

Tolerances follow from the arithmetic: a float32 sum of K products is within ``K · 2⁻²⁴ · Σ_k |x_k w_k|`` of
the exact sum (the standard bound, γ_K), and the row scale and the bias add one rounding each; int8 weights multiply x rounded to 16-bit integers per row, which
adds at most ``s_x / 2 · Σ_k |s_n q_nk|`` (``s_x = max|x| / 32767``).
"""
import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnlab import _native
from _native_isas import CAP, EPS32, ISA_IDS, ISAS, isa, needs_native  # noqa: F401 (isa: a fixture)


def _weights(kind, N, K, gen):
    if kind == "int8":
        return torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=gen), torch.rand(N, generator=gen) + 0.1
    w = torch.randn(N, K, generator=gen) * 3
    return w.to(torch.bfloat16 if kind == "bf16" else torch.float32), None


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("M,N,K", [(1, 300, 768), (2, 65, 256), (3, 17, 50), (5, 9, 33), (8, 4, 7), (1, 3, 1),
                                   (2, 6, 4500)])
def test_matvec_equals_the_float64_product(isa, kind, M, N, K):
    """Shapes cover every path: whole vector groups, single vectors, scalar tails (K % 16, K odd, K < 8),
    rows in pairs and alone (M odd), and an int8 row longer than the integer flush interval (K = 4500)."""
    gen = torch.Generator().manual_seed(M * 1000 + K)
    x = torch.randn(M, K, generator=gen) * 2
    w, s = _weights(kind, N, K, gen)
    b = torch.randn(N, generator=gen)
    y = _native.matvec(x, w, s, b)
    wd = w.double() * (1 if s is None else s.double()[:, None])
    ref = x.double() @ wd.T + b.double()
    # γ_K for the sum, plus one rounding each for the row scale and the bias
    bound = (K + 2) * EPS32 * (x.double().abs() @ wd.abs().T) + EPS32 * (b.double().abs() + ref.abs()) + 1e-12
    if kind == "int8" and isa > 0:  # x rounded to int16 per row
        sx = x.abs().amax(dim=1, keepdim=True).double() / 32767
        bound = bound + sx / 2 * wd.abs().sum(dim=1)
    assert y.shape == (M, N) and y.dtype == torch.float32
    assert ((y.double() - ref).abs() <= bound).all()


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@pytest.mark.parametrize("M,N,K,G", [(1, 300, 768, 64), (2, 65, 256, 32), (3, 17, 96, 32), (5, 9, 128, 128),
                                     (4, 7, 512, 256), (1, 3, 32, 32), (6, 5, 4608, 64), (3, 4, 576, 192),
                                     (2, 5, 160, 32), (1, 2, 192, 96), (17, 30, 224, 32), (65, 30, 224, 32),
                                     (100, 9, 768, 768)])
def test_int4_matvec_equals_the_float64_product(isa, M, N, K, G):
    """int4 weights in groups (uint8 nibbles, float32 (N, K / G) scales): whole blocks of 128 columns and a last
    block of 1-3 runs of 32 (K = 96, 160, 224, 576), groups of one run, of whole blocks and across blocks (96, 192),
    rows in fours, pairs and alone, and more rows than the kernel takes (65, 100: panels of the dequantised weight
    through at::mm, float32 throughout). The bound: γ_K, one rounding each for the group scales and the bias, and
    for the kernel's rows x's rounding to 16-bit integers."""
    from attnlab.adapt.quantize import dequantize_groups, quantize_groups

    gen = torch.Generator().manual_seed(M * 1000 + K + G)
    x = torch.randn(M, K, generator=gen) * 2
    w, s = quantize_groups(torch.randn(N, K, generator=gen) * 3, G)
    b = torch.randn(N, generator=gen)
    y = _native.matvec(x, w, s, b)
    wd = dequantize_groups(w, s, K).double()
    ref = x.double() @ wd.T + b.double()
    bound = (K + 3) * EPS32 * (x.double().abs() @ wd.abs().T) + EPS32 * (b.double().abs() + ref.abs()) + 1e-12
    if isa > 0 and M <= _native.INT4_ROWS:
        bound = bound + x.abs().amax(dim=1, keepdim=True).double() / 32767 / 2 * wd.abs().sum(dim=1)
    assert y.shape == (M, N) and y.dtype == torch.float32
    assert ((y.double() - ref).abs() <= bound).all()


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_integer_products_give_nan_for_a_row_that_is_not_finite(isa, kind):
    """x is rounded to integers for int8 and int4 weights: a row holding a NaN or ±inf has no integer form, so its
    outputs are NaN (as the float product's would be), never the integers' garbage; the other rows are untouched."""
    from attnlab.adapt.quantize import quantize_groups, quantize_rows

    w, s = quantize_rows(torch.randn(6, 128)) if kind == "int8" else quantize_groups(torch.randn(6, 128), 64)
    x = torch.randn(4, 128)
    clean = _native.matvec(x, w, s)
    x[1, 5], x[2, 7] = float("nan"), float("-inf")
    y = _native.matvec(x, w, s)
    assert y[1].isnan().all() and not y[2].isfinite().any()
    assert torch.equal(y[0], clean[0]) and torch.equal(y[3], clean[3])


@needs_native
def test_int4_dequantize_equals_pytorch_unpacking(monkeypatch):
    """The kernel's dequantisation (embedding rows, the float weight) equals the PyTorch unpacking of the documented
    layout bit for bit (each weight is one product d · q); its arguments are checked as matvec's."""
    from attnlab.adapt.quantize import dequantize_groups, quantize_groups

    w, s = quantize_groups(torch.randn(7, 352), 32)  # 2 whole blocks and 3 runs
    native = _native.int4_dequantize(w, s, 352)
    monkeypatch.setattr(_native, "available", lambda: False)
    assert torch.equal(native, dequantize_groups(w, s, 352))
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="w must be uint8"):
        _native.int4_dequantize(torch.zeros(7, 352), s, 352)
    with pytest.raises(RuntimeError, match="K must be positive"):
        _native.int4_dequantize(w, s, 0)
    with pytest.raises(RuntimeError, match="i.e. \\(N, 192\\), got \\[7, 128\\]"):
        _native.int4_dequantize(w[:, :128].contiguous(), s, 352)


@needs_native
def test_int4_matvec_errors_name_the_argument():
    from attnlab.adapt.quantize import quantize_groups

    x = torch.randn(2, 128)
    w, s = quantize_groups(torch.randn(3, 128), 64)
    for args, what in [((x, w), "an int4 w needs its group scales"),
                       ((x, w, s.reshape(-1)), r"int4 w's scale must be a contiguous float32 \(N, K / G\) = \(3, K / G\)"),
                       ((x, w[:, :32].contiguous(), s), r"w must be a contiguous \(N, ceil\(K / 128\) \* 64\) tensor with "
                                                        r"K = 128, i.e. \(N, 64\), got \[3, 32\]"),
                       ((x, w, torch.ones(3, 3)), "group size G that is a multiple of 32 up to 32768 and divides K = "
                                                  "128, got 3 groups"),
                       ((x, w, torch.ones(3, 8)), "got 8 groups"),
                       ((x, w, s.double()), "contiguous float32")]:
        with pytest.raises(RuntimeError, match=what):
            _native.matvec(*args)


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_matvec_without_scale_or_bias_and_with_zero_rows(isa):
    x = torch.zeros(2, 40)
    w = torch.randn(5, 40)
    assert torch.equal(_native.matvec(x, w), torch.zeros(2, 5))
    q = torch.ones(5, 40, dtype=torch.int8)
    assert torch.equal(_native.matvec(x, q, torch.ones(5)), torch.zeros(2, 5))  # max|x| = 0: scale 1, no NaN


@needs_native
def test_matvec_propagates_nan_and_inf():
    x = torch.randn(2, 64)
    x[0, 3] = float("nan")
    y = _native.matvec(x, torch.randn(4, 64))
    assert y[0].isnan().all() and y[1].isfinite().all()
    x[0, 3] = float("inf")
    assert not _native.matvec(x, torch.randn(4, 64))[0].isfinite().any()


@needs_native
def test_matvec_errors_name_the_argument():
    x, w = torch.randn(2, 8), torch.randn(3, 8)
    for args, what in [((x.double(), w), "x must be a contiguous float32"), ((x.t(), torch.randn(3, 2)), "x must"),
                       ((x, torch.randn(3, 7)), "w must be a contiguous"), ((x, w.half()), "w must be float32"),
                       ((x, w.to(torch.int8)), "per-row scale"), ((x, w, torch.ones(4)), "scale and bias")]:
        with pytest.raises(RuntimeError, match=what):
            _native.matvec(*args)


def test_the_kernels_build_error_messages_without_iostreams():
    """A compiler that links libstdc++ statically (a custom GCC as $CXX, seen on a GPU host) gives the library a private
    copy whose stream number formatting fails: TORCH_CHECK's message lost its numbers here and crashed the process
    there. The kernels check with ATTNLAB_CHECK (csrc/native.h: the message made with std::to_string)."""
    for path in _native.CSRC.iterdir():
        text = path.read_text()
        uses = text.count("TORCH_CHECK(") - (text.count("#define ATTNLAB_CHECK(cond, ...) TORCH_CHECK(")
                                             if path.name == "native.h" else 0)
        assert uses == 0, f"{path.name}: {uses} TORCH_CHECK( — use ATTNLAB_CHECK"


@needs_native
@pytest.mark.slow
def test_an_error_message_keeps_its_numbers_with_a_static_libstdcxx(tmp_path):
    """Built with -static-libstdc++ (the toolchain above, as far as this machine can make it), an argument error still
    raises with the shapes and dtypes in its message."""
    code = ("import sys, torch\nfrom torch.utils import cpp_extension\nimport attnlab._native as n\n"
            "cpp_extension.load(name='attnlab_native', sources=[str(p) for p in n.SOURCES], build_directory=sys.argv[1],"
            " extra_cflags=list(n.CFLAGS), extra_ldflags=[*n.LDFLAGS, '-static-libstdc++'], is_python_module=False)\n"
            "try:\n    torch.ops.attnlab.matvec(torch.randn(2, 8).double(), torch.randn(3, 8), None, None)\n"
            "except RuntimeError as e:\n    print(str(e).splitlines()[0])\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("got [2, 8] Double"), out.stdout


def _run(code, **env):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@needs_native
def test_the_instruction_set_follows_aten_cpu_capability():
    code = "import attnlab._native as n; print(n.isa(), n.available(), n.status())"
    assert _run(code, ATEN_CPU_CAPABILITY="default").startswith("0 True loaded (portable C++")
    if CAP >= 1:
        assert _run(code, ATEN_CPU_CAPABILITY="avx2").startswith("1 True loaded (AVX2 + FMA")
    # a cap only lowers the set (AVX-512 asked of a CPU without it: what the CPU runs); another value is ignored
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"})
    best = out.stdout.split()[0]  # the CPU's own
    assert out.returncode == 0 and best in "012" and int(best) >= CAP, out.stderr
    assert _run(code, ATEN_CPU_CAPABILITY="avx512").startswith(f"{best} True")
    assert _run(code, ATEN_CPU_CAPABILITY="zvector").startswith(f"{best} True")


@needs_native
def test_no_call_raises_the_instruction_set_above_the_cpus():
    """The ops take no instruction set; limit_isa only lowers the library's (its argument checked)."""
    assert all("isa" not in op.default._schema.arguments[-1].name for op in
               (getattr(torch.ops.attnlab, name) for name in ("matvec", "flash_forward", "short_attention")))
    try:
        assert _native.limit_isa(0) == 0 and _native.isa() == 0
        assert _native.limit_isa(2) == CAP and _native.isa() == CAP
        for bad in (3, -1, 2**62):
            with pytest.raises(RuntimeError, match=r"limit_isa: isa must be 0 \(portable\), 1 \(AVX2\) or 2"):
                _native.limit_isa(bad)
    finally:
        _native.limit_isa(2)


def test_disabled_kernels_fall_back_to_pytorch_with_the_same_products():
    code = ("import torch, attnlab._native as n; from attnlab.nn.inference import PackedLinear\n"
            "torch.manual_seed(0); lin = torch.nn.Linear(32, 16); p = PackedLinear(lin, rows=1)\n"
            "x = torch.randn(1, 32); print(n.available(), p.native, float((p(x) - lin(x)).abs().max()) <= 1e-5)\n"
            "print(n.status())")
    first, status = _run(code, ATTNLAB_NATIVE="0").splitlines()
    assert first == "False False True" and status == "unavailable: disabled by ATTNLAB_NATIVE=0"


def test_a_failed_build_logs_one_line_and_falls_back(monkeypatch, caplog, tmp_path):
    from torch.utils import cpp_extension

    def no_compiler(**kwargs):
        raise RuntimeError("Error building extension 'attnlab_native': c++: not found")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setenv("ATTNLAB_NATIVE_DIR", str(tmp_path))
    monkeypatch.setattr(_native, "_state", {})
    with caplog.at_level(logging.WARNING, logger="attnlab._native"):
        assert not _native.available() and not _native.available()  # tried once
    assert "c++: not found" in _native.status()
    assert [r.message for r in caplog.records if "unavailable" in r.message] == \
        ["attnlab: native CPU kernels unavailable, using PyTorch's (RuntimeError: Error building extension "
         "'attnlab_native': c++: not found)"]
    with pytest.raises(RuntimeError, match="unavailable here"):
        _native.matvec(torch.randn(1, 4), torch.randn(2, 4))


def test_build_directory_is_keyed_by_torch_the_sources_and_the_compiler(monkeypatch, tmp_path):
    monkeypatch.delenv("ATTNLAB_NATIVE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    d = _native.build_directory()
    assert d.parent == tmp_path / "attnlab" / "native" and torch.__version__ in d.name
    monkeypatch.setenv("CXX", "g++")
    with_gxx = _native.build_directory()
    fake = tmp_path / "bin" / "g++"  # another compiler of the same name, first on PATH
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    assert _native.build_directory() != with_gxx  # another compiler, another folder
    monkeypatch.setenv("ATTNLAB_NATIVE_DIR", str(tmp_path / "mine"))
    assert _native.build_directory() == tmp_path / "mine"


@needs_native
@pytest.mark.parametrize("mode", ["int8", "int8-weight"])
def test_int8_layers_run_it_for_few_rows(mode):
    """Few rows of an Int8Linear (both modes) go through matvec: the int8 product of x's int16 rounding, within
    the bound above of the float64 product of x and the dequantised weight; many rows keep their own kernels."""
    from attnlab.adapt.quantize import Int8Linear

    torch.manual_seed(0)
    lin = nn.Linear(96, 40)
    q = Int8Linear.from_linear(lin, mode=mode)
    x = torch.randn(3, 96)
    wd = q.weight.double()
    ref = x.double() @ wd.T + lin.bias.double()
    sx = x.abs().amax(dim=1, keepdim=True).double() / 32767
    bound = sx / 2 * wd.abs().sum(dim=1) + 96 * EPS32 * (x.double().abs() @ wd.abs().T) + 1e-6
    assert ((q(x).double() - ref).abs() <= bound).all()
    many = torch.randn(20, 96)  # > MAX_ROWS rows: fbgemm / _weight_int8pack_mm, int8 / bf16 activations
    assert (q(many) - F.linear(many, q.weight, lin.bias)).abs().max() <= 0.05 * F.linear(many, q.weight).abs().max()


@needs_native
def test_matvec_takes_leading_dims_and_empty_inputs():
    x, w, b = torch.randn(2, 3, 40), torch.randn(5, 40), torch.randn(5)
    y = _native.matvec(x, w, None, b)
    assert y.shape == (2, 3, 5) and torch.equal(y, _native.matvec(x.reshape(6, 40), w, None, b).view(2, 3, 5))
    assert _native.matvec(torch.randn(0, 40), w).shape == (0, 5)
    assert torch.equal(_native.matvec(torch.randn(2, 0), torch.randn(5, 0)), torch.zeros(2, 5))


@needs_native
def test_a_built_library_loads_without_cpp_extension_only_from_its_digest_keyed_folder(tmp_path, monkeypatch):
    """The folder's name is a digest of the sources and the flags, so a library there is current: it loads directly
    (no cpp_extension import or ninja run); none there, a torn file, or an unkeyed $ATTNLAB_NATIVE_DIR: the build."""
    so = _native.build_directory() / "attnlab_native.so"
    assert so.is_file() and _native._load_built(so)  # (loading it again is a no-op)
    assert not _native._load_built(tmp_path / "attnlab_native.so")
    torn = tmp_path / "torn" / "attnlab_native.so"
    torn.parent.mkdir()
    whole = so.read_bytes()
    for cut in (10, 4096, len(whole) - 1):  # (the dynamic loader would crash the process on such a file)
        torn.write_bytes(whole[:cut])
        assert not _native._load_built(torn)
    monkeypatch.setenv("ATTNLAB_NATIVE_DIR", str(so.parent))
    assert not _native._load_built(so)
    flags = _native.CFLAGS
    monkeypatch.delenv("ATTNLAB_NATIVE_DIR")
    before = _native.build_directory()
    monkeypatch.setattr(_native, "CFLAGS", flags + ("-DATTNLAB_TEST",))
    assert _native.build_directory() != before  # other flags, another folder
