"""What the tests of attnlab's C++ kernels share: the skip where they are not built, the instruction sets this CPU
runs (each test runs the kernels of every one: AVX-512, AVX2 + FMA, portable), and float32's ε per rounding."""
import pytest
import torch

from attnlab import _native

needs_native = pytest.mark.skipif(not _native.available(), reason="attnlab's native kernels are not built here "
                                  "(a C++ compiler and ninja are needed; `attnlab env` says why)")
CAP = _native._ISA_CODES.get(torch.backends.cpu.get_cpu_capability(), 0)
ISAS = [i for i in (2, 1, 0) if i <= CAP]  # the instruction sets this CPU runs
ISA_IDS = {2: "avx512", 1: "avx2", 0: "portable"}
EPS32 = 2.0**-24


@pytest.fixture
def isa(request, monkeypatch):
    """``@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)``: the kernels of that set."""
    monkeypatch.setitem(_native._state, "isa", request.param)
    return request.param
