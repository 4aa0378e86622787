"""What the tests of attnlab's C++ kernels share: the skip where they are not built, the instruction sets this CPU
runs (each test runs the kernels of every one: AVX-512, AVX2 + FMA, portable), and float32's ε per rounding.

The library chooses its set itself (the CPU's best, capped by ``ATEN_CPU_CAPABILITY``); a test runs a lower set's
kernels through :func:`attnlab._native.limit_isa`, which can only lower it: no test runs an instruction the CPU
lacks."""
import pytest

from attnlab import _native

needs_native = pytest.mark.skipif(not _native.available(), reason="attnlab's native kernels are not built here "
                                  "(a C++ compiler and ninja are needed; `attnlab env` says why)")
CAP = _native.isa()  # the set the library chose: the CPU's best, within ATEN_CPU_CAPABILITY
ISAS = [i for i in (2, 1, 0) if i <= CAP]  # the instruction sets this CPU runs
ISA_IDS = {2: "avx512", 1: "avx2", 0: "portable"}
EPS32 = 2.0**-24


@pytest.fixture
def isa(request, monkeypatch):
    """``@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)``: the kernels of that set. A set
    above :data:`CAP` (a test of a Python rule for every set) is only what :func:`attnlab._native.isa` reports: the
    kernels keep CAP's."""
    level = request.param
    if level > CAP:
        monkeypatch.setattr(_native, "isa", lambda: level)
    else:
        assert _native.limit_isa(level) == level
    yield level
    if level <= CAP:
        _native.limit_isa(2)
