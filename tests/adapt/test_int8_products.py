"""The int8 products of training (attnlab._native_train: int8_product, int8_linear and its backward,
csrc/int8_product.cpp, int8_train.cpp and int8_gemm.h): their int32 sums are exact, so each equals
``torch._int_mm``'s sums (or float64's) rescaled, bit for bit, on every instruction set and thread count (ε = 2⁻²⁴
per float32 rounding where a part is summed)."""
import pytest
import torch

from attnlab import _native_train
from attnlab.adapt import int8_training as I
from _native_isas import EPS32, ISA_IDS, ISAS, isa, needs_native  # noqa: F401 (isa: a fixture)

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def _exact_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The exact int32 sums of int8 ``a @ b`` by float64 (|Σ| ≤ 128² K < 2⁵³: no rounding), independent of oneDNN."""
    return (a.double() @ b.double()).to(torch.int32)


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
