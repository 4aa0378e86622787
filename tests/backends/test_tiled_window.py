"""Sliding windows through the tiled backend's PyTorch loop (the C++ kernel: tests/test_native_flash.py) against the
float64 reference: the gradient of a tensor a score_mod reads, empty rows, the log-sum-exp, bf16 inputs, a long
sequence against SDPA, closed-form mod backwards; and where ``auto`` takes a window. Random requests (GQA, Lq != Lk,
bidirectional windows, mask_mod) at random tile sizes: test_tiled.py.

Tolerances: float64 1e-10 (observed ~1e-15); bf16 inputs (computed in float32) 2e-2.
"""
import pytest
import torch

import attnlab
from attnlab import attention
from attnlab.backends import select_backend, tiled
from attnlab.backends.tiled import tiled_attention

from _oracle import matches_reference

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-10)

pytestmark = pytest.mark.usefixtures("python_tiled")  # the PyTorch loop, not the C++ kernel


def _qkv(B, H, Hkv, Lq, Lk, D, Dv, dtype=F64):
    return (torch.randn(B, H, Lq, D, dtype=dtype, requires_grad=True),
            torch.randn(B, Hkv, Lk, D, dtype=dtype, requires_grad=True),
            torch.randn(B, Hkv, Lk, Dv, dtype=dtype, requires_grad=True))


def _check(q, k, v, *, window, causal, block, extra=(), score_mod=None, mask_mod=None):
    run = lambda: tiled_attention(q, k, v, window=window, causal=causal, scale=q.shape[-1] ** -0.5,  # noqa: E731
                                  score_mod=score_mod, mask_mod=mask_mod, block_q=block, block_k=block,
                                  max_chunk=2 * block)
    return matches_reference(run, q, k, v, tol=TOL, extra=extra, causal=causal, window=window, score_mod=score_mod,
                             mask_mod=mask_mod)


def test_captured_tensor_gradient_equals_reference():
    q, k, v = _qkv(2, 4, 2, 30, 30, 4, 3)
    slopes = torch.rand(4, dtype=F64, requires_grad=True)
    mod = lambda s, b, h, qi, kj: s + slopes[h] * (kj - qi)  # noqa: E731
    _check(q, k, v, window=6, causal=True, block=4, score_mod=mod, extra=(slopes,))


def test_empty_rows_give_zero_output_and_neg_inf_lse():
    q, k, v = _qkv(1, 2, 2, 24, 24, 4, 4)
    mod = lambda b, h, qi, kj: qi % 5 != 0  # noqa: E731  rows 0, 5, 10, ... see nothing
    out, lse = _check(q, k, v, window=4, causal=True, block=4, mask_mod=mod)
    empty = torch.arange(24) % 5 == 0
    assert torch.all(out[:, :, empty] == 0) and torch.all(torch.isneginf(lse[:, :, empty]))
    assert torch.isfinite(lse[:, :, ~empty]).all()


def test_lse_is_logsumexp_of_windowed_scores():
    q, k, v = _qkv(1, 2, 2, 33, 33, 4, 4)
    _, lse = tiled_attention(q, k, v, window=5, causal=True, scale=0.5, block_q=4, block_k=4, max_chunk=8)
    d = torch.arange(33).view(-1, 1) - torch.arange(33)
    s = (q @ k.transpose(-2, -1) * 0.5).masked_fill(~((d >= 0) & (d < 5)), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, dim=-1).detach(), **TOL)


def test_bf16_inputs_computed_in_float32():
    q, k, v = (t.detach().float().requires_grad_() for t in _qkv(1, 2, 1, 64, 64, 8, 8))
    qb, kb, vb = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    out, _ = tiled_attention(qb, kb, vb, window=8, causal=True, scale=8 ** -0.5, block_q=8, block_k=8, max_chunk=16)
    assert out.dtype == torch.bfloat16
    ref = attention(qb.float(), kb.float(), vb.float(), causal=True, window=8, backend="reference")
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    out.float().sum().backward()
    assert qb.grad.dtype == torch.bfloat16 and torch.isfinite(qb.grad.float()).all()


def test_auto_takes_tiled_for_a_window_that_skips_half_the_work():
    """A long narrow window: ``tiled`` (it computes only the band's tiles); a window too wide or a sequence too short
    for that to skip half the work: SDPA with the dense mask (faster there, measured)."""
    assert tiled.window_saves_work(1024, 1024, 64, True) and tiled.window_saves_work(8192, 8192, 256, True)
    assert not tiled.window_saves_work(64, 64, 60, True) and not tiled.window_saves_work(1024, 1024, 1024, True)
    assert not tiled.window_saves_work(1024, 1024, None, True)
    assert tiled.window_saves_work(1024, 1024, 64, False) and not tiled.window_saves_work(1024, 1024, 300, False)
    request = dict(mask=None, causal=True, scale=0.25, score_mod=None, mask_mod=None, dropout_p=0.0,
                   normalize="softmax", top_k=None, return_weights=False)
    q, k, v = (torch.randn(1, 2, 1024, 16) for _ in range(3))
    assert select_backend(q, k, v, window=64, **request).name == "tiled"
    assert select_backend(q[:, :, :64], k[:, :, :64], v[:, :, :64], window=60, **request).name == "sdpa"


def test_long_sequence_float32_matches_sdpa_with_dense_mask():
    q, k, v = (torch.randn(1, 4, 2048, 32, requires_grad=True) for _ in range(3))
    d = torch.arange(2048).view(-1, 1) - torch.arange(2048)
    mask = (d >= 0) & (d < 128)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out = attnlab.attention(q, k, v, causal=True, window=128)
    g = torch.randn_like(out)
    want = torch.autograd.grad(ref, (q, k, v), g)
    got = torch.autograd.grad(out, (q, k, v), g)
    # float32, 128 keys per row of magnitude ~1: round-off ~1e-6 relative
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


CLOSED_FORM_MODS = {  # mods whose backward is computed without autograd: (mod, query scale, what marks it)
    "alibi": (lambda: attnlab.alibi_score_mod(attnlab.alibi_slopes(4, dtype=F64)), 1.0, "additive"),
    # scores of a few units, so that the cap (2.0) bends them: d(c·tanh(s/c))/ds = 1 - (s'/c)²
    "softcap": (lambda: attnlab.softcap_score_mod(2.0), 4.0, "grad_from_output"),
}


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("name", sorted(CLOSED_FORM_MODS))
def test_closed_form_score_mod_backward_needs_no_autograd(monkeypatch, name, window):
    """ALiBi with fixed slopes (marked additive: dS passes through) and softcap (its derivative in its output
    scales dS): the block loop computes the backward without autograd inside the blocks, with and without a
    window, and still equals the reference (autograd through the mod) in float64."""
    make, q_scale, mark = CLOSED_FORM_MODS[name]
    q, k, v = _qkv(1, 4, 2, 40, 40, 4, 3)
    with torch.no_grad():
        q.mul_(q_scale)
    mod = make()
    assert getattr(mod, mark)
    ref = attention(q, k, v, backend="reference", causal=True, window=window, score_mod=mod)
    g = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (q, k, v), g)

    def no_grad_call(*a, **kw):
        raise AssertionError("autograd.grad called inside the attention backward")

    out = attention(q, k, v, backend="tiled", causal=True, window=window, score_mod=mod)
    monkeypatch.setattr(torch.autograd, "grad", no_grad_call)
    out.backward(g)
    torch.testing.assert_close(out, ref, **TOL)
    for t, w in zip((q, k, v), want):
        torch.testing.assert_close(t.grad, w, **TOL)


def test_softcap_is_the_formula_and_refuses_a_bad_cap():
    q, k, v = _qkv(2, 3, 3, 7, 9, 5, 4)
    s = q @ k.transpose(-1, -2) / 5 ** 0.5 * 10
    want = torch.softmax(3.0 * torch.tanh(s / 3.0), dim=-1) @ v
    got = attention(q * 10, k, v, score_mod=attnlab.softcap_score_mod(3.0))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for bad in (0, -1.0, float("inf"), float("nan"), "2", True):
        with pytest.raises(ValueError, match="cap must be a positive finite number"):
            attnlab.softcap_score_mod(bad)
