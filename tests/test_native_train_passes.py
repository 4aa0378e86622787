"""attnlab's C++ element-wise training passes beside the attention's (csrc/train.cpp: RMSNorm, rotary embedding, an
FFN's gated activation, each forward and backward) against float64 oracles on every instruction set this CPU runs, in
float32 and bf16, and the modules that take them in training (RMSNorm, RotaryEmbedding, a gated FeedForward).

Tolerances (ε = 2⁻²⁴ per float32 rounding; a bf16 result is rounded once more, u = 2⁻⁸ of it; bf16 inputs are exact
in float64, so the oracles see the same numbers):
- RMSNorm forward: the n-term Σx² (n ε), the root and the division (3 ε), two products (2 ε): ≤ (n + 6) ε |y|.
  Backward: ``r (h − x̂ c)`` with ``c`` an n-term mean: ≤ (n + 8) ε r (|h| + |x̂| mean|h x̂|) + (n + 6) ε |dx|; ``dw``
  a sum over the rows: ≤ (rows + n + 8) ε Σ_rows |dy x̂|.
- RoPE: two products and a sum in float32 (3 ε of |a cos| + |b sin|); its inverse undoes it to the same order.
- Activations: ``act`` from e^x within ~2 ulps and erf within 1.5e-7 (Abramowitz & Stegun 7.1.26), a few products:
  ≤ 64 ε + 2e-7 of the scale of each result (``max(1, |a|)`` for act'(a) · a terms).
"""
import math

import pytest
import torch
import torch.nn.functional as F

from attnlab import _native

from attnlab import _native_train
from attnlab.nn.feedforward import _activate, _native_grad
from _native_isas import CAP, EPS32, ISA_IDS, ISAS, isa, needs_native  # noqa: F401 (isa: a fixture)

U_BF16 = 2.0**-8
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def _rounded(dtype):
    """The last rounding of a result in ``dtype``, relative."""
    return U_BF16 if dtype == torch.bfloat16 else 0.0


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@DTYPES
@pytest.mark.parametrize("rows,n", [(64, 256), (9, 37), (5, 3)])
def test_rms_norm_train_and_its_backward_equal_float64(isa, dtype, rows, n):
    gen = torch.Generator().manual_seed(rows + n)
    x = (torch.randn(rows, n, generator=gen) * 3).to(dtype)
    w = torch.rand(n, generator=gen) + 0.5
    dy = torch.randn(rows, n, generator=gen).to(dtype)
    eps = 1e-6
    y, r = _native_train.rms_norm_train(x, w, eps)
    xd, wd, dyd = x.double().requires_grad_(), w.double().requires_grad_(), dy.double()
    rd = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    yd = xd * rd * wd
    yd.backward(dyd)
    assert y.dtype == dtype and r.dtype == torch.float32 and r.shape == (rows,)
    assert ((r.double() - rd.detach().squeeze(-1)).abs() <= (n + 4) * EPS32 * rd.detach().squeeze(-1)).all()
    assert ((y.double() - yd.detach()).abs() <= ((n + 6) * EPS32 + _rounded(dtype)) * yd.detach().abs() + 1e-30).all()

    dx, dw = _native_train.rms_norm_train_backward(dy, x, w, r)
    xhat, h = (xd * rd).detach(), dyd * wd.detach()
    rr = rd.detach()
    tol = (n + 8) * EPS32 * rr * (h.abs() + xhat.abs() * (h * xhat).abs().mean(-1, keepdim=True))
    tol = tol + ((n + 6) * EPS32 + _rounded(dtype)) * xd.grad.abs()
    assert dx.dtype == dtype and ((dx.double() - xd.grad).abs() <= tol + 1e-30).all()
    assert dw.dtype == torch.float32
    assert ((dw.double() - wd.grad).abs() <= (rows + n + 8) * EPS32 * (dyd * xhat).abs().sum(0) + 1e-30).all()


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@DTYPES
@pytest.mark.parametrize("D", [64, 38, 2])
def test_rope_train_rotates_like_apply_rope_and_its_inverse_undoes_it(isa, dtype, D):
    from attnlab.functional.positional import apply_rope, rope_frequencies
    gen = torch.Generator().manual_seed(D)
    L = 19
    packed = (torch.randn(2, L, 3 * 3 * D, generator=gen) * 2).to(dtype)  # a packed q, k, v projection: q a view
    x = packed[..., : 3 * D].view(2, L, 3, D).transpose(1, 2)  # (B, H, L, D), strided
    cos, sin = rope_frequencies(D, torch.arange(L))
    y = _native_train.rope_train(x, cos, sin)
    ref = apply_rope(x.double(), cos.double(), sin.double())
    a, b = x.double()[..., : D // 2], x.double()[..., D // 2:]
    terms = (a.abs() + b.abs()).repeat(1, 1, 1, 2)  # |a| + |b| of each pair, at both of its places (|cos|, |sin| ≤ 1)
    assert y.dtype == dtype and y.is_contiguous() and y.shape == x.shape
    assert ((y.double() - ref).abs() <= 3 * EPS32 * terms + _rounded(dtype) * ref.abs() + 1e-30).all()
    back = _native_train.rope_train(y, cos, sin, inverse=True)  # Rᵀ R = (cos² + sin²) 1, cos and sin float32 roundings
    assert ((back.double() - x.double()).abs() <= 10 * EPS32 * terms + 3 * _rounded(dtype) * terms + 1e-30).all()


GATED = {"swiglu": F.silu, "geglu": F.gelu, "geglu_tanh": lambda a: F.gelu(a, approximate="tanh"),
         "glu": torch.sigmoid, "relu2_glu": lambda a: F.relu(a).square()}
PLAIN = {"gelu": F.gelu, "gelu_tanh": lambda a: F.gelu(a, approximate="tanh"), "relu": F.relu,
         "quick_gelu": lambda a: a * torch.sigmoid(1.702 * a), "relu2": lambda a: F.relu(a).square()}


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@DTYPES
@pytest.mark.parametrize("activation", list(GATED) + list(PLAIN))
def test_act_train_and_its_backward_equal_float64_autograd(isa, dtype, activation):
    gated = activation in GATED
    gen = torch.Generator().manual_seed(len(activation))
    n = 3 * 16 + 5  # whole vectors of every width and a tail
    g = (torch.randn(7, n, generator=gen) * 3).to(dtype)
    u = (torch.randn(7, n, generator=gen) * 2).to(dtype) if gated else None
    dh = torch.randn(7, n, generator=gen).to(dtype)
    g[0, :3] = torch.tensor([0.0, -0.0, 1e-3]).to(dtype)  # ReLU's kink and the tiny arguments
    h = _native_train.act_train(g, u, activation)
    dg, du = _native_train.act_train_backward(dh, g, u, activation)
    gd = g.double().requires_grad_()
    ud = u.double().requires_grad_() if gated else None
    fn = (GATED if gated else PLAIN)[activation]
    hd = fn(gd) * (ud if gated else 1.0)
    hd.backward(dh.double())
    scale_g = gd.detach().abs().clamp_min(1.0) * (ud.detach().abs() if gated else 1.0)
    tol = lambda want, scale: (64 * EPS32 + 2e-7) * scale + _rounded(dtype) * want.abs() + 1e-30  # noqa: E731
    assert h.dtype == dtype and ((h.double() - hd.detach()).abs() <= tol(hd.detach(), scale_g)).all()
    assert dg.dtype == dtype and ((dg.double() - gd.grad).abs() <= tol(gd.grad, scale_g * dh.double().abs())).all()
    if gated:
        assert du.dtype == dtype
        scale_u = gd.detach().abs().clamp_min(1.0) * dh.double().abs()
        assert ((du.double() - ud.grad).abs() <= tol(ud.grad, scale_u)).all()
    else:
        assert du is None
        h_kept, d = _native_train.act_with_grad(g, activation)
        assert torch.equal(h_kept, h) and d.dtype == dtype
        gd.grad = None
        fn(gd).backward(torch.ones_like(gd))  # act'(g)
        assert ((d.double() - gd.grad).abs() <= tol(gd.grad, gd.detach().abs().clamp_min(1.0))).all()
        if dtype == torch.float32:  # the kept derivative's product is the backward's own arithmetic
            assert torch.equal(dh * d, dg)


@needs_native
def test_the_passes_keep_a_nan_visible():
    x = torch.randn(3, 16)
    x[1, 4] = float("nan")
    y, r = _native_train.rms_norm_train(x, torch.ones(16), 1e-6)
    assert y[1].isnan().all() and y[[0, 2]].isfinite().all()
    g = torch.randn(2, 20)
    g[0, 3] = float("nan")
    h = _native_train.act_train(g, torch.ones(2, 20), "swiglu")
    assert h[0, 3].isnan() and h.isnan().sum() == 1
    h, d = _native_train.act_with_grad(g, "gelu")
    assert h[0, 3].isnan() and d[0, 3].isnan() and h.isnan().sum() == 1 and d.isnan().sum() == 1
    q = torch.randn(1, 1, 4, 8)
    q[0, 0, 2, 1] = float("nan")
    cos, sin = torch.rand(4, 4), torch.rand(4, 4)
    out = _native_train.rope_train(q, cos, sin)
    assert out[0, 0, 2, [1, 5]].isnan().all() and out.isnan().sum() == 2  # the NaN's pair only


@needs_native
def test_the_passes_refuse_what_they_cannot_read():
    with pytest.raises(RuntimeError, match="x must be a contiguous float32 or bfloat16 CPU tensor"):
        _native_train.rms_norm_train(torch.randn(4, 8, dtype=torch.float64), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match=r"w must be \(8,\)"):
        _native_train.rms_norm_train(torch.randn(4, 8), torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="dy must match x"):
        _native_train.rms_norm_train_backward(torch.randn(4, 7), torch.randn(4, 8), torch.ones(8), torch.ones(4))
    with pytest.raises(RuntimeError, match="last dimension contiguous"):
        _native_train.rope_train(torch.randn(1, 2, 3, 8).transpose(2, 3), torch.ones(8, 2), torch.ones(8, 2))
    with pytest.raises(RuntimeError, match=r"cos and sin must be \(L, D/2\)"):
        _native_train.rope_train(torch.randn(1, 2, 3, 8), torch.ones(3, 3), torch.ones(3, 3))
    with pytest.raises(RuntimeError, match="u must have g's shape and dtype"):
        _native_train.act_train(torch.randn(4, 8), torch.randn(4, 8).bfloat16(), "swiglu")
    with pytest.raises(RuntimeError, match="g must be a contiguous float32 or bfloat16"):
        _native_train.act_with_grad(torch.randn(8, 4).t(), "gelu")
    with pytest.raises(RuntimeError, match="keep .* is for a plain activation"):
        _native._state["act_train"](torch.randn(4, 8), torch.randn(4, 8), 1, True)
    with pytest.raises(RuntimeError, match="dh must have g's shape"):
        _native_train.act_train_backward(torch.randn(4, 9), torch.randn(4, 8), None, "gelu")


# ---- the modules that take them ----------------------------------------------------------------------------------

def _count_calls(monkeypatch, name):
    calls = []
    orig = getattr(_native_train, name)
    monkeypatch.setattr(_native_train, name, lambda *a, **k: calls.append(1) or orig(*a, **k))
    return calls


@needs_native
@pytest.mark.parametrize("shape", [(2, 5, 64), (3, 33)])
def test_rmsnorm_trains_through_the_native_pass_and_equals_float64(shape, monkeypatch):
    from attnlab.nn import RMSNorm
    fwd, bwd = _count_calls(monkeypatch, "rms_norm_train"), _count_calls(monkeypatch, "rms_norm_train_backward")
    gen = torch.Generator().manual_seed(3)
    norm = RMSNorm(shape[-1])
    with torch.no_grad():
        norm.weight.copy_(torch.rand(shape[-1], generator=gen) + 0.5)
    x = (torch.randn(shape, generator=gen) * 2).requires_grad_()
    dy = torch.randn(shape, generator=gen)
    y = norm(x)
    gx, gw = torch.autograd.grad(y, (x, norm.weight), dy)
    x64, w64 = x.detach().double().requires_grad_(), norm.weight.detach().double().requires_grad_()
    y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + norm.eps) * w64
    gx64, gw64 = torch.autograd.grad(y64, (x64, w64), dy.double())
    assert fwd == [1] and bwd == [1]
    n = shape[-1]
    assert (y.double() - y64).abs().max() <= (n + 6) * EPS32 * y64.abs().max()
    assert (gx.double() - gx64).abs().max() <= 4 * (n + 8) * EPS32 * gx64.abs().max().clamp_min(1)
    assert (gw.double() - gw64).abs().max() <= 4 * (x.numel() + 8) * EPS32 * gw64.abs().max().clamp_min(1)
    if x.dim() == 2:  # a non-contiguous x is copied first: the same values
        y_t = norm(x.detach().t().contiguous().t().requires_grad_())
        assert fwd == [1, 1] and torch.equal(y_t, y)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rotary_embedding_trains_through_the_native_pass(dtype, monkeypatch):
    from attnlab.functional.positional import apply_rope
    from attnlab.nn import RotaryEmbedding
    calls = _count_calls(monkeypatch, "rope_train")
    gen = torch.Generator().manual_seed(5)
    rope = RotaryEmbedding(16)
    packed = torch.randn(2, 7, 3 * 16 * 2, generator=gen).to(dtype).requires_grad_()
    x = packed[..., :32].view(2, 7, 2, 16).transpose(1, 2)  # (B, H, L, D) a view of the packed projection
    pos = torch.arange(7)
    y = rope(x, pos)
    dy = torch.randn(y.shape, generator=gen).to(dtype)
    (gp,) = torch.autograd.grad(y, packed, dy)
    assert calls == [1, 1]  # the forward and the backward (the rotation by −φ)
    cos, sin = rope.cos_cached[:7].double(), rope.sin_cached[:7].double()
    p64 = packed.detach().double().requires_grad_()
    y64 = apply_rope(p64[..., :32].view(2, 7, 2, 16).transpose(1, 2), cos, sin)
    (gp64,) = torch.autograd.grad(y64, p64, dy.double())
    u = 4 * EPS32 + 2 * _rounded(dtype)
    assert y.dtype == dtype and (y.double() - y64).abs().max() <= u * 2 * y64.abs().max()
    assert gp.dtype == dtype and (gp.double() - gp64).abs().max() <= u * 2 * gp64.abs().max()
    assert gp[..., 32:].eq(0).all()  # k and v's columns: no gradient from q's rotation
    with torch.no_grad():  # evaluation: PyTorch's apply_rope, the same values
        assert (rope(x, pos).double() - y64).abs().max() <= u * 4 * y64.abs().max()
    assert len(calls) == 2


@needs_native
@pytest.mark.parametrize("activation", ["swiglu", "geglu", "relu2_glu", "gelu", "relu2", "quick_gelu"])
def test_a_feedforward_trains_through_the_native_pass_and_equals_float64(activation, monkeypatch):
    from attnlab.nn import FeedForward
    fwd = _count_calls(monkeypatch, "act_train")
    bwd = _count_calls(monkeypatch, "act_train_backward")
    kept = _count_calls(monkeypatch, "act_kept_train")
    torch.manual_seed(0)
    ffn = FeedForward(16, 40, activation=activation)
    x = torch.randn(3, 5, 16, requires_grad=True)
    out = ffn(x)
    dout = torch.randn(out.shape)
    grads = torch.autograd.grad(out, (x, *ffn.parameters()), dout)
    ffn64 = FeedForward(16, 40, activation=activation).double()
    ffn64.load_state_dict(ffn.state_dict())
    x64 = x.detach().double().requires_grad_()
    out64 = ffn64(x64)
    grads64 = torch.autograd.grad(out64, (x64, *ffn64.parameters()), dout.double())
    if activation in PLAIN:  # plain: act'(g) kept in the forward, the backward one product
        assert kept == [1] and fwd == [] and bwd == []
    else:
        assert fwd == [1] and bwd == [1] and kept == []
    assert (out.double() - out64).abs().max() <= 64 * EPS32 * math.sqrt(40) * out64.abs().max().clamp_min(1)
    for got, want in zip(grads, grads64):
        assert (got.double() - want).abs().max() <= 64 * EPS32 * math.sqrt(40) * want.abs().max().clamp_min(1)
    ffn.eval()
    with torch.no_grad():  # evaluation: no native training pass
        ffn(x)
    assert len(fwd) + len(kept) == 1


@needs_native
@pytest.mark.parametrize("isa,calls", [(2, 1), (1, 0)], indirect=["isa"], ids=["avx512", "avx2"])
def test_a_bf16_gate_takes_the_native_pass_only_where_it_pays(isa, calls, monkeypatch):
    """bf16: ours is faster than PyTorch's with AVX-512 only (``benchmarks/train_passes.py``); float32 on every ISA.
    The rule for every ISA; the layer run only on the ISAs this CPU executes."""
    from attnlab.nn import FeedForward
    g = torch.randn(2, 3, 32, dtype=torch.bfloat16, requires_grad=True)
    assert _native_grad(g, g.detach()) == bool(calls) and _native_grad(g.float(), g.detach().float())
    if isa > CAP:
        return
    fwd = _count_calls(monkeypatch, "act_train")
    ffn = FeedForward(16, 32, activation="swiglu").to(torch.bfloat16)
    out = ffn(torch.randn(2, 3, 16, dtype=torch.bfloat16, requires_grad=True))
    assert out.dtype == torch.bfloat16 and len(fwd) == calls
    FeedForward(16, 32, activation="swiglu")(torch.randn(2, 3, 16, requires_grad=True))
    assert len(fwd) == calls + 1


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@pytest.mark.parametrize("activation", ["gelu", "relu2"])
def test_a_plain_bf16_activation_keeps_its_derivative_on_every_isa(isa, activation, monkeypatch):
    """Plain activations in bf16 (``benchmarks/train_passes.py``: act(g) and act'(g) in one pass, the backward one
    product, faster than PyTorch's on both ISAs): act'(g) is rounded to bf16 once more than a recomputation, so the
    gradient is within two bf16 roundings of float64."""
    from attnlab.nn import FeedForward
    kept = _count_calls(monkeypatch, "act_kept_train")
    gen = torch.Generator().manual_seed(4)
    g = (torch.randn(2, 3, 32, generator=gen) * 2).bfloat16().requires_grad_()
    dh = torch.randn(2, 3, 32, generator=gen).bfloat16()
    h = _activate(g, None, activation) if _native_grad(g, None) else None
    assert h is not None and len(kept) == 1
    (dg,) = torch.autograd.grad(h, g, dh)
    g64 = g.detach().double().requires_grad_()
    h64 = PLAIN[activation](g64)
    h64.backward(dh.double())
    bf = 2.0 ** -8
    assert h.dtype == dg.dtype == torch.bfloat16
    assert ((h.double() - h64.detach()).abs() <= bf * h64.detach().abs() + 1e-6 * g64.detach().abs()).all()
    assert ((dg.double() - g64.grad).abs() <= 2 * bf * g64.grad.abs() + 1e-6 * dh.double().abs()).all()
    x = torch.randn(2, 3, 16, dtype=torch.bfloat16, requires_grad=True)
    FeedForward(16, 32, activation=activation).to(torch.bfloat16)(x)
    assert len(kept) == 2
    with torch.no_grad():  # no gradient wanted: PyTorch's (or the inference kernels')
        FeedForward(16, 32, activation=activation).to(torch.bfloat16)(x)
    assert len(kept) == 2


def _with_grads(grads):
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    return params


CLIP_SHAPES = [(65, 128), (384, 128), (384,), (512, 128), (1,), (70000,)]  # whole and partial 2^14 chunks


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@pytest.mark.parametrize("max_norm", [1.0, 1e6])
def test_clip_grad_norm_equals_torch_and_float64(isa, max_norm):
    """The norm within the float32 rounding of a double sum (the chunks' float32 lanes: ≤ 2^14 / L terms each, so
    ≤ 2^12 ε relative), the clipped gradients within 2 ε of torch's (the same factor, rounded from a norm that close);
    a norm below max_norm leaves the gradients' bits as they were."""
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(s, generator=gen) * 0.01 for s in CLIP_SHAPES]
    want64 = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    ref = _with_grads(grads)
    norm_torch = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    ours = [g.clone() for g in grads]
    norm = _native_train.clip_grad_norm_(ours, max_norm)
    assert norm.dtype == torch.float32 and norm.dim() == 0
    assert abs(norm.item() - want64) <= 2**12 * EPS32 * want64
    assert abs(norm.item() - norm_torch.item()) <= 2**12 * EPS32 * want64
    for got, want, before in zip(ours, ref, grads):
        if max_norm >= want64:
            assert torch.equal(got, before)
        else:
            assert (got - want.grad).abs().max() <= 2**13 * EPS32 * want.grad.abs().max()
    if max_norm < want64:
        after = math.sqrt(sum(float(g.double().square().sum()) for g in ours))
        assert abs(after - max_norm) <= 2**12 * EPS32 * max_norm


@needs_native
def test_clip_grad_norm_gives_the_same_bits_on_any_number_of_threads():
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(s, generator=gen) for s in CLIP_SHAPES]
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            ours = [g.clone() for g in grads]
            outs.append((_native_train.clip_grad_norm_(ours, 0.5), ours))
    finally:
        torch.set_num_threads(before)
    for norm, ours in outs[1:]:
        assert torch.equal(norm, outs[0][0]) and all(torch.equal(a, b) for a, b in zip(ours, outs[0][1]))


@needs_native
def test_clip_grad_norm_makes_a_nan_visible_and_refuses_what_it_cannot_read():
    grads = [torch.randn(10), torch.randn(3, 4)]
    grads[1][2, 1] = float("nan")
    norm = _native_train.clip_grad_norm_(grads, 1.0)
    assert norm.isnan() and grads[0].isnan().all()  # as torch's: scaled by a NaN factor
    with pytest.raises(RuntimeError, match=r"grads\[1\] must be a contiguous float32 CPU tensor.*BFloat16"):
        _native_train.clip_grad_norm_([torch.randn(3), torch.randn(3).bfloat16()], 1.0)
    with pytest.raises(RuntimeError, match=r"grads\[0\].*not contiguous"):
        _native_train.clip_grad_norm_([torch.randn(4, 3).t()], 1.0)
    with pytest.raises(RuntimeError, match="max_norm must be a positive finite number, got 0"):
        _native_train.clip_grad_norm_([torch.randn(3)], 0.0)


@needs_native
def test_the_trainers_clip_takes_the_native_call_for_float32_and_torchs_otherwise(monkeypatch):
    from attnlab.training.optim import clip_grad_norm_
    calls = _count_calls(monkeypatch, "clip_grad_norm_")
    gen = torch.Generator().manual_seed(9)
    grads = [torch.randn(s, generator=gen) for s in [(8, 4), (4,)]]
    params = _with_grads(grads) + [torch.nn.Parameter(torch.zeros(3))]  # one without a gradient: skipped
    ref = _with_grads(grads)
    norm = clip_grad_norm_(params, 0.5)
    want = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    assert len(calls) == 1 and abs(norm.item() - want.item()) <= 16 * EPS32 * want.item()
    assert all((p.grad - r.grad).abs().max() <= 16 * EPS32 for p, r in zip(params, ref))
    half = _with_grads([g.bfloat16() for g in grads])
    norm = clip_grad_norm_(half, 0.5)  # bf16 gradients: PyTorch's clip
    assert len(calls) == 1 and norm.dtype == torch.bfloat16


@needs_native
def test_rms_norm_train_backward_gives_the_same_bits_on_any_number_of_threads():
    """dw sums fixed blocks of 32 rows, then the blocks: the partition does not follow the threads."""
    gen = torch.Generator().manual_seed(7)
    x, dy = torch.randn(1000, 64, generator=gen), torch.randn(1000, 64, generator=gen)
    w = torch.rand(64, generator=gen) + 0.5
    _, r = _native_train.rms_norm_train(x, w, 1e-6)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(_native_train.rms_norm_train_backward(dy, x, w, r))
    finally:
        torch.set_num_threads(before)
    for dx, dw in outs[1:]:
        assert torch.equal(dx, outs[0][0]) and torch.equal(dw, outs[0][1])


@needs_native
def test_the_kept_activation_refuses_a_second_differentiation_instead_of_dropping_its_term():
    """Its backward is ∂L/∂h ⊙ act'(g) with act'(g) a constant: recorded under create_graph it would miss act''(g)."""
    g = torch.randn(4, 8, requires_grad=True)
    h = _activate(g, None, "gelu")
    (dg,) = torch.autograd.grad(h.sum(), g)
    assert torch.equal(dg, _native_train.act_with_grad(g.detach(), "gelu")[1])
    with pytest.raises(RuntimeError, match=r"the FFN activation's C\+\+ pass has no second derivative"):
        torch.autograd.grad(_activate(g, None, "gelu").sum(), g, create_graph=True)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kept_activation_gives_the_same_bits_on_every_backward_and_touches_no_operand(dtype):
    """The backward multiplies ∂L/∂h ⊙ act'(g) into a new tensor: with or without ``retain_graph`` the same bits, and
    neither ∂L/∂h nor the kept act'(g) is written."""
    gen = torch.Generator().manual_seed(5)
    g = (torch.randn(4, 8, 32, generator=gen) * 2).to(dtype).requires_grad_()
    h = _activate(g, None, "gelu")
    dh = torch.randn(4, 8, 32, generator=gen).to(dtype)
    dh0 = dh.clone()
    want = dh * _native_train.act_with_grad(g.detach(), "gelu")[1]
    kept = [torch.autograd.grad(h, g, dh, retain_graph=True)[0] for _ in range(2)]
    (last,) = torch.autograd.grad(h, g, dh)
    assert all(torch.equal(d, want) for d in (*kept, last)) and torch.equal(dh, dh0)
    assert last.data_ptr() not in (dh.data_ptr(), kept[0].data_ptr(), kept[1].data_ptr())
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(h, g, dh)
    # a gradient that also flows elsewhere (h used twice): each use's share intact
    h2 = _activate(g, None, "gelu")
    (both,) = torch.autograd.grad(h2 * 2 + h2, g, dh)
    assert torch.equal(both, (dh * 2 + dh) * _native_train.act_with_grad(g.detach(), "gelu")[1])
