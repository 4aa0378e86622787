"""Monotonic attention (Raffel et al. 2017) against brute-force oracles.

The expected alignment is checked against the defining triple sum in float64 (tolerance 1e-10);
hard decoding against the scan of Algorithm 1 written as a loop.
"""
import math

import pytest
import torch

from attnlab.modules.monotonic import MonotonicAttention, expected_alignment, hard_alignment

TOL = 1e-10
B, LK, DQ, DK, DV, HID = 3, 7, 4, 5, 2, 6


def _brute_expected(p, prev):
    """α_ij = p_ij Σ_{k≤j} α_{i-1,k} Π_{l=k}^{j-1} (1 - p_il), as a triple loop over floats."""
    out = torch.zeros_like(p)
    for b in range(p.shape[0]):
        for j in range(p.shape[1]):
            total = 0.0
            for k in range(j + 1):
                prod = 1.0
                for l in range(k, j):
                    prod *= 1.0 - float(p[b, l])
                total += float(prev[b, k]) * prod
            out[b, j] = float(p[b, j]) * total
    return out


def _brute_hard(p, prev, mask=None):
    """Algorithm 1: from t = the attended index of α_{i-1}, stop at the first j ≥ t with p ≥ 0.5."""
    out = torch.zeros_like(p)
    for b in range(p.shape[0]):
        nonzero = [j for j in range(p.shape[1]) if prev[b, j] != 0]
        if not nonzero:
            continue
        t = max(nonzero, key=lambda j: float(prev[b, j]))
        for j in range(t, p.shape[1]):
            if float(p[b, j]) >= 0.5 and (mask is None or mask[b, j]):
                out[b, j] = 1.0
                break
    return out


def _module(**kw):
    attn = MonotonicAttention(DQ, DK, HID, value_dim=DV, **kw).double()
    with torch.no_grad():
        attn.b.normal_()
    return attn


def _inputs():
    return (torch.randn(B, DQ, dtype=torch.float64), torch.randn(B, LK, DK, dtype=torch.float64),
            torch.randn(B, LK, DV, dtype=torch.float64))


def test_expected_alignment_matches_the_defining_sum():
    p = torch.rand(4, 9, dtype=torch.float64)
    p[0, 2], p[1, 4], p[2, 0], p[3, 5] = 1.0, 0.0, 1.0 - 1e-12, 1e-12  # saturated entries are fine
    prev = torch.softmax(2 * torch.randn(4, 9, dtype=torch.float64), -1) * torch.rand(4, 1, dtype=torch.float64)
    torch.testing.assert_close(expected_alignment(p, prev), _brute_expected(p, prev), rtol=0, atol=TOL)


def test_hard_alignment_is_algorithm_1():
    p = torch.rand(6, 9, dtype=torch.float64)
    starts = [0, 3, 8, 5, 0]
    prev = torch.zeros(6, 9, dtype=torch.float64)
    prev[torch.arange(5), starts] = 1.0  # row 5 stays zero: nothing left to attend from
    p[4] = 0.2  # row 4 finds no p ≥ 0.5
    got = hard_alignment(p, prev)
    torch.testing.assert_close(got, _brute_hard(p, prev), rtol=0, atol=0)
    assert (got[4:] == 0).all()


def test_energy_matches_the_formula():
    attn = _module()
    s, h, _ = _inputs()
    want = torch.empty(B, LK, dtype=torch.float64)
    with torch.no_grad():  # e_ij = g · vᵀ/‖v‖ · tanh(W s + V h_j + b) + r
        v = attn.v / math.sqrt(sum(float(x) ** 2 for x in attn.v))
        for b in range(B):
            for j in range(LK):
                hid = torch.tanh(attn.W.weight @ s[b] + attn.V.weight @ h[b, j] + attn.b)
                want[b, j] = float(attn.g) * float(v @ hid) + float(attn.r)
        torch.testing.assert_close(attn.energy(s, h), want, rtol=0, atol=TOL)
    assert attn.r.item() == -4.0 and attn.g.item() == pytest.approx(1 / math.sqrt(HID))


def test_training_step_is_the_expected_alignment_and_context():
    attn = _module(noise_std=0.0, init_r=0.0).train()
    s, h, values = _inputs()
    mask = torch.ones(B, LK, dtype=torch.bool)
    mask[1, 5:] = False
    mask[2, 2] = False  # a hole: the scan passes over it
    prev = torch.softmax(torch.randn(B, LK, dtype=torch.float64), -1).masked_fill(~mask, 0)
    ctx, alpha = attn(s, h, prev, values=values, mask=mask)
    with torch.no_grad():
        p = torch.sigmoid(attn.energy(s, h)) * mask
    want = _brute_expected(p, prev)
    torch.testing.assert_close(alpha, want, rtol=0, atol=TOL)
    torch.testing.assert_close(ctx, torch.einsum("bj,bjd->bd", want, values), rtol=0, atol=TOL)
    assert (alpha[~mask] == 0).all()


def test_training_rows_stay_in_the_sub_simplex_over_many_steps():
    attn = _module(noise_std=1.0, init_r=-1.0).train()
    _, h, values = _inputs()
    alpha = attn.initial_alignment(B, LK)
    for _ in range(6):
        _, alpha = attn(torch.randn(B, DQ, dtype=torch.float64), h, alpha, values=values)
        assert (alpha >= 0).all() and (alpha.sum(-1) <= 1 + 1e-12).all()
    assert (alpha.sum(-1) < 1).all()  # mass runs off the end


def test_eval_alignments_are_one_hot_and_monotonic():
    attn = _module(init_r=0.5).eval()
    _, h, values = _inputs()
    mask = torch.ones(B, LK, dtype=torch.bool)
    mask[0, 4:] = False
    alignment = attn.initial_alignment(B, LK)
    last = torch.zeros(B, dtype=torch.long)
    attended = 0
    for _ in range(8):
        s = torch.randn(B, DQ, dtype=torch.float64)
        ctx, new = attn(s, h, alignment, values=values, mask=mask)
        assert ((new == 0) | (new == 1)).all() and (new.sum(-1) <= 1).all()
        assert (new[~mask] == 0).all()
        with torch.no_grad():
            torch.testing.assert_close(new, _brute_hard(torch.sigmoid(attn.energy(s, h)), alignment, mask),
                                       rtol=0, atol=0)
        hit = new.sum(-1) == 1
        idx = new.argmax(-1)
        assert (idx[hit] >= last[hit]).all()
        torch.testing.assert_close(ctx[hit], values[hit, idx[hit]], rtol=0, atol=0)
        assert (ctx[~hit] == 0).all()
        last = torch.where(hit, idx, last)
        attended += int(hit.sum())
        alignment = torch.where(hit.unsqueeze(-1), new, alignment)  # stay where nothing was chosen
    assert attended > 0


def test_eval_is_deterministic_and_training_is_noisy():
    attn = _module(noise_std=1.0, init_r=0.0)
    s, h, values = _inputs()
    prev = attn.initial_alignment(B, LK)
    attn.eval()
    assert torch.equal(attn(s, h, prev, values=values)[1], attn(s, h, prev, values=values)[1])
    attn.train()
    assert not torch.equal(attn(s, h, prev, values=values)[1], attn(s, h, prev, values=values)[1])


def test_saturated_energies_make_training_equal_to_hard_decoding():
    """With |e| huge, p ∈ {0, 1}: the expected alignment is the hard one, step after step."""
    attn = _module(noise_std=0.0, init_r=0.0)
    with torch.no_grad():
        attn.g.fill_(1e6)
    _, h, values = _inputs()
    mask = torch.ones(B, LK, dtype=torch.bool)
    mask[2, 3:] = False
    soft = hard = attn.initial_alignment(B, LK)
    nonzero = 0
    for _ in range(6):
        s = torch.randn(B, DQ, dtype=torch.float64)
        ctx_soft, soft = attn.train()(s, h, soft, values=values, mask=mask)
        ctx_hard, hard = attn.eval()(s, h, hard, values=values, mask=mask)
        torch.testing.assert_close(soft, hard, rtol=0, atol=1e-12)
        torch.testing.assert_close(ctx_soft, ctx_hard, rtol=0, atol=1e-12)
        nonzero += int(hard.sum())
    assert nonzero > 0


def test_gradients_flow_in_training_and_empty_rows_are_zero():
    attn = _module(noise_std=0.5, init_r=0.0).train()
    s, h, values = _inputs()
    h.requires_grad_()
    mask = torch.ones(B, LK, dtype=torch.bool)
    mask[1] = False  # batch 1 may attend to nothing
    ctx, alpha = attn(s, h, attn.initial_alignment(B, LK), values=values, mask=mask)
    assert (alpha[1] == 0).all() and (ctx[1] == 0).all()
    (ctx.square().sum() + alpha.sum()).backward()
    for name, p in [("h", h)] + list(attn.named_parameters()):
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_initial_alignment():
    attn = MonotonicAttention(DQ, DK, HID)
    a0 = attn.initial_alignment(2, 4)
    assert a0.dtype == torch.float32 and torch.equal(a0, torch.tensor([[1.0, 0, 0, 0], [1.0, 0, 0, 0]]))


@pytest.mark.parametrize("kw, match", [({"noise_std": -1.0}, "noise_std"), ({"init_r": float("nan")}, "init_r"),
                                       ({"value_dim": 0}, "value_dim")])
def test_bad_args(kw, match):
    with pytest.raises(ValueError, match=match):
        MonotonicAttention(DQ, DK, HID, **kw)


def test_bad_prev_alignment_shape():
    attn = MonotonicAttention(DQ, DK, HID)
    with pytest.raises(ValueError, match="prev_alignment"):
        attn(torch.randn(B, DQ), torch.randn(B, LK, DK), torch.zeros(B, LK + 1))
    with pytest.raises(ValueError, match="query must have shape"):
        attn(torch.randn(B, 1, DQ), torch.randn(B, LK, DK), torch.zeros(B, LK))
