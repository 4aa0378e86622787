"""Additive (Bahdanau), Luong and location-aware (Chorowski) attention, and the registry.

Oracles are plain float64 loops over (b, i, j) written from the papers' formulas with the
modules' weights copied out; tolerance 1e-10 unless stated.
"""
import math

import pytest
import torch

from attnlab.modules import multiplicative
from attnlab.modules.additive import AdditiveAttention
from attnlab.modules.location import LocationAwareAttention
from attnlab.modules.monotonic import MonotonicAttention
from attnlab.modules.multiplicative import LuongAttention
from attnlab.modules.registry import ATTENTION_REGISTRY, get_attention

TOL = 1e-10
B, LQ, LK, DQ, DK, DV, HID = 2, 3, 5, 4, 6, 3, 7


def _inputs(dq=DQ, dk=DK, dv=DV):
    q = torch.randn(B, LQ, dq, dtype=torch.float64)
    k = torch.randn(B, LK, dk, dtype=torch.float64)
    v = torch.randn(B, LK, dv, dtype=torch.float64)
    mask = torch.ones(B, LK, dtype=torch.bool)
    mask[1, 3:] = False  # batch 1: the last two keys are padding
    return q, k, v, mask


def _softmax_rows(scores, mask):
    """Masked softmax over j by loops: scores (B, Lq, Lk), mask (B, Lk) bool."""
    out = torch.zeros(len(scores), len(scores[0]), len(scores[0][0]), dtype=torch.float64)
    for b, rows in enumerate(scores):
        for i, row in enumerate(rows):
            allowed = [j for j in range(len(row)) if mask[b, j]]
            m = max(row[j] for j in allowed)
            z = sum(math.exp(row[j] - m) for j in allowed)
            for j in allowed:
                out[b, i, j] = math.exp(row[j] - m) / z
    return out


def _context(weights, v):
    out = torch.zeros(weights.shape[0], weights.shape[1], v.shape[-1], dtype=torch.float64)
    for b in range(weights.shape[0]):
        for i in range(weights.shape[1]):
            for j in range(weights.shape[2]):
                out[b, i] += weights[b, i, j] * v[b, j]
    return out


# ---- the score formulas, as loops over (b, i, j) ---------------------------------------

def _additive_scores(attn, q, k):  # e_ij = vᵀ tanh(W_q q_i + W_k k_j)
    Wq, Wk, v = attn.W_q.weight, attn.W_k.weight, attn.v.weight[0]
    return _loop(q, k, lambda qi, kj: v @ torch.tanh(Wq @ qi + Wk @ kj))


def _dot_scores(attn, q, k):  # h_tᵀ h_s
    return _loop(q, k, lambda qi, kj: qi @ kj)


def _general_scores(attn, q, k):  # h_tᵀ W_a h_s
    return _loop(q, k, lambda qi, kj: qi @ attn.W_a.weight @ kj)


def _concat_scores(attn, q, k):  # v_aᵀ tanh(W_a [h_t; h_s])
    Wa, va = attn.W_a.weight, attn.v_a.weight[0]
    return _loop(q, k, lambda qi, kj: va @ torch.tanh(Wa @ torch.cat([qi, kj])))


def _loop(q, k, score):
    out = torch.empty(q.shape[0], q.shape[1], k.shape[1], dtype=torch.float64)
    with torch.no_grad():
        for b in range(q.shape[0]):
            for i in range(q.shape[1]):
                for j in range(k.shape[1]):
                    out[b, i, j] = float(score(q[b, i], k[b, j]))
    return out


SCORED = {
    "additive": (lambda: AdditiveAttention(DQ, DK, HID, value_dim=DV), _additive_scores, DQ),
    "luong-dot": (lambda: LuongAttention(DK, DK, mode="dot", value_dim=DV), _dot_scores, DK),
    "luong-general": (lambda: LuongAttention(DQ, DK, mode="general", value_dim=DV), _general_scores, DQ),
    "luong-concat": (lambda: LuongAttention(DQ, DK, mode="concat", hidden_dim=HID, value_dim=DV), _concat_scores, DQ),
}


@pytest.mark.parametrize("name", SCORED)
def test_scores_weights_and_context_match_the_formula(name):
    make, oracle, dq = SCORED[name]
    attn = make().double()
    q, k, v, mask = _inputs(dq=dq)
    with torch.no_grad():
        ctx, w = attn(q, k, v, mask=mask)
    want_w = _softmax_rows(oracle(attn, q, k), mask)
    torch.testing.assert_close(w, want_w, rtol=0, atol=TOL)
    torch.testing.assert_close(ctx, _context(want_w, v), rtol=0, atol=TOL)


@pytest.mark.parametrize("name", SCORED)
def test_one_step_query_is_the_same_row(name):
    make, _, dq = SCORED[name]
    attn = make().double()
    q, k, v, mask = _inputs(dq=dq)
    ctx, w = attn(q, k, v, mask=mask)
    ctx1, w1 = attn(q[:, 1], k, v, mask=mask)  # (B, Dq) -> (B, Dv), (B, Lk)
    torch.testing.assert_close(w1, w[:, 1], rtol=0, atol=TOL)
    torch.testing.assert_close(ctx1, ctx[:, 1], rtol=0, atol=TOL)


def test_values_default_to_keys():
    attn = AdditiveAttention(DQ, DK, HID).double()
    q, k, _, mask = _inputs()
    for a, b in zip(attn(q, k, mask=mask), attn(q, k, k, mask=mask)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_luong_dot_and_general_go_through_the_pipeline_unscaled(monkeypatch):
    calls = []
    real = multiplicative.attention

    def spy(q, k, v, **kw):
        calls.append((tuple(q.shape), kw["scale"]))
        return real(q, k, v, **kw)

    monkeypatch.setattr(multiplicative, "attention", spy)
    q, k, v, _ = _inputs(dq=DK)
    for mode in ("dot", "general"):
        LuongAttention(DK, DK, mode=mode, value_dim=DV).double()(q, k, v)
    assert calls == [((B, 1, LQ, DK), 1.0)] * 2


@pytest.mark.parametrize("name", ["additive", "luong-general", "luong-concat"])
def test_sparsemax_is_the_projection_onto_the_simplex(name):
    """KKT conditions of argmin_w ‖w - e‖² over the simplex: w ≥ 0, Σ_j w_j = 1, and one
    threshold τ per row with e_j - w_j = τ on the support and e_j ≤ τ off it."""
    make, oracle, dq = SCORED[name]
    attn = make().double()
    attn.normalize = "sparsemax"
    q, k, v, _ = _inputs(dq=dq)
    with torch.no_grad():
        for p in attn.parameters():
            p.mul_(5)  # spread the scores so that the projection is sparse
        ctx, w = attn(q, k, v)
    e = oracle(attn, q, k)
    support = w > 0
    assert (w >= 0).all() and (~support).any()
    torch.testing.assert_close(w.sum(-1), torch.ones(B, LQ, dtype=torch.float64), rtol=0, atol=TOL)
    tau = ((e - w) * support).sum(-1, keepdim=True) / support.sum(-1, keepdim=True)
    assert ((e - w - tau).abs()[support] < 1e-10).all()
    assert (e <= tau + 1e-12)[~support].all()
    torch.testing.assert_close(ctx, _context(w, v), rtol=0, atol=TOL)


# ---- masks, empty rows, gradients ------------------------------------------------------

def _step(attn, q, k, v, mask):
    """Call any module on (B, Lq, D) queries; location-aware attention takes one step."""
    if isinstance(attn, LocationAwareAttention):
        prev = torch.softmax(torch.randn(q.shape[0], k.shape[1], dtype=q.dtype), -1)
        ctx, w = attn(q[:, 0], k, prev, values=v, mask=mask)
        return ctx.unsqueeze(1), w.unsqueeze(1)
    return attn(q, k, v, mask=mask)


MODULES = {
    "additive": lambda **kw: AdditiveAttention(DK, DK, HID, value_dim=DV, **kw),
    "luong-dot": lambda **kw: LuongAttention(DK, DK, mode="dot", value_dim=DV, **kw),
    "luong-general": lambda **kw: LuongAttention(DK, DK, mode="general", value_dim=DV, **kw),
    "luong-concat": lambda **kw: LuongAttention(DK, DK, mode="concat", hidden_dim=HID, value_dim=DV, **kw),
    "location": lambda **kw: LocationAwareAttention(DK, DK, HID, kernel_size=3, conv_channels=2, value_dim=DV, **kw),
}
NORMALIZE = {"softmax": {}, "sparsemax": {"normalize": "sparsemax"}, "topk": {"normalize": "topk", "top_k": 2}}


@pytest.mark.parametrize("norm", NORMALIZE)
@pytest.mark.parametrize("name", MODULES)
def test_masks_and_empty_rows(name, norm):
    attn = MODULES[name](**NORMALIZE[norm]).double()
    q, k, v, _ = _inputs(dq=DK)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = torch.tensor([[True, False, True, True, False], [False] * LK])  # batch 1 may attend to nothing
    ctx, w = _step(attn, q, k, v, mask)
    assert (w[0][:, ~mask[0]] == 0).all()
    torch.testing.assert_close(w[0].sum(-1), torch.ones(w.shape[1], dtype=torch.float64), rtol=0, atol=TOL)
    assert (w[1] == 0).all() and (ctx[1] == 0).all()
    (ctx.square().sum() + (w * torch.randn_like(w)).sum()).backward()
    grads = [q.grad, k.grad, v.grad] + [p.grad for p in attn.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert (v.grad[1] == 0).all() and (v.grad[0][~mask[0]] == 0).all()


def test_per_query_mask():
    attn = AdditiveAttention(DQ, DK, HID, value_dim=DV).double()
    q, k, v, _ = _inputs()
    mask = torch.ones(1, LQ, LK, dtype=torch.bool).tril()  # query i may attend to keys 0..i
    ctx, w = attn(q, k, v, mask=mask)
    assert (w[:, ~mask[0]] == 0).all()
    torch.testing.assert_close(ctx[:, 0], v[:, 0], rtol=0, atol=TOL)  # only key 0: all weight on it
    torch.testing.assert_close(w.sum(-1), torch.ones(B, LQ, dtype=torch.float64), rtol=0, atol=TOL)


@pytest.mark.parametrize("make", [lambda: AdditiveAttention(2, 3, 2, value_dim=2),
                                  lambda: LuongAttention(2, 3, mode="general", value_dim=2)],
                         ids=["additive", "luong-general"])
def test_gradcheck(make):
    attn = make().double()
    q = torch.randn(2, 2, 2, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, 2, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    names = [n for n, _ in attn.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in attn.parameters()]

    def f(q, k, v, *ps):
        return torch.func.functional_call(attn, dict(zip(names, ps)), (q, k, v), {"mask": mask})

    assert torch.autograd.gradcheck(f, (q, k, v, *params))


# ---- location-aware attention ----------------------------------------------------------

def _location_scores(attn, s, h, prev):
    """e_ij = wᵀ tanh(W s + V h_j + U f_ij + b), f_ij[c] = Σ_t F[c, t] α_{j + t - (r-1)/2}."""
    F = attn.F.weight[:, 0]  # (C, r)
    C, r = F.shape
    out = torch.empty(h.shape[0], h.shape[1], dtype=torch.float64)
    with torch.no_grad():
        for b in range(h.shape[0]):
            for j in range(h.shape[1]):
                f = torch.zeros(C, dtype=torch.float64)
                for c in range(C):
                    for t in range(r):
                        if 0 <= j + t - r // 2 < h.shape[1]:
                            f[c] += F[c, t] * prev[b, j + t - r // 2]
                hid = attn.W.weight @ s[b] + attn.V.weight @ h[b, j] + attn.U.weight @ f + attn.b
                out[b, j] = float(attn.w.weight[0] @ torch.tanh(hid))
    return out


def test_location_matches_chorowski_formula():
    attn = LocationAwareAttention(DQ, DK, HID, conv_channels=2, kernel_size=5, value_dim=DV).double()
    with torch.no_grad():
        attn.b.normal_()
    q, k, v, mask = _inputs()
    prev = torch.softmax(torch.randn(B, LK, dtype=torch.float64), -1)
    with torch.no_grad():
        ctx, w = attn(q[:, 0], k, prev, values=v, mask=mask)
    want = _softmax_rows(_location_scores(attn, q[:, 0], k, prev).unsqueeze(1), mask)
    torch.testing.assert_close(w, want[:, 0], rtol=0, atol=TOL)
    torch.testing.assert_close(ctx, _context(want, v)[:, 0], rtol=0, atol=TOL)


def test_location_prev_weights_move_the_scores():
    attn = LocationAwareAttention(DQ, DK, HID, conv_channels=2, kernel_size=3).double()
    q, k, _, _ = _inputs()
    prev = torch.softmax(3 * torch.randn(B, LK, dtype=torch.float64), -1)
    _, w_none = attn(q[:, 0], k, None)
    _, w_zero = attn(q[:, 0], k, torch.zeros(B, LK, dtype=torch.float64))
    _, w_prev = attn(q[:, 0], k, prev)
    torch.testing.assert_close(w_none, w_zero, rtol=0, atol=0)  # None means zeros: f_i = 0
    assert (w_prev - w_none).abs().max() > 1e-3
    with torch.no_grad():
        attn.U.weight.zero_()  # U f_ij is the only way prev_weights enter
    torch.testing.assert_close(attn(q[:, 0], k, prev)[1], attn(q[:, 0], k, None)[1], rtol=0, atol=TOL)


def test_location_features_are_the_convolution_of_the_previous_alignment():
    """One filter that reads α_{i-1, j+1} (a shifted delta), U = w = 1 and nothing else:
    e_ij = tanh(α_{i-1, j+1}), with zero padding past the end."""
    attn = LocationAwareAttention(DQ, DK, 1, conv_channels=1, kernel_size=3).double()
    with torch.no_grad():
        for p in attn.parameters():
            p.zero_()
        attn.F.weight[0, 0, 2] = 1.0
        attn.U.weight.fill_(1.0)
        attn.w.weight.fill_(1.0)
    q, k, _, _ = _inputs()
    prev = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4, 2.0]], dtype=torch.float64)
    _, w = attn(q[:, 0], k, prev)
    shifted = torch.cat([prev[:, 1:], torch.zeros(B, 1, dtype=torch.float64)], -1)
    torch.testing.assert_close(w, torch.softmax(torch.tanh(shifted), -1), rtol=0, atol=TOL)


def test_location_accumulate():
    w1, w2 = torch.rand(B, LK), torch.rand(B, LK)
    cum = LocationAwareAttention(DQ, DK, HID, cumulative=True)
    plain = LocationAwareAttention(DQ, DK, HID)
    assert torch.equal(cum.accumulate(None, w1), w1)
    assert torch.equal(cum.accumulate(w1, w2), w1 + w2)
    assert torch.equal(plain.accumulate(w1, w2), w2)


# ---- argument checks -------------------------------------------------------------------

@pytest.mark.parametrize("make, match", [
    (lambda: LuongAttention(4, 6, mode="dot"), r"query_dim=4, key_dim=6"),
    (lambda: LuongAttention(4, 4, mode="bilinear"), r"mode must be one of"),
    (lambda: LuongAttention(4, 4, mode="dot", hidden_dim=8), r"hidden_dim"),
    (lambda: LuongAttention(4, 4, mode="concat", hidden_dim=0), r"hidden_dim"),
    (lambda: AdditiveAttention(4, 4, 0), r"hidden_dim"),
    (lambda: AdditiveAttention(4, 4, -3), r"hidden_dim"),
    (lambda: AdditiveAttention(0, 4, 3), r"query_dim"),
    (lambda: AdditiveAttention(4, 4, 3, normalize="softermax"), r"normalize"),
    (lambda: AdditiveAttention(4, 4, 3, normalize="topk"), r"top_k"),
    (lambda: AdditiveAttention(4, 4, 3, top_k=2), r"top_k"),
    (lambda: LocationAwareAttention(4, 4, 0), r"hidden_dim"),
    (lambda: LocationAwareAttention(4, 4, 3, kernel_size=4), r"kernel_size"),
    (lambda: LocationAwareAttention(4, 4, 3, kernel_size=0), r"kernel_size"),
    (lambda: LocationAwareAttention(4, 4, 3, conv_channels=0), r"conv_channels"),
    (lambda: MonotonicAttention(4, 4, 0), r"hidden_dim"),
])
def test_bad_constructor_args(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_forward_args():
    attn = AdditiveAttention(DQ, DK, HID)
    q, k = torch.randn(B, LQ, DQ), torch.randn(B, LK, DK)
    with pytest.raises(ValueError, match="query last dim must be 4"):
        attn(torch.randn(B, LQ, DQ + 1), k)
    with pytest.raises(ValueError, match="keys must have shape"):
        attn(q, k[0])
    with pytest.raises(ValueError, match="same length"):
        attn(q, k, torch.randn(B, LK + 1, DK))
    with pytest.raises(TypeError, match="bool"):
        attn(q, k, mask=torch.ones(B, LK))
    with pytest.raises(ValueError, match="mask of shape"):
        attn(q, k, mask=torch.ones(B, LK + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="prev_weights"):
        LocationAwareAttention(DQ, DK, HID)(q[:, 0], k, torch.zeros(B, LK + 1))


# ---- registry --------------------------------------------------------------------------

def test_registry_resolves_the_classic_modules():
    expected = {"additive": AdditiveAttention, "luong": LuongAttention, "location": LocationAwareAttention,
                "monotonic": MonotonicAttention}
    for name, cls in expected.items():
        assert get_attention(name) is cls
    from attnlab import LinformerAttention, MultiheadAttention, PerformerAttention

    others = {"multihead": MultiheadAttention, "performer": PerformerAttention, "linformer": LinformerAttention}
    for name, cls in others.items():
        assert get_attention(name) is cls
    assert set(expected) | set(others) == set(ATTENTION_REGISTRY)


def test_registry_multihead():
    module = pytest.importorskip("attnlab.modules.multihead")
    assert get_attention("multihead") is module.MultiheadAttention


def test_registry_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown attention 'bahdanau'") as err:
        get_attention("bahdanau")
    assert all(repr(name) in str(err.value) for name in ATTENTION_REGISTRY)
    with pytest.raises(TypeError, match="str"):
        get_attention(None)
