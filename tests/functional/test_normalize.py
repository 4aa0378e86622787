"""Normalisers (scores -> weights) against independent float64 oracles.

Oracles: ``torch.softmax``; top-k by sorting; sparsemax as the Euclidean projection onto the
simplex found by bisection on τ (``Σ_j max(s_j - τ, 0) = 1``); its Jacobian
``diag(σ) - σσᵀ/|S|`` written out. Tolerances: 1e-12 (float64) unless stated.
"""
import pytest
import torch
from torch.autograd import gradcheck
from torch.autograd.functional import jacobian

from attnlab.functional.normalize import NORMALIZERS, hard, softmax, sparsemax, topk_softmax

F64 = torch.float64
TOL = dict(rtol=1e-12, atol=1e-12)


def simplex_projection(s: torch.Tensor, iters: int = 200) -> torch.Tensor:
    """argmin_w ||w - s||² over the simplex, by bisection on τ in ``w = max(s - τ, 0)``.

    ``f(τ) = Σ max(s - τ, 0)`` decreases from ``≥ 1`` at ``τ = max - 1`` to 0 at ``τ = max``.
    """
    hi = s.amax(dim=-1, keepdim=True)
    lo = hi - 1.0
    for _ in range(iters):
        mid = (lo + hi) / 2
        too_low = torch.clamp(s - mid, min=0).sum(dim=-1, keepdim=True) > 1
        lo = torch.where(too_low, mid, lo)
        hi = torch.where(too_low, hi, mid)
    return torch.clamp(s - (lo + hi) / 2, min=0)


def test_softmax_matches_torch_on_finite_rows():
    s = torch.randn(5, 3, 11, dtype=F64) * 3
    torch.testing.assert_close(softmax(s), torch.softmax(s, dim=-1), **TOL)


def test_softmax_is_stable_for_huge_scores():
    s = torch.randn(4, 9, dtype=F64) * 1e4
    s[0] = 1e4  # a constant huge row: uniform weights
    w = softmax(s)
    assert torch.isfinite(w).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(4, dtype=F64), **TOL)
    torch.testing.assert_close(w, torch.softmax(s, dim=-1), **TOL)
    torch.testing.assert_close(w[0], torch.full((9,), 1 / 9, dtype=F64), **TOL)
    # float32 too: exp(1e4) overflows unless the row maximum is subtracted
    w32 = softmax((s * 1).float())
    assert torch.isfinite(w32).all()
    torch.testing.assert_close(w32.sum(-1), torch.ones(4), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("top_k", [1, 3, 7, 10])
def test_topk_keeps_exactly_top_k_and_is_softmax_over_them(top_k):
    s = torch.randn(6, 10, dtype=F64)  # continuous: no ties
    w = topk_softmax(s, top_k)
    assert ((w != 0).sum(-1) == top_k).all()
    idx = s.sort(dim=-1, descending=True).indices[..., :top_k]
    expected = torch.zeros_like(s).scatter(-1, idx, torch.softmax(s.gather(-1, idx), dim=-1))
    torch.testing.assert_close(w, expected, **TOL)


def test_topk_keeps_ties_at_the_threshold():
    s = torch.tensor([[3.0, 2.0, 2.0, 0.0]], dtype=F64)
    w = topk_softmax(s, 2)
    kept = torch.tensor([[3.0, 2.0, 2.0]], dtype=F64)
    torch.testing.assert_close(w[:, :3], torch.softmax(kept, -1), **TOL)
    assert w[0, 3] == 0


def test_topk_with_fewer_allowed_than_top_k_keeps_all_allowed():
    s = torch.tensor([[0.5, float("-inf"), -1.0, float("-inf")]], dtype=F64)
    w = topk_softmax(s, 3)
    torch.testing.assert_close(w[0, [0, 2]], torch.softmax(s[0, [0, 2]], -1), **TOL)
    assert (w[0, [1, 3]] == 0).all()


def test_hard_is_one_hot_forward_with_softmax_gradient():
    s = torch.randn(4, 3, 8, dtype=F64, requires_grad=True)
    w = hard(s)
    onehot = torch.nn.functional.one_hot(s.detach().argmax(-1), 8).to(F64)
    # to round-off: ``onehot + p - p.detach()`` evaluates as ``(onehot + p) - p``, which can be
    # 1 ± 1 ulp at the argmax (``onehot + (p - p.detach())`` would be exact)
    assert torch.equal(w.detach(), onehot)
    assert (w.detach()[onehot == 0] == 0).all()
    g = torch.randn(4, 3, 8, dtype=F64)
    (grad_hard,) = torch.autograd.grad((w * g).sum(), s)
    (grad_soft,) = torch.autograd.grad((torch.softmax(s, -1) * g).sum(), s)
    torch.testing.assert_close(grad_hard, grad_soft, **TOL)


def test_sparsemax_is_the_simplex_projection():
    s = torch.randn(200, 12, dtype=F64) * torch.rand(200, 1, dtype=F64).mul(4)  # sparse and dense rows
    w = sparsemax(s)
    torch.testing.assert_close(w, simplex_projection(s), **TOL)
    torch.testing.assert_close(w.sum(-1), torch.ones(200, dtype=F64), **TOL)
    assert (w >= 0).all()
    assert (w == 0).any(), "expected some exact zeros"
    # the zeros are exact, not tiny: every entry below τ is 0.0
    tau = ((s * (w > 0)).sum(-1, keepdim=True) - 1) / (w > 0).sum(-1, keepdim=True)
    assert torch.equal(w == 0, s <= tau)


def test_sparsemax_gradient_is_the_analytic_jacobian():
    s = torch.randn(6, 9, dtype=F64) * 2
    for row in s:
        J = jacobian(sparsemax, row)
        sigma = (sparsemax(row) > 0).to(F64)  # support indicator
        expected = torch.diag(sigma) - torch.outer(sigma, sigma) / sigma.sum()
        torch.testing.assert_close(J, expected, **TOL)


@pytest.mark.parametrize("fn", [softmax, sparsemax], ids=["softmax", "sparsemax"])
def test_gradcheck(fn):
    s = torch.randn(3, 2, 7, dtype=F64, requires_grad=True)  # continuous: no ties, no kinks hit
    assert gradcheck(fn, (s,), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", sorted(NORMALIZERS))
def test_minus_inf_gets_exactly_zero_weight_and_empty_rows_are_zero(name):
    s = torch.randn(3, 6, dtype=F64)
    s[0, [1, 4]] = float("-inf")
    s[1, 0] = float("-inf")
    s[2] = float("-inf")  # an empty row
    s.requires_grad_(True)
    w = NORMALIZERS[name](s, 2 if name == "topk" else None)
    assert (w[0, [1, 4]] == 0).all() and w[1, 0] == 0
    assert torch.equal(w[2], torch.zeros(6, dtype=F64))
    torch.testing.assert_close(w[:2].sum(-1), torch.ones(2, dtype=F64), **TOL)
    (grad,) = torch.autograd.grad((w * torch.randn(3, 6, dtype=F64)).sum(), s)
    assert torch.isfinite(grad).all()
    assert torch.equal(grad[2], torch.zeros(6, dtype=F64))
    assert (grad[0, [1, 4]] == 0).all()
