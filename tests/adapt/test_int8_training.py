"""Int8 products in training (attnlab.adapt.int8_training and its C++ passes in csrc/train.cpp) against float64.

Oracles and tolerances (ε = 2⁻²⁴ per float32 rounding):
- Quantisation: the scale is the float32 quotient max|x c| / k, so it is compared exactly; every rounded value
  satisfies |q s − x c| ≤ s/2 + 3 ε |x c| + ε s (s and 1/s are float32 roundings; without FMA, the portable code,
  x c / s is rounded once more before the rounding to an integer), q ∈ [−k, k], and q is round-half-even of the
  exact product except within a few ulps of a tie.
- Dequantisation ``acc (rs cs) + b``: two float32 products and a sum, ≤ 3 ε (|acc rs cs| + |b|).
- The layer: the int32 sums are exact, so its forward equals diag(s_x) (q_x q_wᵀ) diag(s_w) + b computed in
  float64 from the same integers within the rescaling's 3 ε; against the float layer x Wᵀ + b it is off by at most
  the roundings' bound Σ_j (s_x/2 |W_oj| + s_wo/2 |x_j| + s_x s_wo / 4) — the same for both gradients.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnlab import _native_train
from attnlab.adapt import int8_training as I
from _native_isas import EPS32, ISA_IDS, ISAS, isa, needs_native  # noqa: F401 (isa: a fixture)

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
SHAPES = pytest.mark.parametrize("rows,n", [(96, 128), (37, 19), (3, 5)])  # whole and partial 16 × 16 tiles


def _half_even(v: torch.Tensor) -> torch.Tensor:
    return torch.round(v)  # torch.round rounds half to even


def _exact_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The exact int32 sums of int8 ``a @ b`` by float64 (|Σ| ≤ 128² K < 2⁵³: no rounding), independent of oneDNN."""
    return (a.double() @ b.double()).to(torch.int32)


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


def test_int_mm_is_exact_with_8_bit_left_and_7_bit_right_operands():
    """The premise of the 7-bit right operand: oneDNN's products on this CPU (and as AVX2) are exact there."""
    gen = torch.Generator().manual_seed(1)
    sign = lambda *s: torch.where(torch.rand(*s, generator=gen) < 0.5, 1, -1)  # noqa: E731
    a = (sign(300, 512) * 127).to(torch.int8)  # the worst case: every pair at full magnitude (8 bits)
    b = (sign(512, 96) * I.RIGHT).to(torch.int8)
    ref = a.double() @ b.double()
    assert torch.equal(torch._int_mm(a, b).double(), ref)
    assert torch.equal(torch._int_mm(a, b.t().contiguous().t()).double(), ref)
    assert torch.equal(torch._int_mm(a.t().contiguous().t(), b).double(), ref)


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
def test_operands_of_one_row_or_column_with_unusual_strides_give_the_exact_sums(isa):
    """A one-row or one-column operand whose size-1 dimension has a stride of 1 (``(33, 1).t()``: strides (1, 1),
    which torch calls contiguous; or 0, as pytorch/pytorch#195066 reports) made oneDNN's VNNI product (torch 2.13,
    AVX512-VNNI) return memory it never wrote; int8_product copies such a vector with the plain strides first."""
    gen = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randint(-63, 64, s, generator=gen, dtype=torch.int8)  # noqa: E731
    cases = [(r(5, 1), r(33, 1).t()), (r(7, 1).t(), r(7, 9)), (r(7, 1).t(), r(9, 7).t()), (r(1, 6).t(), r(1, 4)),
             (r(4, 1).t(), r(1, 4).t()), (r(1, 7).as_strided((1, 7), (0, 1)), r(7, 9))]  # stride 0: as inductor's
    for a, b in cases:
        rs = torch.rand(a.shape[0], generator=gen) + 0.5
        for max_inner in (I.MAX_INNER, 1):  # whole, and one inner index a part (the slices are vectors too)
            got = _native_train.int8_product(a, b, rs, max_inner=max_inner)
            want = _native_train.dequantize(_exact_mm(a, b), rs)
            assert torch.allclose(got, want, rtol=a.shape[1] * 2 * EPS32, atol=0), (a.stride(), b.stride())
        assert torch.equal(_native_train.int8_product(a, b, rs, max_inner=I.MAX_INNER), want)


@needs_native
def test_a_sum_longer_than_an_int32_holds_runs_in_exact_parts():
    gen = torch.Generator().manual_seed(2)
    a = torch.randint(-127, 128, (16, 200), generator=gen, dtype=torch.int8)
    b = torch.randint(-63, 64, (200, 24), generator=gen, dtype=torch.int8)
    rs, cs, bias = torch.rand(16, generator=gen), torch.rand(24, generator=gen), torch.randn(24, generator=gen)
    exact = rs.double()[:, None] * (a.double() @ b.double()) * cs.double() + bias.double()
    whole = _native_train.int8_product(a, b, rs, cs, bias, max_inner=I.MAX_INNER)
    parts = _native_train.int8_product(a, b, rs, cs, bias, max_inner=48)  # five parts
    terms = rs.double()[:, None] * (a.double().abs() @ b.double().abs()) * cs.double() + bias.abs().double()
    for got, roundings in ((whole, 3), (parts, 3 + 5)):  # the rescaling's, and each part's sum in float32
        assert ((got.double() - exact).abs() <= roundings * EPS32 * (terms + 1)).all()
    assert _native_train.int8_product(a, b, rs, dtype=torch.bfloat16, max_inner=48).dtype == torch.bfloat16


@pytest.fixture(params=["ours", "onednn"])
def kernel(request):
    """``_native_train.int8_kernel`` set to the param for the test (with AVX2: csrc/int8_gemm.h or torch._int_mm)."""
    before = _native_train.int8_kernel(request.param)
    yield request.param
    _native_train.int8_kernel(before)


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@pytest.mark.parametrize("M,K,N", [(768, 128, 384), (37, 44, 21), (5, 4, 16), (1, 8, 3), (130, 512, 130),
                                   (9, 30, 17), (3, 7, 19), (5, 1, 33), (70, 1001, 40), (0, 8, 5), (6, 0, 7)])
@pytest.mark.parametrize("layout", ["rows", "columns", "strided"])
@pytest.mark.parametrize("left", ["8-bit", "7-bit", "mixed"])
def test_int8_product_equals_int_mm_rescaled_bit_for_bit(isa, kernel, M, K, N, layout, left):
    """With AVX2 (isa 1) and ``int8_kernel("ours")`` int8_product runs its own kernel (csrc/int8_gemm.h: a + 128 by
    vpmaddubsw, or a + 64 with two steps' int16 sums added before one widening where a task's rows of a lie within
    ±63, the shift taken back per column, the rescaling fused, K padded to a multiple of 8) where b is within ±63,
    else torch._int_mm: either way the exact int32 sums rescaled as dequantize rescales them, so the same bits as
    torch._int_mm + dequantize, for a full 8-bit, within ±63 (at the bound) or both in one call (the last row 8-bit:
    at 768 × 128 × 384 on 2 threads one task's rows take the paired loop, the other's not), b read by rows, by
    columns (a transposed matrix) or with any strides, any M, N (partial tiles, partial panels), K not a multiple of
    16, 8 or 4 (the padded rows), and b past ±63."""
    gen = torch.Generator().manual_seed(M * 1000 + K * 10 + N)
    if left == "8-bit":
        a = torch.randint(-128, 128, (M, K), generator=gen, dtype=torch.int8)
    else:
        a = torch.randint(-63, 64, (M, K), generator=gen, dtype=torch.int8)
        if M and K:
            a[0, 0], a[-1, -1] = 63, -63  # at the bound
            if left == "mixed":
                a[-1] = torch.randint(-128, 128, (K,), generator=gen, dtype=torch.int8)
                a[-1, 0] = -128
    shape = {"rows": (K, N), "columns": (N, K), "strided": (K, 2 * N)}[layout]
    b = torch.randint(-I.RIGHT, I.RIGHT + 1, shape, generator=gen, dtype=torch.int8)
    b = {"rows": b, "columns": b.t(), "strided": b[:, ::2]}[layout]
    rs, cs, bias = torch.rand(M, generator=gen) + 0.5, torch.rand(N, generator=gen) + 0.5, torch.randn(N, generator=gen)
    acc = _exact_mm(a, b)
    for dtype in (torch.float32, torch.bfloat16):
        for kw in ({}, {"cs": cs}, {"cs": cs, "bias": bias}, {"bias": bias}):
            got = _native_train.int8_product(a, b, rs, dtype=dtype, max_inner=I.MAX_INNER, **kw)
            assert got.dtype == dtype and torch.equal(got, _native_train.dequantize(acc, rs, dtype=dtype, **kw))
    if M and K:  # one entry of b past ±63 (vpmaddubsw's int16 could saturate): torch._int_mm's own sums (oneDNN's
        # AVX2 path saturates with an 8-bit a too: what int8_product promises is its result, not the exact one)
        for big in (64, -128):
            b2 = b.clone()
            b2[K // 2, N // 2] = big
            got = _native_train.int8_product(a, b2, rs, cs, bias, max_inner=I.MAX_INNER)
            plain = b2.clone(memory_format=torch.contiguous_format)  # the plain strides (the vector test above)
            assert torch.equal(got, _native_train.dequantize(torch._int_mm(a, plain), rs, cs, bias))


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@pytest.mark.parametrize("cols", [True, False])
@DTYPES
def test_int8_linear_is_its_roundings_product_and_rescaling_in_one_call(isa, cols, dtype):
    """The layer's native calls against the passes they are made of, bit for bit."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(37, 40, generator=gen).to(dtype)
    w, b = torch.randn(24, 40, generator=gen), torch.randn(24, generator=gen)
    y, qw, sw, qxt, sxc = _native_train.int8_linear(x, w, b, left=I.LEFT, right=I.RIGHT, cols=cols, dtype=dtype)
    qx, sx = _native_train.quantize_rows(x, I.LEFT)
    qw1, sw1 = _native_train.quantize_rows(w, I.RIGHT)
    assert torch.equal(qw, qw1) and torch.equal(sw, sw1)
    want = _native_train.dequantize(torch._int_mm(qx, qw1.t()), sx, sw1, b, dtype=dtype)
    assert y.dtype == dtype and torch.equal(y, want)
    if cols:
        _, _, qxt1, sxc1, _ = _native_train.quantize_rows_cols(x, I.LEFT, I.RIGHT)
        assert torch.equal(qxt, qxt1) and torch.equal(sxc, sxc1)
    else:
        assert qxt is None and sxc is None

    g = torch.randn(37, 24, generator=gen).to(dtype)
    if not cols:
        _, _, qxt, sxc, _ = _native_train.quantize_rows_cols(x, I.LEFT, I.RIGHT)
    dx, dw, db = _native_train.int8_linear_backward(g, qw, sw, qxt, sxc, left=I.LEFT, right=I.RIGHT, dx=True, dw=True,
                                                    db=True, dx_dtype=dtype)
    qz, sz, qgt, sg, gsum = _native_train.quantize_rows_cols(g, I.LEFT, I.LEFT, sw)  # G diag(s_w) by rows, Gᵀ
    assert dx.dtype == dtype and torch.equal(dx, _native_train.dequantize(torch._int_mm(qz, qw), sz, dtype=dtype))
    assert dw.dtype == torch.float32 and torch.equal(dw, _native_train.dequantize(torch._int_mm(qgt, qxt.t()), sg, sxc))
    assert torch.equal(db, gsum)
    only_dx = _native_train.int8_linear_backward(g, qw, sw, None, None, left=I.LEFT, right=I.RIGHT, dx=True, dw=False,
                                                 db=False, dx_dtype=dtype)
    assert torch.equal(only_dx[0], dx) and only_dx[1:] == (None, None)  # a frozen layer: rows only, the same ∂L/∂x


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@DTYPES
def test_the_columns_rounding_is_laid_out_for_the_weight_gradients_product(isa, kernel, dtype):
    """Where attnlab's AVX2 product takes the weight gradient (its packing reads either layout), the layer's forward
    writes x's rounding by columns as x lies and returns its (in, T) view, no transposing pass; elsewhere transposed
    and contiguous (oneDNN's operand). The same values either way, and the same ∂L/∂W bits from either layout."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(70, 48, generator=gen).to(dtype)
    w, b = torch.randn(33, 48, generator=gen), torch.randn(33, generator=gen)
    g = torch.randn(70, 33, generator=gen).to(dtype)
    _, qw, sw, qxt, sxc = _native_train.int8_linear(x, w, b, left=I.LEFT, right=I.RIGHT, cols=True, dtype=dtype)
    _, _, qct, sc, _ = _native_train.quantize_rows_cols(x, I.LEFT, I.RIGHT)
    assert qxt.shape == qct.shape == (48, 70) and qct.is_contiguous()
    assert torch.equal(qxt, qct) and torch.equal(sxc, sc)
    laid = isa == 1 and kernel == "ours"
    assert qxt.is_contiguous() is not laid and qxt.t().is_contiguous() is laid
    grads = [_native_train.int8_linear_backward(g, qw, sw, q, sxc, left=I.LEFT, right=I.RIGHT, dx=True, dw=True,
                                                db=True, dx_dtype=dtype) for q in (qxt, qct, qct.t().contiguous().t())]
    for other in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], other))


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@DTYPES
def test_the_backward_gives_the_same_bits_on_any_thread_count(isa, kernel, dtype):
    """On 2 threads the two gradient products share the threads (attnlab's AVX2 kernel: chunks of rows taken by
    whichever thread is free; oneDNN's: one product a thread): the same integers and rescalings as on 1 or 3 threads,
    so the same bits (with AVX2 by either product kernel)."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(70, 48, generator=gen).to(dtype)
    w, b = torch.randn(33, 48, generator=gen), torch.randn(33, generator=gen)
    g = torch.randn(70, 33, generator=gen).to(dtype)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            _, qw, sw, qxt, sxc = _native_train.int8_linear(x, w, b, left=I.LEFT, right=I.RIGHT, cols=True, dtype=dtype)
            outs.append(_native_train.int8_linear_backward(g, qw, sw, qxt, sxc, left=I.LEFT, right=I.RIGHT, dx=True,
                                                           dw=True, db=True, dx_dtype=dtype))
    finally:
        torch.set_num_threads(before)
    assert outs[0][0].dtype == dtype and outs[0][1].shape == (33, 48) and outs[0][2].shape == (33,)
    for out in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out, outs[0]))


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@pytest.mark.parametrize("wide", ["dx", "dw", "both"])
def test_a_gradient_product_whose_right_operand_is_wider_than_7_bits_is_still_exact_on_2_threads(isa, kernel, wide):
    """The products sharing 2 threads take only right operands within ±63: where one (or both) holds wider entries
    that one falls back to torch._int_mm, the other still shares nothing it should not — both exact."""
    gen = torch.Generator().manual_seed(9)
    T, out, inn = 70, 33, 48
    qw = torch.randint(-127 if wide in ("dx", "both") else -63, 64, (out, inn), generator=gen, dtype=torch.int8)
    qxt = torch.randint(-127 if wide in ("dw", "both") else -63, 64, (inn, T), generator=gen, dtype=torch.int8)
    sw, sxc = torch.rand(out, generator=gen) + 0.5, torch.rand(inn, generator=gen) + 0.5
    g = torch.randn(T, out, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        dx, dw, db = _native_train.int8_linear_backward(g, qw, sw, qxt, sxc, left=I.LEFT, right=127, dx=True, dw=True,
                                                        db=True, dx_dtype=torch.float32)
    finally:
        torch.set_num_threads(before)
    qz, sz, qgt, sg, gsum = _native_train.quantize_rows_cols(g, I.LEFT, I.LEFT, sw)
    assert torch.equal(dx, _native_train.dequantize(torch._int_mm(qz, qw), sz))
    assert torch.equal(dw, _native_train.dequantize(torch._int_mm(qgt, qxt.t().contiguous()), sg, sxc))
    assert torch.equal(db, gsum)


@needs_native
def test_the_int8_kernel_setting_defaults_to_auto_returns_the_previous_one_and_refuses_others():
    assert _native_train.int8_kernel() == "auto"
    try:
        assert _native_train.int8_kernel("ours") == "auto" and _native_train.int8_kernel() == "ours"
        assert _native_train.int8_kernel("onednn") == "ours"
        with pytest.raises(ValueError, match="kernel must be one of 'auto', 'onednn', 'ours', got 'mkl'"):
            _native_train.int8_kernel("mkl")
        assert _native_train.int8_kernel() == "onednn"
    finally:
        _native_train.int8_kernel("auto")


@needs_native
def test_the_layer_calls_refuse_operands_that_do_not_agree_naming_them():
    x, w = torch.randn(8, 16), torch.randn(4, 12)
    with pytest.raises(RuntimeError, match=r"x \(T, in\) and w \(out, in\) must agree"):
        _native_train.int8_linear(x, w, None, left=I.LEFT, right=I.RIGHT, cols=True, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="levels must be in"):
        _native_train.int8_linear(x, torch.randn(4, 16), None, left=200, right=I.RIGHT, cols=True, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="must be int8"):
        _native_train.int8_product(torch.ones(4, 8), torch.ones(8, 2, dtype=torch.int8), torch.ones(4), max_inner=48)
    qw, sw = _native_train.quantize_rows(torch.randn(4, 16), I.RIGHT)
    with pytest.raises(RuntimeError, match="qxt must be"):
        _native_train.int8_linear_backward(torch.randn(8, 4), qw, sw, None, None, left=I.LEFT, right=I.RIGHT, dx=True,
                                           dw=True, db=False, dx_dtype=torch.float32)
    with pytest.raises(RuntimeError, match="qxt must be"):  # a transposed operand of the wrong width
        _native_train.int8_linear_backward(torch.randn(8, 4), qw, sw, torch.zeros(15, 8, dtype=torch.int8), sw,
                                           left=I.LEFT, right=I.RIGHT, dx=True, dw=True, db=False,
                                           dx_dtype=torch.float32)
    with pytest.raises(RuntimeError, match="qw must be int8"):
        _native_train.int8_linear_backward(torch.randn(8, 4), qw.float(), sw, None, None, left=I.LEFT, right=I.RIGHT,
                                           dx=True, dw=False, db=False, dx_dtype=torch.float32)


def _layer(i, o, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(i, o, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0, 0.5)
        if bias:
            lin.bias.normal_(0, 1)
    return lin


def _emulated(x, w, b):
    """The int8 layer's forward and gradients computed in float64 from the same integers (module docstring)."""
    qx, sx = _native_train.quantize_rows(x, I.LEFT)
    qw, sw = _native_train.quantize_rows(w, I.RIGHT)
    qxc, sxc = _native_train.quantize_rows(x.t().contiguous(), I.RIGHT)
    y = sx.double()[:, None] * (qx.double() @ qw.double().t()) * sw.double() + (b.double() if b is not None else 0)
    return y, (qw, sw, qxc, sxc)


@needs_native
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(2, 40, 64), (70, 33)])
def test_the_layer_equals_its_integer_formula_and_stays_within_the_roundings_of_the_float_layer(bias, shape):
    lin = _layer(shape[-1], 48, bias)
    ref_lin = _layer(shape[-1], 48, bias)
    I.int8_training(lin, skip=())
    assert type(lin) is I.Int8TrainingLinear and lin.training
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(*shape, generator=gen) * 2).requires_grad_()
    y = lin(x)
    x2 = x.detach().reshape(-1, shape[-1])
    y_int, (qw, sw, qxc, sxc) = _emulated(x2, lin.weight.detach(), lin.bias)
    assert y.dtype == torch.float32 and y.shape == (*shape[:-1], 48)
    assert ((y.detach().reshape(-1, 48).double() - y_int).abs() <= 3 * EPS32 * (y_int.abs() + 1)).all()

    xd = x.detach().double().requires_grad_()
    yd = F.linear(xd, ref_lin.weight.double(), None if not bias else ref_lin.bias.double())
    _, sx = _native_train.quantize_rows(x2, I.LEFT)
    W = lin.weight.detach().double()
    bound = (sx.double()[:, None] / 2 * W.abs().sum(1) + sw.double() / 2 * x2.double().abs().sum(1, keepdim=True)
             + sx.double()[:, None] * sw.double() / 4 * shape[-1])
    assert ((y.detach().reshape(-1, 48).double() - yd.detach().reshape(-1, 48)).abs() <= bound * 1.001).all()

    g = torch.randn(*shape[:-1], 48, generator=gen)
    y.backward(g)
    yd.backward(g.double())
    g2 = g.reshape(-1, 48).double()
    # ∂L/∂x = diag(s_z) q(Z) q(W) with Z = G diag(s_w); ∂L/∂W = diag(s_g) q(G)ᵀ q(X) diag(s_c), from the same integers
    qz, sz = _native_train.quantize_rows(g.reshape(-1, 48), I.LEFT, sw)
    dx_int = sz.double()[:, None] * (qz.double() @ qw.double())
    assert ((x.grad.reshape(-1, shape[-1]).double() - dx_int).abs() <= 3 * EPS32 * (dx_int.abs() + 1)).all()
    qg, sg = _native_train.quantize_rows(g.reshape(-1, 48).t().contiguous(), I.LEFT)
    dw_int = sg.double()[:, None] * (qg.double() @ qxc.double().t()) * sxc.double()
    assert ((lin.weight.grad.double() - dw_int).abs() <= 3 * EPS32 * (dw_int.abs() + 1)).all()
    if bias:
        assert ((lin.bias.grad.double() - g2.sum(0)).abs() <= (g2.shape[0] + 2) * EPS32 * g2.abs().sum(0)).all()
    else:
        assert lin.bias is None
    # and each gradient within its roundings of the float layer's (relative to its scale: the bound's form above)
    for got, ref in ((x.grad, xd.grad), (lin.weight.grad, ref_lin.weight.grad)):
        err = (got.double() - ref).abs().max() / ref.abs().max()
        assert err < 0.05, f"relative error {err:.3g}: beyond 8- and 7-bit roundings"


@needs_native
def test_a_frozen_layer_gives_its_input_the_same_gradient_and_its_weight_none():
    lin, frozen = _layer(24, 16), _layer(24, 16)
    I.int8_training(lin, skip=()), I.int8_training(frozen, skip=())
    frozen.requires_grad_(False)
    x = torch.randn(9, 24, generator=torch.Generator().manual_seed(5))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    lin(xa).square().sum().backward()
    frozen(xb).square().sum().backward()
    assert torch.equal(xa.grad, xb.grad) and frozen.weight.grad is None and frozen.bias.grad is None


@needs_native
def test_the_node_computes_only_the_gradients_asked_for_from_any_input_layout():
    """The C++ autograd node: an input without a gradient (data), a strided 3-D input, a bias-free layer; each
    gradient equal to the native backward's on the same roundings, none where none is wanted."""
    gen = torch.Generator().manual_seed(9)
    lin = _layer(24, 16)
    I.int8_training(lin, skip=())
    x = torch.randn(2, 24, 5, generator=gen).transpose(1, 2)  # (2, 5, 24), not contiguous
    g = torch.randn(2, 5, 16, generator=gen)
    y = lin(x)  # x wants no gradient
    assert y.shape == (2, 5, 16) and y.requires_grad
    y.backward(g)
    _, qw, sw, qxt, sxc = _native_train.int8_linear(x.reshape(10, 24).contiguous(), lin.weight.detach(),
                                                    lin.bias.detach(), left=I.LEFT, right=I.RIGHT, cols=True,
                                                    dtype=torch.float32)
    _, dw, db = _native_train.int8_linear_backward(g.reshape(10, 16), qw, sw, qxt, sxc, left=I.LEFT, right=I.RIGHT,
                                                   dx=False, dw=True, db=True, dx_dtype=torch.float32)
    assert torch.equal(lin.weight.grad, dw) and torch.equal(lin.bias.grad, db)
    plain = nn.Linear(24, 16, bias=False)
    I.int8_training(plain, skip=())
    xr = x.detach().clone().requires_grad_()
    plain(xr).backward(g)
    assert xr.grad.shape == x.shape and plain.weight.grad.shape == (16, 24) and plain.bias is None
    with pytest.raises(RuntimeError, match=r"x \(T, in\) and w \(out, in\) must agree, got \[3, 23\]"):
        lin(torch.randn(3, 23))


@needs_native
def test_under_bf16_autocast_the_output_is_bf16_and_the_gradients_keep_the_parameters_float32():
    lin = _layer(64, 32)
    I.int8_training(lin, skip=())
    x = torch.randn(10, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and lin.weight.grad.dtype == torch.float32 and lin.bias.grad is not None
    xb = torch.randn(10, 64).bfloat16().requires_grad_()
    lin(xb).sum().backward()  # bf16 in: bf16 out and its gradient bf16
    assert xb.grad.dtype == torch.bfloat16


def test_evaluation_no_grad_and_other_dtypes_run_the_float_layer_exactly():
    lin, ref = _layer(16, 8), _layer(16, 8)
    I.int8_training(lin, skip=())
    x = torch.randn(5, 16)
    with torch.no_grad():
        assert torch.equal(lin(x), ref(x))
    lin.eval()
    assert torch.equal(lin(x), ref(x))
    lin.train()
    lin.double(), ref.double()
    assert torch.equal(lin(x.double()), ref(x.double()))
    assert lin.state_dict().keys() == ref.state_dict().keys()


def test_int8_training_converts_every_linear_layer_but_the_head():
    from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    names = I.int8_training(model)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    heads = [n for n in linears if n not in names]
    assert len(names) == 8 and heads == ["lm_head"]
    assert all(type(dict(model.named_modules())[n]) is I.Int8TrainingLinear for n in names)


@needs_native
def test_training_with_int8_products_learns_and_the_trainer_records_it(tmp_path):
    from attnlab.training.config import TrainConfig
    from attnlab.training.trainer import Trainer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(16, 16, generator=gen)

    def batches():
        while True:
            x = torch.randn(64, 16, generator=gen)
            yield x, x @ W

    def loss_fn(m, batch):
        return F.mse_loss(m(batch[0]), batch[1]), batch[0].shape[0]

    cfg = TrainConfig(max_steps=300, lr=1e-2, min_lr=1e-3, int8_training=True, progress=False, log_every=50)
    trainer = Trainer(model, cfg, train_batches=batches(), loss_fn=loss_fn, out_dir=tmp_path)
    assert all(type(m) is I.Int8TrainingLinear for m in (model[0], model[2]))
    metrics = trainer.fit()
    losses = [r["loss"] for r in trainer.history if r.get("kind") == "train"]
    assert metrics["int8_layers"] == 2 and losses[-1] < 0.05 * losses[0]


def test_int8_training_asked_for_with_compile_is_refused(tmp_path):
    from attnlab.training.config import TrainConfig
    from attnlab.training.trainer import Trainer

    cfg = TrainConfig(int8_training=True, compile=True, progress=False)
    with pytest.raises(ValueError, match="int8_training runs eagerly: compile=True"):
        Trainer(nn.Linear(4, 4), cfg, train_batches=iter([]), loss_fn=lambda m, b: (m(b).sum(), 1),
                out_dir=tmp_path)


def test_int8_training_must_be_a_bool_or_none():
    from attnlab.training.config import TrainConfig
    with pytest.raises(ValueError, match="int8_training must be True, False or None"):
        TrainConfig(int8_training="yes")


@needs_native
@pytest.mark.parametrize("dtype,compile,converted", [("fp32", False, 2), ("bf16", False, 0), ("fp32", True, 0)])
def test_int8_training_none_takes_int8_where_the_products_would_be_fp32(tmp_path, dtype, compile, converted):
    from attnlab.training.config import TrainConfig
    from attnlab.training.trainer import Trainer

    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    cfg = TrainConfig(max_steps=1, dtype=dtype, int8_training=None, compile=compile, progress=False)
    trainer = Trainer(model, cfg, train_batches=iter([]), loss_fn=lambda m, b: (m(b).sum(), 1), out_dir=tmp_path)
    assert len(trainer.int8_layers) == converted
    assert sum(type(m) is I.Int8TrainingLinear for m in model) == converted


@needs_native
@pytest.mark.parametrize("dtype,want", [("auto", "fp32"), ("bf16", "bf16"), ("fp32", "fp32")])
def test_int8_training_asked_for_makes_auto_fp32_and_keeps_an_explicit_dtype(tmp_path, dtype, want):
    """With int8 products a run's dtype="auto" is fp32 on any CPU (bf16 autocast would only cast around the int8
    products, and the fused layer node is float32); an explicit dtype is what was asked for."""
    from attnlab.training.config import TrainConfig
    from attnlab.training.trainer import Trainer

    cfg = TrainConfig(max_steps=1, dtype=dtype, int8_training=True, progress=False)
    trainer = Trainer(nn.Sequential(nn.Linear(8, 8)), cfg, train_batches=iter([]),
                      loss_fn=lambda m, b: (m(b).sum(), 1), out_dir=tmp_path)
    assert trainer.dtype == want and len(trainer.int8_layers) == 1
    assert ("int8" in trainer.dtype_reason) == (dtype == "auto")


def _gpt_layer(C: int, heads: int, *, bias: bool = True, activation: str = "gelu", seed: int = 0) -> nn.Module:
    """A pre-norm decoder-only layer with int8 products, in training mode."""
    from attnlab.nn.block import DecoderLayer
    torch.manual_seed(seed)
    layer = DecoderLayer(C, heads, ffn_dim=4 * C, cross_attention=False, norm_first=True, dropout=0.0, bias=bias,
                         activation=activation)
    with torch.no_grad():  # LayerNorm's parameters away from 1 and 0, so their gradients are tested
        for p in layer.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape) * 0.1)
    I.int8_training(layer, skip=())
    return layer.train()


def _fused_calls(monkeypatch) -> list:
    calls = []
    fn = _native_train.gpt_block_train
    monkeypatch.setattr(_native_train, "gpt_block_train", lambda *a, **k: calls.append(1) or fn(*a, **k))
    return calls


def _layer_grads(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> tuple:
    xr = x.clone().requires_grad_()
    y = layer(xr)
    grads = torch.autograd.grad(y, (xr, *layer.parameters()), dy)
    return y.detach(), grads


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@pytest.mark.parametrize("B,L,C,heads,bias,activation", [(3, 17, 32, 2, True, "gelu"), (2, 64, 64, 4, True, "gelu"),
                                                         (2, 9, 48, 3, False, "relu"), (1, 5, 32, 4, True, "gelu_tanh"),
                                                         (2, 7, 40, 2, False, "gelu"), (3, 6, 36, 3, True, "gelu"),
                                                         (2, 5, 35, 5, True, "gelu"), (1, 6, 34, 2, False, "relu")])
def test_a_gpt_layer_trains_as_one_node_with_the_bits_of_its_modules(isa, B, L, C, heads, bias, activation,
                                                                    monkeypatch):
    """``DecoderLayer._train_native``: LN, int8 qkv, causal short attention, int8 out, residual, LN, int8 FFN with the
    kept activation, residual — the modules' own calls in one C++ node (the residuals added in the products'
    rescaling, widths 40 and 36: a last panel of 8 and of 4 columns; widths 35 and 34: panels of 3 and 2 columns, the
    scalar tails, and FFN widths 140 and 136, a last panel of 12 and of 8); output and every gradient the same bits."""
    from attnlab.nn.block import DecoderLayer
    layer = _gpt_layer(C, heads, bias=bias, activation=activation)
    gen = torch.Generator().manual_seed(3)
    x, dy = torch.randn(B, L, C, generator=gen), torch.randn(B, L, C, generator=gen)
    calls = _fused_calls(monkeypatch)
    y, grads = _layer_grads(layer, x, dy)
    assert calls == [1]
    monkeypatch.setattr(DecoderLayer, "_train_native", lambda self, x: None)
    y_ref, grads_ref = _layer_grads(layer, x, dy)
    assert calls == [1] and torch.equal(y, y_ref)
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    for name, got, want in zip(names, grads, grads_ref):
        assert got is not None and torch.equal(got, want), name


@needs_native
def test_the_one_node_layer_keeps_its_graph_for_a_second_backward_and_refuses_a_second_order(monkeypatch):
    layer = _gpt_layer(32, 2)
    calls = _fused_calls(monkeypatch)
    x = torch.randn(2, 8, 32, requires_grad=True)
    y = layer(x)
    first = torch.autograd.grad(y.square().sum(), x, retain_graph=True)[0]
    again = torch.autograd.grad(y.square().sum(), x)[0]
    assert calls == [1] and torch.equal(first, again)
    with pytest.raises(RuntimeError, match="the GPT block's one-node training pass .* has no second derivative"):
        torch.autograd.grad(layer(x).sum(), x, create_graph=True)


@needs_native
@pytest.mark.parametrize("case", ["eval", "no_grad", "dropout", "hook", "dropout_hook", "frozen", "autocast",
                                  "float_linear", "subclass", "eval_linear", "not_causal", "rotary", "long"])
def test_the_one_node_layer_steps_aside_where_the_modules_would_not_make_its_calls(case, monkeypatch):
    from attnlab.nn.block import DecoderLayer
    from attnlab.nn.positional import RotaryEmbedding
    L, kw = 8, {}
    if case in ("rotary", "dropout"):
        torch.manual_seed(0)
        layer = DecoderLayer(32, 2, ffn_dim=128, cross_attention=False, norm_first=True,
                             **({"rotary": RotaryEmbedding(16, max_positions=16)} if case == "rotary"
                                else {"dropout": 0.1}))
        I.int8_training(layer, skip=())
    else:
        layer = _gpt_layer(32, 2)
    if case == "eval":
        layer.eval()
    elif case == "hook":
        layer.ffn.w1.register_forward_hook(lambda m, i, o: None)
    elif case == "frozen":
        layer.norm2.weight.requires_grad_(False)
    elif case == "dropout_hook":
        layer.ffn.dropout.register_forward_hook(lambda m, i, o: None)
    elif case == "float_linear":
        layer.self_attn.out_proj.__class__ = nn.Linear
    elif case == "subclass":  # a subclass may compute otherwise: only the class that declares its levels
        layer.ffn.w1.__class__ = type("Sub", (I.Int8TrainingLinear,), {})
    elif case == "eval_linear":
        layer.ffn.w2.eval()
    elif case == "not_causal":
        kw = {"is_causal": False}
    elif case == "long":
        from attnlab.backends import short
        L = short.FUSED_KEYS + 1
    calls = _fused_calls(monkeypatch)
    x = torch.randn(2, L, 32, requires_grad=True)
    if case == "no_grad":
        with torch.no_grad():
            y = layer(x)
    elif case == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
    else:
        y = layer(x, **kw)
    assert calls == [] and y.shape == x.shape


@needs_native
def test_a_non_finite_projection_leaves_the_one_node_path_for_the_modules_pipeline(monkeypatch):
    """A NaN in the input makes the qkv projection non-finite: the node raises before recording anything and the
    layer runs its modules, whose attention pipeline handles it — the same result as without the node."""
    from attnlab.nn.block import DecoderLayer
    layer = _gpt_layer(32, 2)
    x = torch.randn(2, 8, 32)
    x[1, 3, 5] = float("nan")
    calls = _fused_calls(monkeypatch)
    y = layer(x.clone().requires_grad_())
    assert calls == [1]
    monkeypatch.setattr(DecoderLayer, "_train_native", lambda self, x: None)
    y_ref = layer(x.clone().requires_grad_())
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0, equal_nan=True)
    assert torch.isfinite(y[0]).all()  # the other sequence untouched


@needs_native
@pytest.mark.parametrize("weight_scale", [1e9, 1e15, 1e19])
def test_large_projections_are_scanned_and_an_overflowing_attention_leaves_the_node(weight_scale, monkeypatch):
    """Within |qkv| ≤ 1e15 (the node's bound from the roundings' scales: 1e9 × the weights) no scan is needed; past it
    (1e15 ×) the node scans qkv and the attention's output, finite: the node's result, the modules' bits; at 1e19 ×
    the scores overflow and the layer behaves exactly as its modules do."""
    from attnlab.nn.block import DecoderLayer
    layer = _gpt_layer(32, 2)
    with torch.no_grad():
        layer.self_attn.in_proj.weight.mul_(weight_scale)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2))
    calls = _fused_calls(monkeypatch)

    def run():
        try:
            return layer(x.clone().requires_grad_()).detach()
        except Exception as e:  # the pipeline may explain an overflow: both paths must say the same
            return type(e), str(e)

    got = run()
    monkeypatch.setattr(DecoderLayer, "_train_native", lambda self, x: None)
    want = run()
    assert calls == [1]
    if isinstance(want, tuple):
        assert got == want
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        assert weight_scale > 1e16 or torch.isfinite(got).all()
