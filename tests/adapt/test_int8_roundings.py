"""The roundings of int8 products in training (attnlab._native_train's C++ passes, csrc/int8_quantize.cpp) against
float64.

Oracles and tolerances (ε = 2⁻²⁴ per float32 rounding):
- Quantisation: the scale is the float32 quotient max|x c| / k, so it is compared exactly; every rounded value
  satisfies |q s − x c| ≤ s/2 + 3 ε |x c| + ε s (s and 1/s are float32 roundings; without FMA, the portable code,
  x c / s is rounded once more before the rounding to an integer), q ∈ [−k, k], and q is round-half-even of the
  exact product except within a few ulps of a tie.
- Dequantisation ``acc (rs cs) + b``: two float32 products and a sum, ≤ 3 ε (|acc rs cs| + |b|).
"""
import pytest
import torch

from attnlab import _native_train
from _native_isas import EPS32, ISA_IDS, ISAS, isa, needs_native  # noqa: F401 (isa: a fixture)

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
SHAPES = pytest.mark.parametrize("rows,n", [(96, 128), (37, 19), (3, 5)])  # whole and partial 16 × 16 tiles


def _half_even(v: torch.Tensor) -> torch.Tensor:
    return torch.round(v)  # torch.round rounds half to even


def _check_rounding(q, s, x, levels):
    """q, s of x (float64, rows) rounded with one scale per row: the scale exact, every value within s/2."""
    assert q.dtype == torch.int8 and (q.abs() <= levels).all()
    m = x.abs().amax(-1)
    assert torch.equal(s, (m.float() / levels))  # float32's own quotient
    err = (q.double() * s.double()[:, None] - x).abs()
    assert (err <= s.double()[:, None] * (0.5 + EPS32) + 3 * EPS32 * x.abs() + 1e-30).all()  # s and 1/s rounded
    inv = (torch.tensor(float(levels)) / m.float()).double()
    exact = _half_even(x * inv[:, None])  # the exact product, rounded once (what an FMA gives)
    near_tie = ((x * inv[:, None]).frac().abs() - 0.5).abs() <= 4 * EPS32 * (x * inv[:, None]).abs()
    assert ((q.double() == exact) | near_tie).all()


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@DTYPES
@SHAPES
@pytest.mark.parametrize("levels", [127, 63])
def test_quantize_rows_rounds_each_row_to_its_own_scale(isa, dtype, rows, n, levels):
    gen = torch.Generator().manual_seed(rows * n + levels)
    x = (torch.randn(rows, n, generator=gen) * torch.rand(rows, 1, generator=gen) * 4).to(dtype)
    c = torch.rand(n, generator=gen) + 0.5
    q, s = _native_train.quantize_rows(x, levels)
    _check_rounding(q, s, x.double(), levels)
    q, s = _native_train.quantize_rows(x, levels, c)
    _check_rounding(q, s, (x.float() * c).double(), levels)  # x c is a float32 product in the kernel too


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@DTYPES
@SHAPES
def test_quantize_rows_cols_gives_the_rows_and_the_columns_and_their_sums(isa, dtype, rows, n):
    gen = torch.Generator().manual_seed(rows + n)
    x = (torch.randn(rows, n, generator=gen) * torch.rand(1, n, generator=gen) * 3).to(dtype)
    c = torch.rand(n, generator=gen) + 0.5
    q, s, qct, sc, total = _native_train.quantize_rows_cols(x, 127, 63, c)
    q1, s1 = _native_train.quantize_rows(x, 127, c)
    assert torch.equal(q, q1) and torch.equal(s, s1)  # the row part is quantize_rows'
    assert qct.shape == (n, rows) and qct.is_contiguous()  # the columns' rounding is written transposed
    _check_rounding(qct, sc, x.double().t(), 63)
    xd = x.double()
    assert total.dtype == torch.float32
    assert ((total.double() - xd.sum(0)).abs() <= (rows + 2) * EPS32 * xd.abs().sum(0) + 1e-30).all()


@needs_native
def test_the_column_sums_are_the_same_bits_on_any_thread_count():
    x = torch.randn(1000, 96, generator=torch.Generator().manual_seed(0))
    before = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(_native_train.quantize_rows_cols(x, 127, 63))
    finally:
        torch.set_num_threads(before)
    for out in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], out))


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
def test_a_zero_row_scales_to_0_and_a_nan_or_infinite_row_or_column_to_nan(isa):
    x = torch.randn(6, 20)
    x[1] = 0
    x[2, 3] = float("nan")
    x[4, 7] = float("inf")
    q, s, qct, sc, total = _native_train.quantize_rows_cols(x, 127, 127)
    assert s[1] == 0 and (q[1] == 0).all()
    assert s[2].isnan() and s[4].isnan() and (q[2] == 0).all() and (q[4] == 0).all()
    assert sc[3].isnan() and sc[7].isnan() and (qct[3] == 0).all() and (qct[7] == 0).all()
    assert total[3].isnan() and total[7].isinf()
    assert torch.isfinite(s[[0, 1, 3, 5]]).all() and torch.isfinite(sc[[0, 1, 2, 4]]).all()
    acc = torch._int_mm(q, torch.ones(20, 8, dtype=torch.int8))
    y = _native_train.dequantize(acc, s)
    assert y[2].isnan().all() and y[4].isnan().all() and not y[[0, 1, 3, 5]].isnan().any()  # NaN is never lost


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@DTYPES
@SHAPES
def test_dequantize_rescales_an_int32_product(isa, dtype, rows, n):
    gen = torch.Generator().manual_seed(n)
    acc = torch.randint(-2**24, 2**24, (rows, n), generator=gen, dtype=torch.int32)
    rs, cs, b = torch.rand(rows, generator=gen), torch.rand(n, generator=gen), torch.randn(n, generator=gen)
    for kw, ref in (({}, acc.double() * rs.double()[:, None]),
                    ({"cs": cs, "bias": b}, acc.double() * (rs[:, None] * cs).double() + b.double())):
        y = _native_train.dequantize(acc, rs, dtype=dtype, **kw)
        bound = 3 * EPS32 * (ref.abs() + 1) + (2.0**-8 if dtype == torch.bfloat16 else 0) * ref.abs()
        assert y.dtype == dtype and ((y.double() - ref).abs() <= bound).all()


@needs_native
def test_bad_arguments_are_refused_naming_them():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="levels must be in"):
        _native_train.quantize_rows(x, 128)
    with pytest.raises(RuntimeError, match="c must be"):
        _native_train.quantize_rows(x, 127, torch.ones(3))
    with pytest.raises(RuntimeError, match="x must be"):
        _native_train.quantize_rows_cols(x.long(), 127, 63)
    with pytest.raises(RuntimeError, match="acc must be"):
        _native_train.dequantize(torch.ones(4, 8), torch.ones(4))
    with pytest.raises(RuntimeError, match="cs must be"):
        _native_train.dequantize(torch.ones(4, 8, dtype=torch.int32), torch.ones(4), torch.ones(3))
    with pytest.raises(ValueError, match="dtype must be"):
        _native_train.dequantize(torch.ones(4, 8, dtype=torch.int32), torch.ones(4), dtype=torch.float16)
