"""attnlab's C++ training passes for attention (the short backend's fused attention and its backward, in float32
and bf16; the pipeline's NaN/inf check) against float64 oracles on every instruction set this CPU runs, and the
backend that takes them. ε = 2⁻²⁴ per float32 rounding; a bf16 result is rounded once more, u = 2⁻⁸ of it.
"""
import pytest
import torch


from attnlab import _native, _native_train
from _native_isas import CAP, EPS32, ISA_IDS, ISAS, isa, needs_native  # noqa: F401 (isa: a fixture)

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


# ---- the fused short attention (short_attention and its backward) ------------------------------------------------

def _attention64(q, k, v, dout, scale, visible):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    p = _softmax64(q64 @ k64.transpose(-1, -2), scale, visible)
    out = p @ v64
    out.backward(dout.double())
    return out.detach(), p.detach(), q64.grad, k64.grad, v64.grad


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("Lq,Lk,D,causal,window", [(64, 64, 32, True, None), (37, 37, 20, True, None),
                                                  (10, 23, 16, True, None), (40, 40, 8, False, 7),
                                                  (50, 50, 16, True, 5), (17, 29, 24, False, None),
                                                  (33, 33, 40, True, 64)])
def test_short_attention_and_its_backward_equal_float64(isa, dtype, Lq, Lk, D, causal, window):
    """q a strided view of a packed projection (the model's layout), k and v plain. float32: P within the softmax's
    bound (n + 8 + 2 max|κ s − m|) ε, each product one more Lk- or D-term float32 sum: every result within
    (2 (Lk + D) + 16 + 2 max|κ s|) ε of its scale (max |·| over the tensor, times 4); bf16 operands are exact in
    float64, each result rounded once to bf16 (u of it) on top. P is returned where computed: the visible keys of
    each row are its float64 softmax, the invisible ones of a computed block 0."""
    gen = torch.Generator().manual_seed(Lq * 100 + Lk + D)
    B, H = 2, 3
    packed = (torch.randn(B, Lq, 3 * H * D, generator=gen) * 2).to(dtype)
    q = packed[..., H * D:2 * H * D].view(B, Lq, H, D).transpose(1, 2)
    k, v = ((torch.randn(B, H, Lk, D, generator=gen) * 2).to(dtype) for _ in range(2))
    dout = torch.randn(B, H, Lq, D, generator=gen).to(dtype)
    scale = D ** -0.5
    visible = _visible(Lq, Lk, causal, window)
    out, p = _native_train.short_attention(q, k, v, scale=scale, causal=causal, window=window)
    dq, dk, dv = _native_train.short_attention_backward(q, k, v, p, dout, scale=scale, causal=causal, window=window)
    want = _attention64(q, k, v, dout, scale, visible)
    kappa_s = float((q.double() @ k.double().transpose(-1, -2)).abs().max()) * scale
    rel = (2 * (Lk + D) + 16 + 2 * kappa_s) * EPS32 * 4
    for got, ref in zip((out, dq, dk, dv), (want[0], *want[2:])):
        assert got.dtype == dtype and got.shape == ref.shape
        last = U_BF16 if dtype == torch.bfloat16 else 0.0  # a bf16 result's own rounding
        assert (got.double() - ref).abs().max() <= (rel + last) * float(ref.abs().max())
    assert out.transpose(1, 2).is_contiguous() and dq.transpose(1, 2).is_contiguous()  # the heads merged
    computed = torch.zeros(Lq, Lk, dtype=torch.bool)  # the 16-query blocks' key ranges, 16-aligned
    for i0 in range(0, Lq, 16):
        rows = visible[i0:i0 + 16]
        cols = rows.any(0).nonzero()
        if len(cols):
            b0, b1 = int(cols.min()) // 16 * 16, min(Lk, (int(cols.max()) + 16) // 16 * 16)
            computed[i0:i0 + 16, b0:b1] = True
    got_p = p.double()[:, :, computed]
    assert (got_p - want[1][:, :, computed]).abs().max() <= rel
    assert (p[:, :, computed & ~visible] == 0).all()


@needs_native
def test_short_attention_keeps_a_nan_visible_and_a_row_that_sees_nothing_zero():
    """A NaN or +∞ score (∞ − ∞ in the softmax) makes NaN exactly the rows that see it; the causal mask keeps it
    from the others, and a query that sees no key gets 0, not NaN."""
    for bad in (float("nan"), float("inf")):
        q, k, v = (torch.randn(1, 2, 20, 8) for _ in range(3))
        q[0, 1, :, 2] = 1.0  # κ q·k = +∞ on key 3 in head 1
        k[0, 1, 3, 2] = bad
        out, p = _native_train.short_attention(q, k, v, scale=0.3, causal=True, window=None)
        assert out[0, 0].isfinite().all()
        assert out[0, 1, 3:].isnan().all() and out[0, 1, :3].isfinite().all()  # rows that see key 3
    k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    out, p = _native_train.short_attention(q, k, v, scale=0.3, causal=False, window=2)
    dq, dk, dv = _native_train.short_attention_backward(q, k, v, p, torch.ones_like(q), scale=0.3, causal=False,
                                                        window=2)
    # the queries sit at positions i − 16 (aligned to the end of the keys): 0..14 see no key within 2 of theirs
    assert (out[:, :, :15] == 0).all() and (dq[:, :, :15] == 0).all() and (out[:, :, 15:] != 0).all()


@needs_native
def test_short_attention_gives_the_same_bits_on_any_number_of_threads():
    gen = torch.Generator().manual_seed(4)
    q, k, v, g = (torch.randn(3, 4, 48, 16, generator=gen) for _ in range(4))
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out, p = _native_train.short_attention(q, k, v, scale=0.25, causal=True, window=None)
            outs.append((out, *_native_train.short_attention_backward(q, k, v, p, g, scale=0.25, causal=True,
                                                                      window=None)))
    finally:
        torch.set_num_threads(before)
    for got in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, outs[0]))


@needs_native
def test_short_attention_refuses_what_it_cannot_read():
    q, k, v = (torch.randn(2, 3, 8, 4) for _ in range(3))
    kw = dict(scale=0.5, causal=True, window=None)
    with pytest.raises(RuntimeError, match=r"k must be a float32 or bfloat16 CPU tensor \(B, H, L, D\) like q"):
        _native_train.short_attention(q, k.bfloat16(), v, **kw)
    with pytest.raises(RuntimeError, match="v must be .* with the last stride 1"):
        _native_train.short_attention(q, k, v.transpose(2, 3), **kw)
    with pytest.raises(RuntimeError, match="k must be .* like q"):
        _native_train.short_attention(q, k[:, :2], v, **kw)
    with pytest.raises(RuntimeError, match="v must have 8 rows, got 5"):
        _native_train.short_attention(q, k, v[:, :, :5], **kw)
    with pytest.raises(RuntimeError, match=r"q must be \(B, H, Lq, D\)"):
        _native_train.short_attention(q[0], k, v, **kw)
    out, p = _native_train.short_attention(q, k, v, **kw)
    with pytest.raises(RuntimeError, match=r"p must be \(B, H, Lq, Lk\) = \[2, 3, 8, 8\]"):
        _native_train.short_attention_backward(q, k, v, p[:, :, :4].contiguous(), torch.randn_like(q), **kw)
    with pytest.raises(RuntimeError, match="d_out must be"):
        _native_train.short_attention_backward(q, k, v, p, torch.randn(2, 3, 8, 4).double(), **kw)


# ---- the backend that takes them ---------------------------------------------------------------------------------

@needs_native
@pytest.mark.parametrize("path", ["fused", "formula"])
@pytest.mark.parametrize("causal,window,Lq,Lk,Hkv", [(True, None, 64, 64, 4), (True, 9, 40, 40, 2),
                                                     (False, None, 33, 33, 4), (True, None, 8, 30, 4),
                                                     (True, None, 131, 131, 4), (True, 50, 128, 140, 2),
                                                     (False, None, 130, 130, 4)])
def test_the_short_backend_takes_the_native_passes_and_equals_the_reference(causal, window, Lq, Lk, Hkv, path,
                                                                             monkeypatch):
    """float32: out and every gradient against the float64 reference backend, to the products' rounding
    (``tolerance``: an Lk- or D-term sum per layer, two layers), by each path: the fused kernel (blocks of 16
    queries: partial blocks, windows, keys past the queries — a cache) and the backend's general path
    (:func:`~attnlab.backends.short.formula`) that takes what the kernel does not."""
    from attnlab import attention
    from attnlab.backends import short
    from _tolerance import tolerance
    calls = []
    if path == "fused":
        orig = short.fused_short_attention
        monkeypatch.setattr(short, "fused_short_attention", lambda *a: calls.append(1) or orig(*a))
    else:
        orig = short.formula
        monkeypatch.setattr(short, "formula", lambda *a, **kw: calls.append(1) or orig(*a, **kw))
    if path == "formula":
        monkeypatch.setattr(short, "FUSED_KEYS", 0)
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
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        assert (got.double() - want).abs().max() <= tolerance(want, n=max(Lk, 32), depth=2)


@needs_native
@pytest.mark.parametrize("isa", [2, 1], indirect=True, ids=ISA_IDS.get)
def test_the_fused_path_takes_what_it_wins(isa, monkeypatch):
    """Up to ``short.FUSED_KEYS`` (256) keys in float32 and bf16 on every instruction set; a value width other than
    the query's, a last stride other than 1 or no query: the general path."""
    from attnlab.backends import short

    def heads(L, dtype, Dv=8):
        return torch.randn(1, 2, L, 8, dtype=dtype), torch.randn(1, 2, L, 8, dtype=dtype), torch.randn(1, 2, L, Dv,
                                                                                                       dtype=dtype)
    assert short.fused_applies(*heads(256, torch.float32)) and not short.fused_applies(*heads(257, torch.float32))
    assert short.fused_applies(*heads(256, torch.bfloat16)) and not short.fused_applies(*heads(257, torch.bfloat16))
    assert not short.fused_applies(*heads(64, torch.float32, Dv=16))
    q, k, v = heads(64, torch.float32)
    assert not short.fused_applies(q, k.transpose(2, 3).contiguous().transpose(2, 3), v)  # last stride not 1
    assert not short.fused_applies(q[:, :, :0], k, v)
    if isa > CAP:  # the rule above for every ISA; kernels only on the ISAs this CPU executes
        return
    from attnlab import attention
    q0 = q[:, :, :0].clone().requires_grad_()
    out = attention(q0, k, v, causal=False, backend="short")  # no query: an empty output, an empty gradient
    out.sum().backward()
    assert out.shape == (1, 2, 0, 8) and q0.grad.shape == q0.shape


@needs_native
@pytest.mark.parametrize("path", ["fused", "formula"])
@pytest.mark.parametrize("L", [64, 128])  # one block, two
def test_the_short_backend_in_bf16_equals_the_float64_reference_to_bf16_rounding(L, path, monkeypatch):
    """bf16 q, k, v: both paths compute in float32 and round only their results to bf16 (u = 2⁻⁸), the fused kernel
    in its registers, the general path (``short.formula``) in float32 tensors: the output within
    u (2 max|κ s| + 4) max|v|, each gradient within u (2 max|κ s| + 8) of its scale."""
    from attnlab import attention
    from attnlab.backends import short
    if path == "formula":
        monkeypatch.setattr(short, "FUSED_KEYS", 0)
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


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_finds_one_nan_or_infinity_anywhere_and_only_in_the_tensor_s_own_elements(isa, dtype):
    """The pipeline's NaN/inf check: one pass over each tensor (float32 and bf16 whose elements fill one block:
    contiguous or permuted; any other tensor by torch.isfinite), exact where a sum of finite values would overflow."""
    from attnlab.backends.dispatch import all_finite
    x = torch.randn(5, 67, 33).to(dtype)  # 11,055 elements: whole vectors, tails, more than one task
    assert _native_train.all_finite([x, x.permute(2, 0, 1), x[:, ::2]]) and all_finite(x)
    for bad in (float("nan"), float("inf"), -float("inf")):
        for where in ((0, 0, 0), (4, 66, 32), (2, 40, 17)):
            y = x.clone()
            y[where] = bad
            assert not _native_train.all_finite([y]) and not _native_train.all_finite([torch.ones(3), y.permute(1, 2, 0)])
            assert not all_finite(x, y)
            # a strided view sees only its own elements
            assert _native_train.all_finite([y[:, :, 1::2] if where[2] % 2 == 0 else y[:, :, ::2]])
    big = torch.full((64,), 3e38 if dtype != torch.float16 else 6e4).to(dtype)  # finite; their sum is not
    assert _native_train.all_finite([big]) and _native_train.all_finite([torch.ones(0), torch.arange(4)])
