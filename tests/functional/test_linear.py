"""linear_attention and favor_projection against explicit float64 quadratic forms.

Oracle: the N × N matrix ``A = φ(Q) φ(K)ᵀ`` (bottom-right causal mask when causal),
``out = A V / (A 1 + eps)`` (eps = 0 by default: the formula itself), written out here. Tolerances: 1e-10 on values, 1e-9 on gradients
(float64); the FAVOR+ approximation is compared to exact softmax attention by mean abs error.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from attnlab import attention
from attnlab.functional.linear import default_num_features, favor_projection, linear_attention

B, H, HKV, L, D, DV = 2, 4, 2, 13, 6, 5
F64 = dict(dtype=torch.float64)


def qkv(lq=L, lk=L, h=H, hkv=HKV, d=D):
    return (torch.randn(B, h, lq, d, **F64), torch.randn(B, hkv, lk, d, **F64), torch.randn(B, hkv, lk, DV, **F64))


def elu1(x):
    return F.elu(x) + 1


def favor(w):
    def phi(x):
        x = x * x.shape[-1] ** -0.25
        return torch.exp(x @ w.T - (x * x).sum(-1, keepdim=True) / 2) / math.sqrt(w.shape[0])
    return phi


def quadratic(q, k, v, phi, *, causal=False, eps=0.0, key_mask=None):
    """``A V / (A 1 + eps)`` (0 where that is 0 / 0) with the full ``(Lq, Lk)`` matrix ``A = φ(Q) φ(K)ᵀ``."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    a = phi(q) @ phi(k).transpose(-1, -2)  # (B, H, Lq, Lk)
    lq, lk = a.shape[-2:]
    if causal:
        a = a * torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
    if key_mask is not None:
        a = a * key_mask[:, None, None, :]
    den = a.sum(-1, keepdim=True) + eps
    return (a @ v) / torch.where(den == 0, 1, den)  # a row with nothing to attend to: zeros


@pytest.mark.parametrize("feature_map,phi", [("elu", elu1), ("relu", F.relu)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 5, 13, 64])  # 13 = N, 64 > N, 3 and 5 do not divide N
def test_equals_quadratic_form(feature_map, phi, causal, chunk):
    q, k, v = qkv()
    out = linear_attention(q, k, v, feature_map=feature_map, causal=causal, chunk_size=chunk)
    torch.testing.assert_close(out, quadratic(q, k, v, phi, causal=causal), rtol=0, atol=1e-10)


@pytest.mark.parametrize("lq", [1, 4, 13])
def test_causal_bottom_right_alignment(lq):  # queries are the last lq positions, as in attention()
    q, k, v = qkv(lq=lq)
    out = linear_attention(q, k, v, causal=True, chunk_size=4)
    torch.testing.assert_close(out, quadratic(q, k, v, elu1, causal=True), rtol=0, atol=1e-10)


def test_gqa_equals_repeated_kv_heads():
    q, k, v = qkv()
    for causal in (False, True):
        out = linear_attention(q, k, v, causal=causal, chunk_size=4)
        rep = linear_attention(q, k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1),
                               causal=causal, chunk_size=4)
        torch.testing.assert_close(out, rep, rtol=0, atol=1e-12)


@pytest.mark.parametrize("feature_map", ["elu", "favor+"])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_equal_quadratic_form(feature_map, causal):
    q, k, v = (t.requires_grad_() for t in qkv())
    w = favor_projection(16, D, **F64)
    phi = elu1 if feature_map == "elu" else favor(w)
    kw = dict(projection=w, eps=0.0) if feature_map == "favor+" else {}
    g = torch.randn(B, H, L, DV, **F64)
    ours = torch.autograd.grad(linear_attention(q, k, v, feature_map=feature_map, causal=causal, chunk_size=4, **kw),
                               (q, k, v), g)
    ref = torch.autograd.grad(quadratic(q, k, v, phi, causal=causal, eps=kw.get("eps", 0.0)), (q, k, v), g)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)


def test_gradcheck_tiny():
    q, k, v = (t[:1, :2, :5, :3].clone().requires_grad_() for t in qkv(hkv=H))
    w = favor_projection(4, 3, **F64)
    assert torch.autograd.gradcheck(lambda q, k, v: linear_attention(q, k, v, causal=True, chunk_size=2), (q, k, v))
    assert torch.autograd.gradcheck(
        lambda q, k, v: linear_attention(q, k, v, feature_map="favor+", projection=w, causal=True, chunk_size=2),
        (q, k, v))


@pytest.mark.parametrize("causal", [False, True])
def test_gradgradcheck_tiny(causal):
    """Plain autograd throughout: a gradient taken with create_graph=True is differentiable again."""
    q, k, v = (t[:1, :2, :5, :3].clone().requires_grad_() for t in qkv(hkv=H))
    w = favor_projection(4, 3, **F64)
    for kw in (dict(), dict(feature_map="favor+", projection=w)):
        assert torch.autograd.gradgradcheck(
            lambda q, k, v: linear_attention(q, k, v, causal=causal, chunk_size=2, **kw), (q, k, v))


@pytest.mark.parametrize("feature_map", ["elu", "relu", "favor+"])
def test_causal_no_future_leak(feature_map):
    q, k, v = qkv()
    w = favor_projection(16, D, **F64)
    kw = dict(projection=w) if feature_map == "favor+" else {}
    out = linear_attention(q, k, v, feature_map=feature_map, causal=True, chunk_size=4, **kw)
    t = 6
    k2, v2 = k.clone(), v.clone()
    k2[:, :, t + 1:] = 10 * torch.randn_like(k2[:, :, t + 1:])  # large future keys would dominate a global max
    v2[:, :, t + 1:] += 100
    out2 = linear_attention(q, k2, v2, feature_map=feature_map, causal=True, chunk_size=4, **kw)
    assert torch.equal(out[:, :, :t + 1], out2[:, :, :t + 1])  # bit for bit: no later key enters
    assert not torch.allclose(out[:, :, t + 1:], out2[:, :, t + 1:])


@pytest.mark.parametrize("feature_map", ["elu", "favor+"])
@pytest.mark.parametrize("causal", [False, True])
def test_key_mask(feature_map, causal):
    q, k, v = qkv()
    keep = torch.ones(B, L, dtype=torch.bool)
    keep[0, :3] = False  # left padding
    keep[1, -4:] = False  # right padding
    w = favor_projection(16, D, **F64)
    kw = dict(projection=w, eps=0.0) if feature_map == "favor+" else {}
    phi = elu1 if feature_map == "elu" else favor(w)
    out = linear_attention(q, k, v, feature_map=feature_map, causal=causal, key_mask=keep, chunk_size=4, **kw)
    ref = quadratic(q, k, v, phi, causal=causal, key_mask=keep, eps=kw.get("eps", 0.0))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    k2, v2 = k.clone(), v.clone()
    k2[~keep[:, None, :].expand(B, HKV, L)] = 50.0
    v2[~keep[:, None, :].expand(B, HKV, L)] = float("nan")
    k2.requires_grad_(), v2.requires_grad_()
    out2 = linear_attention(q, k2, v2, feature_map=feature_map, causal=causal, key_mask=keep, chunk_size=4, **kw)
    assert torch.equal(out, out2)
    out2.sum().backward()
    assert torch.isfinite(k2.grad).all() and torch.isfinite(v2.grad).all()
    pad_grad = k2.grad[~keep[:, None, :].expand(B, HKV, L)]  # (padded keys, D)
    assert torch.equal(pad_grad, torch.zeros_like(pad_grad))


def test_fully_masked_rows_are_zero_not_nan():
    q, k, v = qkv()
    keep = torch.zeros(B, L, dtype=torch.bool)
    for fm in ("elu", "favor+"):
        for causal in (False, True):
            out = linear_attention(q, k, v, feature_map=fm, causal=causal, key_mask=keep, eps=0.0)
            assert torch.equal(out, torch.zeros_like(out))
    out = linear_attention(-q.abs(), k.abs(), v, feature_map="relu", eps=0.0)  # φ(q) = 0: empty rows
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("causal", [False, True])
def test_favor_equals_explicit_formula(causal):
    q, k, v = qkv()
    w = favor_projection(40, D, **F64)
    out = linear_attention(q, k, v, feature_map="favor+", projection=w, causal=causal, chunk_size=5, eps=0.0)
    torch.testing.assert_close(out, quadratic(q, k, v, favor(w), causal=causal, eps=0.0), rtol=1e-10, atol=1e-10)


def test_favor_error_falls_with_num_features():
    d, n = 16, 64
    errors = {}
    for m in (16, 256, 2048):
        errs = []
        for seed in range(4):
            g = torch.Generator().manual_seed(seed)
            q, k, v = (torch.randn(1, 2, n, d, generator=g, **F64) for _ in range(3))
            q, k = 0.5 * q, 0.5 * k  # moderate norms, ‖q‖ ≈ 2
            w = favor_projection(m, d, generator=g, **F64)
            approx = linear_attention(q, k, v, feature_map="favor+", projection=w, eps=0.0)
            errs.append((approx - attention(q, k, v)).abs().mean().item())
        errors[m] = sum(errs) / len(errs)
    assert errors[16] > errors[256] > errors[2048]
    assert errors[2048] < 0.01


def test_favor_projection_orthogonal_blocks_and_chi_norms():
    d, m = 8, 20  # blocks of rows [0, 8), [8, 16), [16, 20)
    w = favor_projection(m, d, generator=torch.Generator().manual_seed(1), **F64)
    assert w.shape == (m, d)
    for lo, hi in ((0, 8), (8, 16), (16, 20)):
        u = F.normalize(w[lo:hi], dim=1)
        torch.testing.assert_close(u @ u.T, torch.eye(hi - lo, **F64), rtol=0, atol=1e-12)
    big = favor_projection(8192, d, generator=torch.Generator().manual_seed(2), **F64)
    assert abs(big.pow(2).sum(1).mean().item() - d) < 0.3  # ‖w‖² ~ chi²(d): mean d, std of mean 0.04
    w2 = favor_projection(m, d, generator=torch.Generator().manual_seed(1), **F64)
    assert torch.equal(w, w2)


def test_default_num_features():
    assert default_num_features(64) == math.ceil(64 * math.log(64)) == 267
    assert default_num_features(1) == 1 and default_num_features(2) == 2
    q, k, v = qkv()
    torch.manual_seed(3)
    out = linear_attention(q, k, v, feature_map="favor+")
    torch.manual_seed(3)
    w = favor_projection(default_num_features(D), D, **F64)
    torch.testing.assert_close(out, linear_attention(q, k, v, feature_map="favor+", projection=w), rtol=0, atol=0)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(feature_map="favor+", num_features=0), ValueError, "num_features"),
    (dict(feature_map="favor+", num_features=-3), ValueError, "num_features"),
    (dict(feature_map="favor+", num_features=2.5), ValueError, "num_features"),
    (dict(feature_map="softmax"), ValueError, "feature_map"),
    (dict(feature_map="elu", num_features=8), ValueError, "num_features"),
    (dict(feature_map="favor+", projection=torch.randn(8, D + 1, **F64)), ValueError, "projection"),
    (dict(feature_map="favor+", projection=torch.randn(8, D, **F64), num_features=9), ValueError, "num_features"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
    (dict(eps=-1.0), ValueError, "eps"),
    (dict(causal=1), TypeError, "causal"),
    (dict(key_mask=torch.ones(B, L)), TypeError, "key_mask"),
    (dict(key_mask=torch.ones(B, L + 1, dtype=torch.bool)), ValueError, "key_mask"),
])
def test_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        linear_attention(*qkv(), **kwargs)


def test_bad_shapes_and_causal_lengths():
    with pytest.raises(ValueError, match="H % Hkv"):
        linear_attention(*qkv(h=3, hkv=2))
    with pytest.raises(ValueError, match="Lq <= Lk"):
        linear_attention(*qkv(lq=L + 1), causal=True)
    with pytest.raises(ValueError, match="num_features"):
        favor_projection(0, D)


@pytest.mark.parametrize("feature_map", ["elu", "relu"])
@pytest.mark.parametrize("causal", [False, True])
def test_float64_equals_the_formula_to_1e_12(feature_map, causal):
    """No stabiliser unless asked: in float64 the output is the formula to round-off (an eps of 1e-6 used
    to shift it by ~1e-8 relative), computed here by an explicit loop over the keys each query may see."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 2, 20, 8, dtype=torch.float64) for _ in range(3))
    phi = elu1 if feature_map == "elu" else torch.relu
    out = linear_attention(q, k, v, feature_map=feature_map, causal=causal, chunk_size=4)
    fq, fk = phi(q), phi(k)
    ref = torch.zeros_like(out)
    for i in range(20):
        js = range(i + 1) if causal else range(20)
        num = sum((fq[..., i, :] * fk[..., j, :]).sum(-1, keepdim=True) * v[..., j, :] for j in js)
        den = sum((fq[..., i, :] * fk[..., j, :]).sum(-1, keepdim=True) for j in js)
        ref[..., i, :] = torch.where(den == 0, 0.0, num / torch.where(den == 0, 1.0, den))
    rel = (out - ref).abs().max() / ref.abs().max()
    assert rel <= 1e-12, rel
    stabilised = linear_attention(q, k, v, feature_map=feature_map, causal=causal, chunk_size=4, eps=1e-3)
    assert not torch.allclose(stabilised, out, rtol=0, atol=1e-9)  # a stabiliser, when asked for, is applied


def test_long_sequences_do_not_refault_their_memory():
    """Causal linear attention at N=16384 (32 MiB tensors) in a fresh process with glibc's defaults: the library
    keeps freed blocks itself (attnlab._runtime.reuse_large_blocks), so calls re-fault few pages; with the
    setting refused (ATTNLAB_KEEP_MALLOC=1) every call zero-fills its blocks anew. Page faults, not seconds:
    the count does not depend on the machine's load."""
    import os
    import subprocess
    import sys

    code = (
        "import resource, torch, attnlab\n"
        "torch.set_num_threads(1)\n"
        "q, k, v = (torch.randn(1, 8, 16384, 64, requires_grad=True) for _ in range(3))\n"
        "def f():\n"
        "    attnlab.linear_attention(q, k, v, causal=True).sum().backward()\n"
        "f(); f()\n"
        "r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "for _ in range(4): f()\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    kept = int(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                              timeout=300).stdout.split()[-1])
    fresh = int(subprocess.run([sys.executable, "-c", code], env={**env, "ATTNLAB_KEEP_MALLOC": "1"},
                               capture_output=True, text=True, check=True, timeout=300).stdout.split()[-1])
    # one call touches ~1 GiB of temporaries (~260,000 pages of 4 KiB, ~1.1 M in 4 calls): with the setting, a
    # small fraction. Counted over 4 calls after 2: the heap still grows now and then while its free blocks
    # settle (measured per call: 0-65,536, never the same sequence twice), so one call alone is not the measure
    assert kept * 5 < fresh, (kept, fresh)
