"""NaN and ±inf in attention inputs: the same answer on every backend, and never a wrong answer in silence.

- A key or value a query may not see (causal future, padding, outside a window, blocked by a mask_mod) has no
  influence on that query's output or on the gradients of what it sees.
- A non-finite entry in a row's query, or in a key or value that row may see, makes exactly that row NaN.
- A scale whose scores overflow the dtype is refused; an lse from another request is refused.
"""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnlab
from attnlab.backends import BACKENDS

BACKEND_NAMES = sorted(BACKENDS) + ["auto"]
B, H, HKV, D = 2, 4, 2, 8


def _visible(L: int, *, causal=False, window=None, pad=None, mod=None) -> torch.Tensor:
    """(B, 1, L, L) bool: key j visible to query i, written out with loops' logic (independent of the library)."""
    i = torch.arange(L)[:, None]
    j = torch.arange(L)[None, :]
    vis = torch.ones(L, L, dtype=torch.bool)
    if causal:
        vis &= j <= i
    if window is not None:
        vis &= (i - j < window) & (j - i < window)
    vis = vis.expand(B, 1, L, L).clone()
    if pad is not None:
        vis &= pad[:, None, None, :]
    if mod is not None:
        vis &= mod(0, 0, i, j)
    return vis


def _request(kind: str, L: int):
    """The attention kwargs of one kind of masking, and its visibility."""
    pad = torch.ones(B, L, dtype=torch.bool)
    pad[0, -3:] = False
    if kind == "causal":
        return dict(causal=True), _visible(L, causal=True)
    if kind == "padding":
        return dict(mask=pad[:, None, None, :]), _visible(L, pad=pad)
    if kind == "window":
        return dict(causal=True, window=3), _visible(L, causal=True, window=3)
    mod = attnlab.prefix_lm_mod(4)
    return dict(mask_mod=mod), _visible(L, mod=lambda b, h, i, j: (j <= i) | (j < 4))


def _supported(backend, q, k, v, kw):
    if backend == "auto":
        return True
    from attnlab.functional.request import prepare as _prepare

    request = _prepare(q, k, v, mask=kw.get("mask"), causal=kw.get("causal", False), window=kw.get("window"),
                       scale=None, score_mod=None, mask_mod=kw.get("mask_mod"), dropout_p=0.0, normalize="softmax",
                       top_k=None, return_weights=False)
    return not BACKENDS[backend].unsupported(q, k, v, **request)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("kind", ["causal", "padding", "window", "mask_mod"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_invisible_bad_keys_have_no_influence(backend, kind, bad):
    L = 12
    kw, vis = _request(kind, L)
    q, k, v = (torch.randn(B, h, L, D, dtype=torch.float64) for h in (H, HKV, HKV))
    if not _supported(backend, q, k, v, kw):
        pytest.skip(f"{backend} does not take this request")
    # a key hidden from every query of row block 0..5 of batch 0 (and, for padding, from all of batch 0)
    hidden = (~vis[0, 0, :6]).all(0).nonzero().flatten()
    assert hidden.numel() > 0
    j = int(hidden[0])
    k2, v2 = k.clone(), v.clone()
    k2[0, :, j] = bad
    v2[0, :, j] = -bad
    leaves = [t.clone().requires_grad_() for t in (q, k, v, q, k2, v2)]
    clean = attnlab.attention(*leaves[:3], backend=backend, **kw)
    dirty = attnlab.attention(*leaves[3:], backend=backend, **kw)
    rows = ~vis[0, 0, :, j]  # queries that cannot see key j
    assert torch.equal(dirty[0, :, rows], clean[0, :, rows])
    g = torch.randn_like(clean)
    g[0, :, ~rows] = 0  # gradients through the rows that cannot see j only
    gc = torch.autograd.grad(clean, leaves[:3], g)
    gd = torch.autograd.grad(dirty, leaves[3:], g)
    assert all(torch.isfinite(t).all() for t in gd)
    keep = torch.ones(L, dtype=torch.bool)
    keep[j] = False
    torch.testing.assert_close(gd[0], gc[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(gd[1][:, :, keep], gc[1][:, :, keep], rtol=0, atol=1e-12)
    torch.testing.assert_close(gd[2][:, :, keep], gc[2][:, :, keep], rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_a_bad_query_or_visible_value_makes_exactly_its_rows_nan(backend):
    L = 10
    q, k, v = (torch.randn(B, h, L, D) for h in (H, HKV, HKV))
    clean = attnlab.attention(q, k, v, causal=True, backend=backend)
    q2 = q.clone()
    q2[1, 2, 5, 3] = float("nan")  # one entry of one query
    out = attnlab.attention(q2, k, v, causal=True, backend=backend)
    nan_rows = out.isnan().any(-1)
    expected = torch.zeros_like(nan_rows)
    expected[1, 2, 5] = True
    assert torch.equal(nan_rows, expected) and out.isnan()[1, 2, 5].all()
    assert torch.equal(out[~expected], clean[~expected])
    v2 = v.clone()
    v2[0, 1, 6, 0] = float("inf")  # kv head 1 serves query heads 2 and 3; key 6 is seen by queries 6..9
    out = attnlab.attention(q, k, v2, causal=True, backend=backend)
    expected = torch.zeros_like(nan_rows)
    expected[0, 2:4, 6:] = True
    assert torch.equal(out.isnan().any(-1), expected)
    torch.testing.assert_close(out[~expected], clean[~expected], rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_backends_agree_on_bad_inputs(backend):
    """The fast paths used to answer zeros where the formula answers NaN."""
    L = 8
    q, k, v = (torch.randn(1, 2, L, D, dtype=torch.float64) for _ in range(3))
    q[0, 0, 3, 0] = float("nan")
    k[0, 1, 7] = float("inf")
    ref = attnlab.attention(q, k, v, causal=True, backend="reference")
    out = attnlab.attention(q, k, v, causal=True, backend=backend)
    assert torch.equal(out.isnan(), ref.isnan())
    torch.testing.assert_close(out.nan_to_num(0), ref.nan_to_num(0), rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_a_scale_that_overflows_is_refused(backend):
    q, k, v = (torch.randn(1, 2, 6, D) for _ in range(3))
    with pytest.raises(ValueError, match=r"scale=1e\+38 makes the scores overflow torch.float32"):
        attnlab.attention(q, k, v, scale=1e38, backend=backend)
    out = attnlab.attention(q, k, v, scale=1e3, backend=backend)  # large but computable: finite, a near-argmax
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_huge_inputs_with_a_normal_scale_are_refused_alike(backend):
    """q and k of 1e20 overflow float32 scores with the default scale: every backend refuses (they used to
    answer NaN in 10 % to 100 % of the rows, each differently)."""
    q, k, v = (torch.randn(1, 2, 6, D) for _ in range(3))
    with pytest.raises(ValueError, match="overflow"):
        attnlab.attention(q * 1e20, k * 1e20, v, backend=backend)


def test_attention_weights_refuses_an_lse_of_another_request():
    q, k, v = (torch.randn(1, 2, 16, D) for _ in range(3))
    _, lse = attnlab.attention(q, k, v, causal=True, return_lse=True)
    with pytest.raises(ValueError, match="lse does not belong to this request"):
        attnlab.attention_weights(q, k, lse=lse)  # not causal
    _, lse_full = attnlab.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="lse does not belong"):
        attnlab.attention_weights(q, k, lse=lse_full, causal=True)
    w = attnlab.attention_weights(q, k, lse=lse, causal=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 2, 16))


@settings(max_examples=40, deadline=None)
@given(L=st.integers(2, 20), causal=st.booleans(), n_bad=st.integers(1, 3), seed=st.integers(0, 2**16),
       backend=st.sampled_from(["reference", "sdpa", "tiled", "auto"]), where=st.sampled_from(["k", "v", "q"]))
def test_drawn_bad_values_follow_the_formula(L, causal, n_bad, seed, backend, where):
    """Any NaN anywhere: the rows that may use it are NaN, every other row equals the clean computation."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, L, 4, generator=g, dtype=torch.float64) for _ in range(3))
    clean = attnlab.attention(q, k, v, causal=causal, backend=backend)
    t = {"q": q, "k": k, "v": v}[where].clone()
    pos = torch.randint(0, L, (n_bad,), generator=g)
    heads = torch.randint(0, 2, (n_bad,), generator=g)
    t[0, heads, pos, 0] = float("nan")
    args = {"q": q, "k": k, "v": v, where: t}
    out = attnlab.attention(args["q"], args["k"], args["v"], causal=causal, backend=backend)
    vis = _visible(L, causal=causal)[0, 0]  # (L, L)
    expected = torch.zeros(2, L, dtype=torch.bool)
    for h, p in zip(heads.tolist(), pos.tolist()):
        if where == "q":
            expected[h, p] = True
        else:
            expected[h] |= vis[:, p]
    assert torch.equal(out[0].isnan().any(-1), expected)
    assert torch.equal(out[0][~expected], clean[0][~expected]) or \
        torch.allclose(out[0][~expected], clean[0][~expected], rtol=0, atol=1e-12)
    assert math.isnan(float(out[0][expected].sum())) or not expected.any()
