"""attnlab's C++ training passes (csrc/train.cpp: the short backend's softmax and its gradient, in float32 and bf16)
against float64 oracles on every instruction set this CPU runs, and the backend that takes them.

Oracles and tolerances (ε = 2⁻²⁴ per float32 rounding; a bf16 result is rounded once more, u = 2⁻⁸ of it):
- ``softmax_rows``: the float64 softmax of the same scores (bf16 scores are exact in float64). Each ``κ s`` is one
  rounding, each e^x within ~2 ulps plus ε·|x − m| from its argument, the row sum n terms: ≤ (n + 8 + 2 max|x − m|)
  ε relative to each probability. The bf16 copy equals PyTorch's cast of the float32 one bit for bit.
- ``softmax_rows_backward``: the float64 formula from the same ``p`` and ``dp``: the n-term dot product
  (n ε Σ|dp p|), the difference and two products: ≤ κ p ((n + 4) ε (Σ|dp p| + |dp|)), plus u |ds| in bf16.
"""
import pytest
import torch


from attnlab import _native_train
from _native_isas import EPS32, ISA_IDS, ISAS, isa, needs_native  # noqa: F401 (isa: a fixture)

U_BF16 = 2.0**-8


def _visible(Lq, Lk, causal, window):
    t = torch.arange(Lq)[:, None] + Lk - Lq
    j = torch.arange(Lk)[None, :]
    ok = torch.ones(Lq, Lk, dtype=torch.bool)
    if causal:
        ok &= j <= t
    if window is not None:
        ok &= (t - j < window) if causal else ((t - j).abs() < window)
    return ok


def _softmax64(s, scale, visible):
    x = (s.double() * scale).masked_fill(~visible, float("-inf"))
    p = torch.softmax(x, dim=-1)
    return p.nan_to_num(0.0)  # rows that see nothing: 0


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("Lq,Lk,causal,window", [
    (64, 64, True, None),    # nanoGPT's CPU recipe
    (37, 37, True, None),    # rows not a multiple of any vector width
    (5, 29, True, None),     # queries at the end of the keys (a cache)
    (29, 29, True, 7),       # a causal sliding window
    (29, 29, False, 7),      # a two-sided window
    (23, 23, False, None),   # no mask
    (9, 4, True, None),      # more queries than keys: the first five rows see nothing
])
def test_softmax_rows_equals_the_float64_softmax(isa, dtype, Lq, Lk, causal, window):
    gen = torch.Generator().manual_seed(Lq * 100 + Lk)
    s = (torch.randn(6, Lq, Lk, generator=gen) * 6).to(dtype)
    scale = 0.3
    p, pc = _native_train.softmax_rows(s, scale=scale, causal=causal, window=window, cast=True)
    visible = _visible(Lq, Lk, causal, window)
    ref = _softmax64(s, scale, visible)
    assert p.dtype == torch.float32 and p.shape == s.shape
    x = s.double() * scale
    spread = (x.masked_fill(~visible, float("-inf")).amax(-1, keepdim=True) - x).masked_fill(~visible, 0).abs()
    assert ((p.double() - ref).abs() <= (Lk + 8 + 2 * spread) * EPS32 * ref + 1e-30).all()
    assert (p[:, ~visible] == 0).all()  # masked keys: exactly 0
    if dtype == torch.float32:
        assert pc is None
    else:
        assert pc.dtype == dtype and torch.equal(pc, p.to(dtype))
    if not visible.any(-1).all():  # a row with no key: all 0, no NaN
        assert (p[:, ~visible.any(-1)] == 0).all()


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
def test_softmax_rows_keeps_a_nan_or_infinite_score_visible(isa):
    s = torch.randn(2, 20, 20)
    s[0, 10, 3] = float("nan")
    s[1, 15, 0] = float("inf")
    p, _ = _native_train.softmax_rows(s, scale=1.0, causal=True, window=None, cast=False)
    assert p[0, 10, :11].isnan().all() and p[1, 15, :16].isnan().all()
    assert p[0, 10, 11:].eq(0).all()  # the masked keys stay 0
    assert p[0, 9].isfinite().all() and p[1, 14].isfinite().all()  # the other rows are untouched
    s = torch.randn(1, 20, 20)
    s[0, :, 15] = float("nan")  # key 15 is hidden from rows 0-14 by the causal mask: only rows 15-19 see it
    p, _ = _native_train.softmax_rows(s, scale=1.0, causal=True, window=None, cast=False)
    assert p[0, :15].isfinite().all() and p[0, 15:, :16].isnan().all()


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [64, 37, 3])
def test_softmax_rows_backward_equals_the_float64_formula(isa, dtype, n):
    gen = torch.Generator().manual_seed(n)
    s = torch.randn(4, n, n, generator=gen) * 3
    p, _ = _native_train.softmax_rows(s, scale=0.5, causal=True, window=None, cast=False)
    dp = (torch.randn(4, n, n, generator=gen) * 2).to(dtype)
    ds = _native_train.softmax_rows_backward(dp, p, scale=0.5)
    pd, dpd = p.double(), dp.double()
    ref = 0.5 * pd * (dpd - (dpd * pd).sum(-1, keepdim=True))
    tol = 0.5 * pd * (n + 4) * EPS32 * ((dpd * pd).abs().sum(-1, keepdim=True) + dpd.abs())
    if dtype == torch.bfloat16:
        tol = tol + U_BF16 * ref.abs()
    assert ds.dtype == dtype and ((ds.double() - ref).abs() <= tol + 1e-30).all()
    assert (ds[:, ~_visible(n, n, True, None)] == 0).all()  # P = 0 there: no gradient


@needs_native
def test_the_ops_refuse_what_they_cannot_read():
    with pytest.raises(RuntimeError, match="s must be a contiguous float32 or bfloat16 CPU tensor"):
        _native_train.softmax_rows(torch.randn(2, 4, 4, dtype=torch.float64), scale=1.0, causal=True, window=None,
                             cast=False)
    with pytest.raises(RuntimeError, match=r"s must be \(G, Lq, Lk\)"):
        _native_train.softmax_rows(torch.randn(4, 4), scale=1.0, causal=True, window=None, cast=False)
    with pytest.raises(RuntimeError, match="not contiguous"):
        _native_train.softmax_rows(torch.randn(2, 4, 4).transpose(1, 2), scale=1.0, causal=True, window=None, cast=False)
    with pytest.raises(RuntimeError, match="dp and p must be the same"):
        _native_train.softmax_rows_backward(torch.randn(2, 4, 4), torch.rand(2, 4, 5), scale=1.0)
    with pytest.raises(RuntimeError, match="p must be a contiguous float32 CPU tensor"):
        _native_train.softmax_rows_backward(torch.randn(2, 4, 4), torch.rand(2, 4, 4).bfloat16(), scale=1.0)


# ---- the backend that takes them ---------------------------------------------------------------------------------

@needs_native
@pytest.mark.parametrize("causal,window,Lq,Lk,Hkv", [(True, None, 64, 64, 4), (True, 9, 40, 40, 2),
                                                     (False, None, 33, 33, 4), (True, None, 8, 30, 4),
                                                     (True, None, 131, 131, 4), (True, 50, 128, 140, 2),
                                                     (False, None, 130, 130, 4)])
def test_the_short_backend_takes_the_native_softmax_and_equals_the_reference(causal, window, Lq, Lk, Hkv, monkeypatch):
    """float32: out and every gradient against the float64 reference backend, to the products' rounding
    (``tolerance``: an Lk- or D-term sum per layer, two layers). From 128 causal queries the backend runs two query
    blocks (``causal_blocks``; an odd count, a window, keys past the queries: a cache)."""
    from attnlab import attention
    from attnlab.backends import short
    from _tolerance import tolerance
    calls = []
    orig = short.NativeShortAttention.apply
    monkeypatch.setattr(short.NativeShortAttention, "apply", lambda *a: calls.append(1) or orig(*a))
    gen = torch.Generator().manual_seed(Lq + Lk)
    q = torch.randn(2, 4, Lq, 32, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, Hkv, Lk, 32, generator=gen, requires_grad=True) for _ in range(2))
    out = attention(q, k, v, causal=causal, window=window, backend="short")
    dout = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attention(q64, k64, v64, causal=causal, window=window, backend="reference")
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    assert calls == [1]
    assert len(short.causal_blocks(Lq, Lk, causal)) == (2 if causal and Lq >= short.CAUSAL_BLOCK_QUERIES else 1)
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        assert (got.double() - want).abs().max() <= tolerance(want, n=max(Lk, 32), depth=2)


@needs_native
@pytest.mark.parametrize("L", [64, 128])  # one block, two
def test_the_short_backend_in_bf16_equals_the_float64_reference_to_bf16_rounding(L):
    """bf16 q, k, v: the scores, P and every product are rounded to bf16 once each (u = 2⁻⁸): the output within
    u (2 max|κ s| + 4) max|v|, each gradient within u (2 max|κ s| + 8) of its scale."""
    from attnlab import attention
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, 4, L, 32, generator=gen).to(torch.bfloat16).requires_grad_() for _ in range(3))
    out = attention(q, k, v, causal=True, backend="short")
    dout = torch.randn(out.shape, generator=gen).to(torch.bfloat16)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attention(q64, k64, v64, causal=True, backend="reference")
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    kappa_s = float((q64 @ k64.transpose(-1, -2)).detach().abs().max()) * 32 ** -0.5
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max() <= U_BF16 * (2 * kappa_s + 4) * float(v64.abs().max())
    for got, want in zip(grads, ref_grads):
        assert got.dtype == torch.bfloat16
        assert (got.double() - want).abs().max() <= U_BF16 * (2 * kappa_s + 8) * float(want.abs().max())
