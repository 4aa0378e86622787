"""attnlab's C++ FlashAttention kernel (csrc/flash_forward.cpp, flash_backward.cpp) against float64 attention with the
same mask, on every instruction set this CPU runs, and the tiled backend that calls it.

Oracle: float64 ``softmax(scale · Q Kᵀ + mask) V`` with causal / sliding-window masks written out densely
(rows that see no key: output 0, LSE −inf, no gradient), its gradients by float64 autograd.
Tolerances (float32, ε = 2⁻²⁴):
- output: each score is a D-term dot product (γ_D of scale · Σ|q_d k_d|), each exponential is within ~2 ulps, the
  weighted sum a further sum over the S visible keys of non-negative weights:
  ``(D · scale · max Σ|q k| + S + 8) ε · max|v|`` (attend_decode's bound; the block order only reorders sums).
- LSE: the same score error plus log's: ``(D · scale · max Σ|q k| + S + 8) ε`` absolute.
- gradients: three chained products (scores, dO Vᵀ, and the sum over keys or queries) of at most
  ``n = max(Lq, Lk, D)`` terms: ``tests/_tolerance.tolerance(ref, n=n, depth=3)``.
"""
import math

import pytest
import torch

import attnlab
from attnlab import _native
from attnlab.backends import tiled
from attnlab.functional import masks
from attnlab.functional.positional import alibi_slopes
from _native_isas import EPS32, ISA_IDS, ISAS, isa, needs_native  # noqa: F401 (isa: a fixture)
from _tolerance import tolerance

pytestmark = needs_native


def _dense_allowed(Lq, Lk, causal, window, spans=None, layout=None):
    """(Bs, 1, Lq, Lk) bool: what each query row sees (``layout``: ``(block table, G)``)."""
    p = torch.arange(Lq).view(-1, 1) + (Lk - Lq)
    j = torch.arange(Lk).view(1, -1)
    d = p - j
    ok = torch.ones(1, 1, Lq, Lk, dtype=torch.bool)
    if causal:
        ok = ok & (d >= 0)
    if window is not None:
        ok = ok & ((d < window) if causal else (d.abs() < window))
    if spans is not None:  # (Bs, 2, Lk): row p sees [spans[b, 0, p], spans[b, 1, p])
        lo, hi = spans[:, 0, Lk - Lq:], spans[:, 1, Lk - Lq:]
        ok = ok & ((j >= lo.unsqueeze(-1)) & (j < hi.unsqueeze(-1))).unsqueeze(1)
    if layout is not None:
        table, G = layout
        ok = ok & table.bool()[p // G, j // G]
    return ok


def _reference(q, k, v, scale, causal, window, spans=None, mod=None, slopes=None, cap=0.0, layout=None):
    """float64 (out, lse) with the mask and the mod written out; rows that see nothing give 0 and -inf."""
    Lq, Lk = q.shape[2], k.shape[2]
    ok = _dense_allowed(Lq, Lk, causal, window, spans, layout)
    G = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = q.double() @ kk.transpose(-1, -2) * scale
    dist = (torch.arange(Lk).view(1, -1) - torch.arange(Lq).view(-1, 1) - (Lk - Lq)).double()  # j - p
    if mod == "alibi":
        s = s + slopes.double().view(-1, 1, 1) * dist
    elif mod == "alibi_symmetric":
        s = s - slopes.double().view(-1, 1, 1) * dist.abs()
    elif mod == "softcap":
        s = cap * torch.tanh(s / cap)
    s = s.masked_fill(~ok, -math.inf)
    lse = torch.logsumexp(s, -1)
    w = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    return w @ vv, lse


def _inputs(B, H, Hkv, Lq, Lk, D, Dv, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, Lq, D, generator=gen), torch.randn(B, Hkv, Lk, D, generator=gen),
            torch.randn(B, Hkv, Lk, Dv, generator=gen))


def _bounds(q, k, v, scale, causal, window, spans=None, bias=0.0, layout=None):
    """(out, lse) bounds; ``bias``: the largest |mod(s) - s| (ALiBi's m·|j - p|: one more rounding of that size)."""
    qk = (q.abs().double() * scale).sum(-1).max() * k.abs().max() + bias
    S = int(_dense_allowed(q.shape[2], k.shape[2], causal, window, spans, layout).sum(-1).max())
    lse_bound = (q.shape[-1] * qk + S + 8) * EPS32
    return lse_bound * v.abs().max(), lse_bound


CASES = [  # B, H, Hkv, Lq, Lk, D, Dv, causal, window, block_q, block_k
    (2, 4, 2, 100, 130, 16, 16, True, None, 32, 48),     # keys longer than queries, GQA
    (1, 3, 1, 77, 77, 24, 24, False, 20, 16, 32),        # bidirectional window, MQA
    (1, 2, 2, 64, 64, 8, 8, True, 7, 8, 16),             # a window narrower than a block
    (2, 2, 1, 50, 90, 32, 17, False, None, 64, 64),      # no mask; Dv ≠ D, not a multiple of a vector
    (1, 1, 1, 90, 40, 16, 16, True, None, 32, 16),       # more queries than keys: the first 50 rows see nothing
    (1, 4, 4, 300, 300, 64, 64, True, None, 128, 256),   # the backend's blocks
    (1, 2, 1, 33, 33, 5, 3, True, 1, 7, 5),              # window 1: each row sees itself only
]


@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}H{c[1]}/{c[2]}L{c[3]}x{c[4]}c{int(c[7])}w{c[8]}")
@pytest.mark.parametrize("products", ["own", "aten", "auto"])
def test_forward_and_backward_equal_float64_attention(isa, case, products):
    B, H, Hkv, Lq, Lk, D, Dv, causal, window, bq, bk = case
    q, k, v = _inputs(B, H, Hkv, Lq, Lk, D, Dv, seed=Lq + Lk)
    scale = D**-0.5
    kw = dict(scale=scale, causal=causal, window=window, block_q=bq, block_k=bk, products=products)
    out, lse = _native.flash_forward(q, k, v, **kw)

    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = _reference(qd, kd, vd, scale, causal, window)
    out_bound, lse_bound = _bounds(q, k, v, scale, causal, window)
    assert out.shape == (B, H, Lq, Dv) and lse.shape == (B, H, Lq)
    assert (out.double() - ref).abs().max() <= out_bound
    seen = ref_lse.isfinite()
    assert torch.equal(lse.isfinite(), seen) and (lse.double()[seen] - ref_lse[seen]).abs().max() <= lse_bound
    assert (out[~seen] == 0).all()

    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    dq, dk, dv = _native.flash_backward(q, k, v, out, lse, d_out, **kw)
    ref.backward(d_out.double())
    n = max(Lq, Lk, D)
    for got, want in ((dq, qd.grad), (dk, kd.grad), (dv, vd.grad)):
        assert got.shape == want.shape and (got.double() - want).abs().max() <= tolerance(want, n=n, depth=3)


@pytest.mark.parametrize("L,D,window,spans,block_k,threads", [
    (200, 16, None, False, 32, 4),    # causal: the parts' row ranges run to the end
    (300, 16, 40, False, 16, 4),      # a window: each part's rows are its keys plus the window
    (240, 16, None, True, 16, 4),     # packed documents: rows bounded by the spans
    # 64 parts of a causal 4096 would hold ~64 · 2048 rows · 2 heads · 32 = 8.4M floats > max(4 |Q|, 2²²): halved
    (4096, 32, None, False, 64, 64),
], ids=["causal", "window", "documents", "fewer-parts"])
def test_the_key_blocks_split_across_threads_when_kv_heads_are_fewer(L, D, window, spans, block_k, threads):
    """B · Hkv < threads: each kv head's key blocks are split into parts, each summing dQ over the rows that see its
    keys in a buffer of its own; the result equals one task per kv head (one thread) up to summation order."""
    q, k, v = _inputs(1, 2, 1, L, L, D, D, seed=3)
    ids = torch.repeat_interleave(torch.arange(6), L // 6 + 1)[:L]
    kw = dict(scale=0.25, causal=True, window=window, block_q=32, block_k=block_k,
              spans=masks.document_mod(ids.unsqueeze(0)).key_spans(L) if spans else None)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out, lse = _native.flash_forward(q, k, v, **kw)
        d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
        split = _native.flash_backward(q, k, v, out, lse, d_out, **kw)
        torch.set_num_threads(1)
        whole = _native.flash_backward(q, k, v, out, lse, d_out, **kw)
    finally:
        torch.set_num_threads(before)
    assert whole[0].abs().max() > 0
    for a, b in zip(split, whole):  # the same sums, grouped differently
        assert (a - b).abs().max() <= tolerance(b, n=L, depth=3)


def test_nan_and_overflow_give_nan_and_the_arguments_are_checked():
    q, k, v = _inputs(1, 2, 2, 16, 16, 8, 8, seed=4)
    q[0, 0, 5, 0] = float("nan")
    out, _ = _native.flash_forward(q, k, v, scale=0.3, causal=True, window=None, block_q=8, block_k=8)
    assert out[0, 0, 5].isnan().all() and out[0, 0, :5].isfinite().all() and out[0, 1].isfinite().all()
    big = torch.full_like(k, 3e38)  # scores overflow to inf: NaN, as softmax's own arithmetic gives
    out, _ = _native.flash_forward(q.abs() + 1, big, v, scale=1.0, causal=False, window=None, block_q=8, block_k=8)
    assert out.isnan().all()
    q, k, v = _inputs(1, 2, 2, 16, 16, 8, 8, seed=4)
    kw = dict(scale=1.0, causal=True, window=None, block_q=8, block_k=8)
    for args, what in [((q.double(), k, v), "q must be a contiguous float32"),
                       ((q, k.transpose(2, 3), v), "k must be a contiguous"),
                       ((q, k[:, :1], v), "k must be .B, Hkv, Lk, D. and v"),
                       ((q[:, :1].expand(1, 3, 16, 8).contiguous(), k, v), "multiple of k's"),
                       ((q, k, v[:, :, :5].contiguous()), "k must be .B, Hkv, Lk, D. and v"),
                       ((q[0], k, v), "4-D")]:
        with pytest.raises(RuntimeError, match=what):
            _native.flash_forward(*args, **kw)
    with pytest.raises(RuntimeError, match="block sizes"):
        _native.flash_forward(q, k, v, **{**kw, "block_k": 0})
    out, lse = _native.flash_forward(q, k, v, **kw)
    with pytest.raises(RuntimeError, match="out and d_out must be"):
        _native.flash_backward(q, k, v, out, lse, out[:, :, :4].contiguous(), **kw)
    with pytest.raises(ValueError, match="products must be one of 'auto', 'aten', 'own', got 'blas'"):
        _native.flash_forward(q, k, v, **kw, products="blas")
    with pytest.raises(ValueError, match="mod must be one of"):
        _native.flash_backward(q, k, v, out, lse, out, **kw, mod="relu")


def _doc_spans(B, L, seed):
    """(B, 2, L): random packed documents (runs of 1-40 positions)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.cumsum(torch.rand(B, L, generator=gen) < 0.06, dim=1)
    return ids, masks._document_spans(ids, L)


MOD_CASES = [  # mod, causal, window, documents, Lq, Lk
    ("alibi", True, None, False, 150, 150),
    ("alibi_symmetric", False, 40, False, 120, 150),
    ("softcap", True, None, True, 150, 150),
    (None, True, None, True, 150, 150),       # packed documents
    (None, False, None, True, 130, 150),      # documents, bidirectional, fewer queries
    ("alibi", True, 30, True, 150, 150),
    ("softcap", False, None, False, 70, 90),
]


@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
def test_softcap_stays_at_round_off_for_every_cap(isa):
    """c · tanh(s / c) is s itself, to round-off, once c ≫ |s|: no cancellation may eat its digits at any cap."""
    B, H, L, D = 1, 2, 70, 16
    q, k, v = _inputs(B, H, H, L, L, D, D, seed=3)
    q = q * 3
    out_bound, lse_bound = _bounds(q, k, v, D**-0.5, True, None)
    for cap in [1.0, 10.0, 1e2, 1e4, 1e6, 1e8, 1e12, 1e20, 1e30]:
        kw = dict(scale=D**-0.5, causal=True, window=None, block_q=32, block_k=48, mod="softcap", cap=cap)
        out, lse = _native.flash_forward(q, k, v, **kw)
        qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
        ref, ref_lse = _reference(qd, kd, vd, D**-0.5, True, None, mod="softcap", cap=cap)
        assert (out.double() - ref).abs().max() <= out_bound, cap
        assert (lse.double() - ref_lse).abs().max() <= lse_bound, cap
        d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        grads = _native.flash_backward(q, k, v, out, lse, d_out, **kw)
        ref.backward(d_out.double())
        for got, want in zip(grads, (qd.grad, kd.grad, vd.grad)):
            assert (got.double() - want).abs().max() <= tolerance(want, n=max(L, D), depth=3), cap


@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@pytest.mark.parametrize("case", MOD_CASES, ids=lambda c: f"{c[0]}-c{int(c[1])}-w{c[2]}-doc{int(c[3])}-{c[4]}x{c[5]}")
def test_mods_and_spans_equal_float64_attention(isa, case):
    mod, causal, window, docs, Lq, Lk = case
    B, H, Hkv, D = 2, 4, 2, 16
    q, k, v = _inputs(B, H, Hkv, Lq, Lk, D, D, seed=Lq + 7)
    q = q * 3  # scores of several units: softcap bends them
    spans = _doc_spans(B, Lk, seed=Lk)[1] if docs else None
    slopes = alibi_slopes(H) if mod and mod.startswith("alibi") else None
    cap = 2.5 if mod == "softcap" else 0.0
    kw = dict(scale=D**-0.5, causal=causal, window=window, block_q=32, block_k=48, spans=spans, mod=mod,
              slopes=slopes, cap=cap)
    out, lse = _native.flash_forward(q, k, v, **kw)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = _reference(qd, kd, vd, D**-0.5, causal, window, spans, mod, slopes, cap)
    bias = float(slopes.max()) * Lk if slopes is not None else 0.0
    out_bound, lse_bound = _bounds(q, k, v, D**-0.5, causal, window, spans, bias)
    assert (out.double() - ref).abs().max() <= out_bound
    seen = ref_lse.isfinite()
    assert torch.equal(lse.isfinite(), seen) and (lse.double()[seen] - ref_lse[seen]).abs().max() <= lse_bound

    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = _native.flash_backward(q, k, v, out, lse, d_out, **kw)
    ref.backward(d_out.double())
    for got, want in zip(grads, (qd.grad, kd.grad, vd.grad)):
        assert (got.double() - want).abs().max() <= tolerance(want, n=max(Lq, Lk, D), depth=3)


@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@pytest.mark.parametrize("G,Lq,Lk,causal,window,mod", [
    (8, 100, 100, False, None, None), (8, 76, 100, True, None, "alibi"), (16, 130, 130, False, 40, "softcap"),
    (4, 37, 45, False, None, None)], ids=["bigbird", "causal-alibi", "window-softcap", "ragged"])
def test_a_block_layout_equals_float64_attention_with_its_dense_mask(isa, G, Lq, Lk, causal, window, mod):
    B, H, Hkv, D = 2, 4, 2, 16
    q, k, v = _inputs(B, H, Hkv, Lq, Lk, D, D, seed=G + Lq)
    n = -(-Lk // G)
    table = torch.rand(n, n, generator=torch.Generator().manual_seed(G)) < 0.3
    table[0, :] = table[:, 0] = True  # a global block
    table[3, :] = False                # a query block that sees nothing
    layout = (table.to(torch.uint8), G)
    slopes = alibi_slopes(H) if mod == "alibi" else None
    kw = dict(scale=D**-0.5, causal=causal, window=window, layout=layout[0], granularity=G, mod=mod, slopes=slopes,
              cap=2.0 if mod == "softcap" else 0.0)
    out, lse = _native.flash_forward(q, k, v, block_q=G, block_k=3 * G, **kw)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = _reference(qd, kd, vd, D**-0.5, causal, window, None, mod, slopes, kw["cap"], layout)
    bias = float(slopes.max()) * Lk if slopes is not None else 0.0
    out_bound, lse_bound = _bounds(q, k, v, D**-0.5, causal, window, None, bias, layout)
    assert (out.double() - ref).abs().max() <= out_bound
    seen = ref_lse.isfinite()
    assert torch.equal(lse.isfinite(), seen) and (lse.double()[seen] - ref_lse[seen]).abs().max() <= lse_bound
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    grads = _native.flash_backward(q, k, v, out, lse, d_out, block_q=5 * G, block_k=G, **kw)
    ref.backward(d_out.double())
    for got, want in zip(grads, (qd.grad, kd.grad, vd.grad)):
        assert (got.double() - want).abs().max() <= tolerance(want, n=max(Lq, Lk, D), depth=3)
    with pytest.raises(RuntimeError, match="must be one block"):
        _native.flash_forward(q, k, v, block_q=2 * G, block_k=G, **kw)


def test_document_spans_are_each_positions_run_and_none_for_a_scattered_document():
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [5, 6, 6, 6, 6, 6]])
    spans = masks._document_spans(ids, 6)
    assert spans.tolist() == [[[0, 0, 2, 2, 2, 5], [2, 2, 5, 5, 5, 6]], [[0, 1, 1, 1, 1, 1], [1, 6, 6, 6, 6, 6]]]
    allowed = _dense_allowed(6, 6, False, None, spans)[:, 0]
    assert torch.equal(allowed, ids.unsqueeze(-1) == ids.unsqueeze(-2))  # the same mask as the mod's
    assert masks._document_spans(torch.tensor([0, 1, 0]).unsqueeze(0), 3) is None  # document 0 in two runs
    assert masks._document_spans(ids, 7) is None                                    # not the keys' length
    mod = masks.document_mod(ids)
    assert mod.key_spans(6) is mod.key_spans(6)  # computed once per length, not at every layer's call
    p = torch.arange(8)
    prefix = masks.prefix_lm_mod(3)
    assert torch.equal(_dense_allowed(8, 8, False, None, prefix.key_spans(8))[0, 0],
                       prefix(0, 0, p.view(-1, 1), p.view(1, -1)))


def _spy(monkeypatch):
    calls = []
    orig = _native.flash_forward
    monkeypatch.setattr(_native, "flash_forward", lambda *a, **kw: calls.append(kw) or orig(*a, **kw))
    return calls


@pytest.mark.parametrize("causal,window", [(True, None), (True, 64), (False, 48), (False, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tiled_backend_runs_the_kernel_and_equals_its_pytorch_loop(causal, window, dtype, monkeypatch):
    q, k, v = (t.to(dtype).requires_grad_() for t in _inputs(2, 4, 2, 300, 300, 32, 32, seed=5))
    d_out = torch.randn(2, 4, 300, 32, generator=torch.Generator().manual_seed(6)).to(dtype)
    calls = _spy(monkeypatch)
    out = attnlab.attention(q, k, v, causal=causal, window=window, backend="tiled")
    out.backward(d_out)
    got = [out.detach(), q.grad, k.grad, v.grad]
    assert len(calls) == 1 and out.dtype == dtype and all(g.dtype == dtype for g in got[1:])

    for t in (q, k, v):
        t.grad = None
    monkeypatch.setattr(tiled, "native_applies", lambda q: False)
    ref = attnlab.attention(q, k, v, causal=causal, window=window, backend="tiled")
    ref.backward(d_out)
    want = [ref.detach(), q.grad, k.grad, v.grad]
    assert len(calls) == 1  # the second call ran the PyTorch path
    for a, b in zip(got, want):  # bf16: both compute in float32 and round the result once
        tol = tolerance(b.float(), n=300, depth=3) if dtype == torch.float32 else 2 * 2.0**-8 * b.float().abs().max()
        assert (a.float() - b.float()).abs().max() <= tol


def _mods(kind, B, H, L):
    if kind == "alibi":
        return dict(causal=True, score_mod=attnlab.ALiBi(H).score_mod())
    if kind == "softcap":
        return dict(causal=True, score_mod=masks.softcap_score_mod(3.0))
    if kind == "documents":
        return dict(causal=True, mask_mod=masks.document_mod(_doc_spans(B, L, seed=9)[0]))
    if kind == "bigbird":
        return dict(mask_mod=masks.bigbird_mod(16, seq_len=L, num_random_blocks=2))
    return dict(mask_mod=masks.prefix_lm_mod(40))


@pytest.mark.parametrize("kind", ["alibi", "softcap", "documents", "prefix", "bigbird"])
def test_the_tiled_backend_runs_the_kernel_for_its_mods_and_masks(kind, monkeypatch):
    q, k, v = (t.requires_grad_() for t in _inputs(2, 4, 2, 200, 200, 32, 32, seed=8))
    d_out = torch.randn(2, 4, 200, 32, generator=torch.Generator().manual_seed(6))
    kw = _mods(kind, 2, 4, 200)
    calls = _spy(monkeypatch)
    results = []
    for native in (True, False):
        monkeypatch.setattr(tiled, "native_applies", lambda q, on=native: on and q.dtype == torch.float32)
        for t in (q, k, v):
            t.grad = None
        out = attnlab.attention(q, k, v, backend="tiled", **kw)
        out.backward(d_out)
        results.append([out.detach(), q.grad, k.grad, v.grad])
    assert len(calls) == 1  # the first run
    for a, b in zip(*results):
        assert (a - b).abs().max() <= tolerance(b, n=200, depth=3)


def test_requests_the_kernel_does_not_serve_take_the_pytorch_paths(monkeypatch):
    q, k, v = _inputs(1, 2, 2, 64, 64, 16, 16, seed=7)
    calls = _spy(monkeypatch)
    attnlab.attention(q, k, v, causal=True, backend="tiled", score_mod=lambda s, b, h, i, j: s - 0.1 * (i - j))
    attnlab.attention(q, k, v, mask=torch.rand(1, 1, 64, 64) > 0.5, backend="tiled")
    attnlab.attention(q, k, v, causal=True, mask_mod=lambda b, h, i, j: (i - j) % 2 == 0, backend="tiled")
    attnlab.attention(q.double(), k.double(), v.double(), causal=True, backend="tiled")
    scattered = masks.document_mod(torch.tensor([0, 1] * 32))  # each document in many runs: no intervals
    attnlab.attention(q, k, v, mask_mod=scattered, backend="tiled")
    slopes = alibi_slopes(2).requires_grad_()  # learned slopes: their gradient needs the PyTorch loop
    out = attnlab.attention(q, k, v, causal=True, score_mod=attnlab.functional.positional.alibi_score_mod(slopes),
                            backend="tiled")
    out.sum().backward()
    assert calls == [] and slopes.grad is not None and slopes.grad.abs().sum() > 0
    monkeypatch.setitem(_native._state, "loaded", False)  # not built here: the PyTorch loop, same numbers
    monkeypatch.setitem(_native._state, "why", "test")
    out = attnlab.attention(q, k, v, causal=True, backend="tiled")
    assert calls == []
    ref, _ = _reference(q, k, v, 16**-0.5, True, None)
    assert (out.double() - ref).abs().max() <= _bounds(q, k, v, 16**-0.5, True, None)[0]


BASE_REQUEST = {"mask": None, "causal": False, "window": None, "scale": None, "score_mod": None, "mask_mod": None,
                "dropout_p": 0.0, "normalize": "softmax", "top_k": None, "return_weights": False}


@pytest.mark.parametrize("L,dtype,causal,grad,mask,expected", [
    (256, torch.float32, True, False, False, "tiled"),     # long causal forward: the kernel
    (512, torch.float32, False, True, False, "tiled"),     # bidirectional with gradients: the kernel
    (512, torch.float32, False, False, False, None),       # a bidirectional forward: the kernel with its own
                                                           # products (AVX-512), else SDPA
    (128, torch.float32, True, True, False, "sdpa"),       # short: SDPA (and `short` for equal heads)
    (512, torch.bfloat16, True, False, False, "sdpa"),     # bf16 stays in SDPA's bf16 kernel
    (512, torch.float32, True, False, True, "sdpa"),       # a mask tensor: SDPA's fused kernel
], ids=["causal-fwd", "bidir-grad", "bidir-fwd", "short", "bf16", "mask"])
def test_auto_takes_the_kernel_for_dense_requests_where_it_is_faster(L, dtype, causal, grad, mask, expected):
    from attnlab.backends import dispatch
    q, k = torch.randn(1, 4, L, 16, dtype=dtype, requires_grad=grad), torch.randn(1, 2, L, 16, dtype=dtype)
    v = torch.randn(1, 2, L, 16, dtype=dtype)
    request = {**BASE_REQUEST, "causal": causal, "mask": torch.ones(1, 1, L, L, dtype=torch.bool) if mask else None}
    if expected is None:  # both machines' answers: the kernel's own products (AVX-512) or the BLAS's
        for own, expected in ((True, "tiled"), (False, "sdpa")):
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(_native, "own_products", lambda: own)
                assert dispatch.select_backend(q, k, v, **request).name == expected
        return
    assert dispatch.select_backend(q, k, v, **request).name == expected


def test_auto_without_the_kernels_keeps_sdpa(monkeypatch):
    from attnlab.backends import dispatch
    monkeypatch.setitem(_native._state, "loaded", False)
    monkeypatch.setitem(_native._state, "why", "test")
    q, k, v = (torch.randn(1, 4, 512, 16) for _ in range(3))
    assert dispatch.select_backend(q, k, v, **{**BASE_REQUEST, "causal": True}).name == "sdpa"


def test_torch_func_transforms_keep_pytorchs_operations():
    """torch.func wraps its tensors (no data pointer for C++, no setup_context in our autograd Functions): auto then
    takes SDPA, and func.grad equals autograd through the kernel; at 64 keys too (where `short` would serve)."""
    for L in (256, 64):
        q, k, v = _inputs(1, 2, 2, L, L, 16, 16, seed=11)
        grad = torch.func.grad(lambda q: attnlab.attention(q, k, v, causal=True).sum())(q)
        qg = q.clone().requires_grad_()
        attnlab.attention(qg, k, v, causal=True).sum().backward()  # through the kernel / `short`
        assert (grad - qg.grad).abs().max() <= tolerance(qg.grad, n=L, depth=3)
