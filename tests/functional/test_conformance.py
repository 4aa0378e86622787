"""Conformance: every registered backend (and ``auto``) computes the pipeline exactly.

Iterates :data:`attnlab.backends.BACKENDS`, so a backend added later is covered by adding it to
the registry. Per hypothesis-drawn case (GQA/MQA, Lq ≠ Lk, causal, window, bool masks with empty
rows, float masks with -inf, mask_mods, score_mods, every normaliser, weights):

- ``reference`` against an independent oracle written here (float64 loops for the masks,
  ``torch.softmax``, sorting for top-k, bisection on τ for sparsemax);
- every backend against ``reference``, skipping only what the backend's ``unsupported`` declines.

Tolerances: float64 1e-10 (outputs, weights, gradients of a random-weighted sum w.r.t. q, k, v);
float32 backends against the float64 reference: 1e-5 (outputs, weights), 1e-4 (gradients).
"""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnlab.backends import BACKENDS, select_backend
from attnlab import attention
from attnlab.functional.masks import causal_mod, prefix_lm_mod, sliding_window_mod

F64, F32 = torch.float64, torch.float32
INF = float("inf")
TOL64 = dict(rtol=1e-10, atol=1e-10)
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

SCORE_MODS = {
    "softcap": lambda s, b, h, q, kv: 2.0 * torch.tanh(s / 2.0),
    "alibi": lambda s, b, h, q, kv: s - 0.25 * (h + 1) * (q - kv).abs(),
    "batch_head": lambda s, b, h, q, kv: s * (1 + 0.5 * b) + torch.sin(0.3 * h * kv),
}
MASK_MODS = {
    "checker": lambda b, h, q, kv: (q + kv + h + b) % 3 != 0,
    "prefix_lm": prefix_lm_mod(3),
    "blocks": lambda b, h, q, kv: q // 5 == kv // 5,  # floor division: negative positions too
    "band": sliding_window_mod(2, causal=False),
}
NORMALIZE = ["softmax", "topk", "hard", "sparsemax"]


# ---- the independent oracle ---------------------------------------------------------------

def _safe_rows(s):
    """Rows with no finite score become zeros (so no 0/0); ``nonempty`` zeroes them at the end."""
    nonempty = torch.isfinite(s).any(-1, keepdim=True)
    return torch.where(nonempty, s, torch.zeros_like(s)), nonempty


def o_softmax(s, top_k=None):
    safe, nonempty = _safe_rows(s)
    return torch.softmax(safe, dim=-1) * nonempty


def o_topk(s, top_k):
    kth = s.sort(dim=-1, descending=True).values[..., top_k - 1:top_k]
    return o_softmax(torch.where(s >= kth, s, -INF))


def o_hard(s, top_k=None):
    p = o_softmax(s)
    onehot = torch.zeros_like(p).scatter(-1, s.detach().argmax(-1, keepdim=True), 1.0)
    return onehot * (p.detach().sum(-1, keepdim=True) > 0) + (p - p.detach())


def o_sparsemax(s, top_k=None):
    """Support found by bisection on τ in ``Σ max(s - τ, 0) = 1``; then the differentiable
    ``w = (s - τ)`` on the support with ``τ = (Σ_S s - 1) / |S|``."""
    safe, nonempty = _safe_rows(s)
    z = safe.detach()
    hi = z.amax(-1, keepdim=True)
    lo = hi - 1
    for _ in range(80):
        mid = (lo + hi) / 2
        low = torch.clamp(z - mid, min=0).sum(-1, keepdim=True) > 1
        lo, hi = torch.where(low, mid, lo), torch.where(low, hi, mid)
    support = z > (lo + hi) / 2
    tau = (torch.where(support, safe, 0.0).sum(-1, keepdim=True) - 1) / support.sum(-1, keepdim=True)
    return torch.where(support, safe - tau, 0.0) * nonempty


ORACLE_NORMALIZE = {"softmax": o_softmax, "topk": o_topk, "hard": o_hard, "sparsemax": o_sparsemax}


def oracle(q, k, v, *, mask, causal, window, scale, score_mod, mask_mod, normalize, top_k, return_weights,
           **_):
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    kv_head = torch.arange(H) // (H // Hkv)  # query head h reads kv head h // (H / Hkv)
    k, v = k[:, kv_head], v[:, kv_head]
    s = torch.einsum("bhid,bhjd->bhij", q, k) * scale  # (B, H, Lq, Lk)
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    qi = torch.arange(Lk - Lq, Lk).view(1, 1, Lq, 1)  # absolute positions, bottom-right aligned
    kj = torch.arange(Lk).view(1, 1, 1, Lk)
    if score_mod is not None:
        s = score_mod(s, b, h, qi, kj)
    allowed = torch.tensor([[not (causal and j > p) and not (window is not None and (
        p - j >= window or (not causal and j - p >= window))) for j in range(Lk)]
        for p in range(Lk - Lq, Lk)])  # (Lq, Lk), p = the query's position
    if mask is not None and mask.dtype == torch.bool:
        allowed = allowed & mask
    elif mask is not None:
        s = s + mask
    if mask_mod is not None:
        allowed = allowed & mask_mod(b, h, qi, kj)
    w = ORACLE_NORMALIZE[normalize](s.masked_fill(~allowed, -INF), top_k)
    return w @ v, (w if return_weights else None)


# ---- drawing cases ------------------------------------------------------------------------

@st.composite
def cases(draw, normalize="softmax"):
    """A drawn request; ``normalize="plain"`` draws softmax without score_mod or weights (what
    SDPA-like backends take). Half the cases have no mask, window or mask_mod (only ``causal``),
    and in the other half each is off about half the time, so fast paths are drawn too."""
    B, Hkv, g = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    Lq = draw(st.integers(1, 24))
    Lk = draw(st.just(Lq) | st.integers(1, 24))
    D, Dv = draw(st.integers(1, 16)), draw(st.integers(1, 16))
    plain = normalize == "plain"
    masked = draw(st.booleans())
    return dict(
        B=B, H=Hkv * g, Hkv=Hkv, Lq=Lq, Lk=Lk, D=D, Dv=Dv,
        causal=draw(st.booleans()),
        window=draw(st.none() | st.integers(1, Lk + 2)) if masked else None,
        mask=draw(st.none() | st.sampled_from(["bool", "float"])) if masked else None,
        mask_shape=draw(st.sampled_from(["BHQK", "B1QK", "QK", "1H1K"])),
        mask_mod=draw(st.none() | st.sampled_from(sorted(MASK_MODS))) if masked else None,
        score_mod=None if plain else draw(st.none() | st.sampled_from(sorted(SCORE_MODS))),
        normalize="softmax" if plain else normalize,
        top_k=draw(st.integers(1, Lk)) if normalize == "topk" else None,
        return_weights=False if plain else draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def make(case, dtype=F64):
    """Tensors (q, k, v leaves, drawn in float64 then cast) and the validated request for a case."""
    gen = torch.Generator().manual_seed(case["seed"])
    B, H, Hkv, Lq, Lk = case["B"], case["H"], case["Hkv"], case["Lq"], case["Lk"]
    q = torch.randn(B, H, Lq, case["D"], generator=gen, dtype=F64)
    k = torch.randn(B, Hkv, Lk, case["D"], generator=gen, dtype=F64)
    v = torch.randn(B, Hkv, Lk, case["Dv"], generator=gen, dtype=F64)
    shape = {"BHQK": (B, H, Lq, Lk), "B1QK": (B, 1, Lq, Lk), "QK": (Lq, Lk), "1H1K": (1, H, 1, Lk)}[case["mask_shape"]]
    mask = None
    if case["mask"] is not None:
        drop = torch.rand(shape, generator=gen) < 0.3
        drop[..., torch.rand(shape[-2], generator=gen) < 0.25, :] = True  # some rows entirely masked
        if case["mask"] == "bool":
            mask = ~drop
        else:
            mask = torch.randn(shape, generator=gen, dtype=F64).masked_fill(drop, -INF).to(dtype)
    request = dict(
        mask=mask, causal=case["causal"], window=case["window"], scale=1 / math.sqrt(case["D"]),
        score_mod=SCORE_MODS.get(case["score_mod"]), mask_mod=MASK_MODS.get(case["mask_mod"]),
        dropout_p=0.0, normalize=case["normalize"], top_k=case["top_k"], return_weights=case["return_weights"],
    )
    return [t.to(dtype).requires_grad_(True) for t in (q, k, v)], request


def run(fn, qkv, request, seed):
    """``fn`` -> (out, weights or None, grads of a random-weighted sum w.r.t. q, k, v)."""
    out, w = fn(*qkv, **request)
    gen = torch.Generator().manual_seed(seed + 1)
    loss = (out * torch.randn(out.shape, generator=gen, dtype=F64).to(out.dtype)).sum()
    if w is not None:
        loss = loss + (w * torch.randn(w.shape, generator=gen, dtype=F64).to(w.dtype)).sum()
    grads = torch.autograd.grad(loss, qkv, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(qkv, grads)]
    return out, w, grads


def via_attention(backend):
    def fn(q, k, v, **request):
        res = attention(q, k, v, **request, backend=backend)
        return res if request["return_weights"] else (res, None)
    return fn


def supported_backends(qkv, request):
    """Every registered backend that accepts the request, then ``auto``."""
    names = [n for n, b in BACKENDS.items() if not b.unsupported(*qkv, **request)]
    return names + ["auto"]


def assert_same(got, want, name, **tol):
    out, w, grads = got
    r_out, r_w, r_grads = want
    torch.testing.assert_close(out, r_out.to(out.dtype), **tol, msg=lambda m: f"{name} out: {m}")
    if w is not None:
        torch.testing.assert_close(w, r_w.to(w.dtype), **tol, msg=lambda m: f"{name} weights: {m}")
    for t, g, rg in zip("qkv", grads, r_grads):
        tol_g = tol if out.dtype == F64 else dict(rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(g, rg.to(g.dtype), **tol_g, msg=lambda m: f"{name} grad {t}: {m}")


# ---- the tests ----------------------------------------------------------------------------

@pytest.mark.parametrize("normalize", ["plain", *NORMALIZE])
@settings(max_examples=50, **SETTINGS)
@given(data=st.data())
def test_every_backend_matches_reference_float64(normalize, data):
    case = data.draw(cases(normalize), label="case")
    qkv, request = make(case)
    ref = run(via_attention("reference"), qkv, request, case["seed"])
    assert_same(ref, run(oracle, qkv, request, case["seed"]), "reference vs oracle", **TOL64)
    for name in supported_backends(qkv, request):
        assert_same(run(via_attention(name), qkv, request, case["seed"]), ref, name, **TOL64)


@pytest.mark.parametrize("normalize", ["plain", "softmax", "sparsemax"])  # continuous: no argmax/top-k ties
@settings(max_examples=20, **SETTINGS)
@given(data=st.data())
def test_every_backend_float32_matches_float64_reference(normalize, data):
    case = data.draw(cases(normalize), label="case")
    qkv64, request64 = make(case, F64)
    qkv32, request32 = make(case, F32)
    ref = run(via_attention("reference"), qkv64, request64, case["seed"])
    for name in supported_backends(qkv32, request32):
        got = run(via_attention(name), qkv32, request32, case["seed"])
        assert_same(got, ref, f"{name} float32", rtol=1e-5, atol=1e-5)


@settings(max_examples=25, **SETTINGS)
@given(data=st.data(), how=st.sampled_from(["causal", "window", "causal_mod"]))
def test_no_leak_from_invisible_keys(data, how):
    """Changing k, v at positions a query may not see changes nothing for that query."""
    case = data.draw(cases(data.draw(st.sampled_from(["plain", *NORMALIZE]), label="normalize")), label="case")
    case.update(mask=None, mask_mod=None, score_mod=None, causal=how != "causal_mod",
                Lq=min(case["Lq"], 8), Lk=min(case["Lk"], 8))
    if case["top_k"] is not None:
        case["top_k"] = min(case["top_k"], case["Lk"])
    if how == "window":
        case["window"] = case["window"] or 2
    else:
        case["window"] = None
    (q, k, v), request = make(case)
    if how == "causal_mod":
        request["mask_mod"] = causal_mod()
    w = request["window"]
    Lq, Lk = case["Lq"], case["Lk"]
    gen = torch.Generator().manual_seed(case["seed"] + 2)
    for name in supported_backends((q, k, v), request):
        base = via_attention(name)(q, k, v, **request)[0]
        for i in range(Lq):
            p = Lk - Lq + i
            hidden = torch.tensor([j > p or (w is not None and p - j >= w) for j in range(Lk)])
            k2 = k.detach().clone()
            v2 = v.detach().clone()
            k2[:, :, hidden] += 10 * torch.randn(k2[:, :, hidden].shape, generator=gen, dtype=F64)
            v2[:, :, hidden] += 10 * torch.randn(v2[:, :, hidden].shape, generator=gen, dtype=F64)
            out = via_attention(name)(q.detach(), k2, v2, **request)[0]
            torch.testing.assert_close(out[:, :, i], base[:, :, i].detach(), rtol=1e-12, atol=1e-12,
                                       msg=lambda m: f"{name} row {i} ({how}): {m}")


@pytest.mark.parametrize("Hkv", [1, 2, 3])
def test_gqa_equals_repeating_kv_heads(Hkv):
    """H // Hkv query heads share each kv head: the same as ``repeat_interleave`` on the heads."""
    H, g = 6, 6 // Hkv
    q = torch.randn(2, H, 5, 4, dtype=F64)
    k, v = torch.randn(2, Hkv, 7, 4, dtype=F64), torch.randn(2, Hkv, 7, 3, dtype=F64)
    mask = torch.rand(2, 1, 5, 7) > 0.3
    for kw in (dict(), dict(causal=True), dict(mask=mask, window=3),
               dict(normalize="sparsemax", return_weights=True)):
        request = dict(mask=None, causal=False, window=None, scale=0.5, score_mod=None, mask_mod=None,
                       dropout_p=0.0, normalize="softmax", top_k=None, return_weights=False) | kw
        qkv = [t.clone().requires_grad_(True) for t in (q, k, v)]
        for name in supported_backends(qkv, request):
            def repeated(q_, k_, v_, **r):
                return via_attention(name)(q_, k_.repeat_interleave(g, 1), v_.repeat_interleave(g, 1), **r)
            assert_same(run(via_attention(name), qkv, request, 0), run(repeated, qkv, request, 0),
                        f"{name} {kw}", rtol=1e-12, atol=1e-12)


EMPTY_ROWS = {  # Lq = 3 queries at positions 1, 2, 3 over Lk = 4 keys: (request overrides, empty rows)
    "bool_mask": (dict(mask=torch.tensor([[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]]).bool()), [1]),
    "float_mask": (dict(mask=torch.tensor([[0.0, -INF, 1.0, 2.0], [-INF] * 4, [0.5] * 4], dtype=F64)), [1]),
    "mask_mod": (dict(mask_mod=lambda b, h, q, kv: (q != 1) & (kv >= 0)), [0]),
    "window_and_mask": (dict(window=1, mask=torch.tensor([[1, 1, 1, 1], [1, 1, 0, 1], [1, 1, 1, 1]]).bool()), [1]),
    "everything": (dict(mask=torch.zeros(3, 4, dtype=torch.bool)), [0, 1, 2]),
}


@pytest.mark.parametrize("normalize", NORMALIZE)
@pytest.mark.parametrize("setup", sorted(EMPTY_ROWS))
def test_empty_rows_give_exact_zeros_and_zero_gradients(normalize, setup):
    overrides, empty = EMPTY_ROWS[setup]
    request = dict(mask=None, causal=False, window=None, scale=0.5, score_mod=None, mask_mod=None,
                   dropout_p=0.0, normalize=normalize, top_k=2 if normalize == "topk" else None) | overrides
    qkv = [torch.randn(2, 2, L, 5, dtype=F64, requires_grad=True) for L in (3, 4, 4)]
    for ret in (True, False):
        for name in supported_backends(qkv, request | dict(return_weights=ret)):
            out, w, grads = run(via_attention(name), qkv, request | dict(return_weights=ret), 0)
            assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty])), name
            assert not out.isnan().any() and all(torch.isfinite(g).all() for g in grads), name
            assert torch.equal(grads[0][:, :, empty], torch.zeros_like(grads[0][:, :, empty])), name
            if w is not None:
                assert torch.equal(w[:, :, empty], torch.zeros_like(w[:, :, empty])), name
            if setup == "everything":
                assert all(torch.equal(g, torch.zeros_like(g)) for g in grads), name


def test_causal_with_more_queries_than_keys_gives_empty_leading_rows():
    q, k, v = torch.randn(1, 2, 6, 4, dtype=F64), torch.randn(1, 2, 3, 4, dtype=F64), torch.randn(1, 2, 3, 4, dtype=F64)
    for name in [*BACKENDS, "auto"]:
        out = attention(q, k, v, causal=True, backend=name)  # rows 0..2 sit at positions -3..-1
        assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3])), name
        torch.testing.assert_close(out[:, :, 3:], attention(q[:, :, 3:], k, v, causal=True, backend="reference"),
                                   **TOL64)


def _request(**kw):
    return dict(mask=None, causal=False, window=None, scale=0.125, score_mod=None, mask_mod=None,
                dropout_p=0.0, normalize="softmax", top_k=None, return_weights=False) | kw


QKV = (torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16))


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(mask=torch.rand(8, 8) > 0.5),
                                dict(mask=torch.randn(1, 4, 8, 8)), dict(causal=True, mask=torch.rand(8, 8) > 0.2)],
                         ids=["plain", "causal", "bool_mask", "float_mask", "causal_mask"])
def test_auto_selects_sdpa_for_softmax_requests(kw):
    assert select_backend(*QKV, **_request(**kw)).name == "sdpa"


SLOW_PATH = [dict(return_weights=True), dict(normalize="sparsemax"), dict(normalize="hard"),
             dict(normalize="topk", top_k=3)]


@pytest.mark.parametrize("kw", SLOW_PATH, ids=["weights", "sparsemax", "hard", "topk"])
def test_auto_uses_reference_for_weights_and_other_normalizers(kw):
    request = _request(**kw)
    chosen = select_backend(*QKV, **request)
    assert chosen.name == "reference" and not chosen.unsupported(*QKV, **request)


SPARSE = [dict(score_mod=SCORE_MODS["alibi"]), dict(mask=torch.rand(8, 8) > 0.5, window=3),
          dict(mask_mod=lambda b, h, q_idx, kv_idx: (q_idx // 4) == (kv_idx // 4))]


@pytest.mark.parametrize("kw", SPARSE, ids=["score_mod", "mask_window", "mask_mod"])
def test_auto_uses_tiled_for_block_sparse_masks_and_score_mods(kw):
    """Tiled skips the blocks such masks empty (SDPA would compute them under a dense mask)."""
    assert select_backend(*QKV, **_request(**kw)).name == "tiled"


@pytest.mark.parametrize("L, window, causal, want", [
    (8, 3, True, "sdpa"),         # short: a dense mask is small and SDPA's fused kernel is faster
    (512, 256, True, "sdpa"),     # the band would do about the work of dense causal attention
    (2048, 256, True, "tiled"),   # the band does well under half: tiled computes only its tiles
    (512, 64, False, "tiled"),
    (4096, 2048, True, "tiled"),  # a wide window on a long sequence: no N² mask
])
def test_auto_for_a_plain_window_weighs_work_and_mask_size(L, window, causal, want):
    q = torch.randn(1, 2, L, 8)
    assert select_backend(q, q, q, **_request(window=window, causal=causal)).name == want


@pytest.mark.parametrize("shape", [(6,), ()])
def test_low_rank_masks_broadcast_on_every_backend(shape):
    q, k, v = torch.randn(1, 2, 4, 3, dtype=F64), torch.randn(1, 2, 6, 3, dtype=F64), torch.randn(1, 2, 6, 3, dtype=F64)
    mask = torch.rand(shape) > 0.3
    ref = attention(q, k, v, mask=mask, backend="reference")
    for name in BACKENDS:
        torch.testing.assert_close(attention(q, k, v, mask=mask, backend=name), ref, **TOL64)
