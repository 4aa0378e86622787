"""The tiled backend against the float64 reference, with blocks small enough that every case
crosses block boundaries; its custom autograd (gradcheck), block skipping, LSE and recovered weights.

Tolerances: float64 values and gradients 1e-10 (observed ~1e-15); bf16 inputs 2e-2.
"""
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnlab
from attnlab import attention, attention_weights
from attnlab.backends.tiled import tiled_attention
from attnlab.functional.masks import captured_tensors
from attnlab.functional.masks import document_mod, prefix_lm_mod

from _oracle import matches_reference

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-10)
SMALL = dict(block_q=4, block_k=3, max_chunk=5)  # forces many blocks on short sequences
pytestmark = pytest.mark.usefixtures("python_tiled")  # the PyTorch loop, not the C++ kernel


def _qkv(B=2, H=4, Hkv=2, Lq=13, Lk=17, D=5, Dv=3, dtype=F64):
    return (torch.randn(B, H, Lq, D, dtype=dtype, requires_grad=True),
            torch.randn(B, Hkv, Lk, D, dtype=dtype, requires_grad=True),
            torch.randn(B, Hkv, Lk, Dv, dtype=dtype, requires_grad=True))


def _check(q, k, v, *, extra=(), tiles=SMALL, **kw):
    """tiled (small blocks) == reference in values and gradients w.r.t. q, k, v and ``extra``."""
    scale = kw.get("scale", q.shape[-1] ** -0.5)
    tiled_kw = {key: val for key, val in kw.items() if key != "scale"}
    return matches_reference(lambda: tiled_attention(q, k, v, scale=scale, **tiled_kw, **tiles), q, k, v,
                             tol=TOL, extra=extra, **kw)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_matches_reference_across_blocks(data):
    Hkv = data.draw(st.integers(1, 2))
    H = Hkv * data.draw(st.integers(1, 3))
    Lq, Lk = data.draw(st.integers(1, 20)), data.draw(st.integers(1, 20))
    q, k, v = _qkv(B=data.draw(st.integers(1, 2)), H=H, Hkv=Hkv, Lq=Lq, Lk=Lk,
                   D=data.draw(st.integers(1, 6)), Dv=data.draw(st.integers(1, 4)))
    kw = {}
    if data.draw(st.booleans()):
        kw["causal"] = True
    if data.draw(st.booleans()):
        kw["window"] = data.draw(st.integers(1, Lk + 2))
    mask_kind = data.draw(st.sampled_from(["none", "bool", "float", "mod"]))
    if mask_kind == "bool":
        kw["mask"] = torch.rand(1, H, Lq, Lk) > 0.4
    elif mask_kind == "float":
        kw["mask"] = torch.randn(q.shape[0], 1, Lq, Lk, dtype=F64)
    elif mask_kind == "mod":
        kw["mask_mod"] = lambda b, h, qi, kj: ((qi + kj + h) % 3) != 0
    if data.draw(st.booleans()):
        kw["score_mod"] = lambda s, b, h, qi, kj: s - 0.1 * h * (qi - kj).abs()
    tiles = dict(block_q=data.draw(st.integers(1, 8)), block_k=data.draw(st.integers(1, 8)),
                 max_chunk=data.draw(st.sampled_from([1, 5, 1024])))
    _check(q, k, v, tiles=tiles, **kw)


def test_gradcheck_custom_autograd():
    """First derivatives, and second ones (create_graph=True: the backward is differentiable again, not detached)."""
    q, k, v = _qkv(B=1, H=2, Hkv=1, Lq=7, Lk=9, D=3, Dv=2)
    slopes = torch.rand(2, dtype=F64, requires_grad=True)
    bias = torch.randn(1, 2, 7, 1, dtype=F64, requires_grad=True)

    def f(q, k, v, slopes, bias):
        mod = lambda s, b, h, qi, kj: s + slopes[h] * (kj - qi)  # noqa: E731
        return tiled_attention(q, k, v, mask=bias, causal=True, window=5, scale=0.7, score_mod=mod, **SMALL)[0]

    assert torch.autograd.gradcheck(f, (q, k, v, slopes, bias))
    assert torch.autograd.gradgradcheck(f, (q, k, v, slopes, bias))


@pytest.mark.parametrize("backend", ["tiled", "auto"])
def test_gradient_penalty_equals_reference(backend):
    """A gradient penalty ‖∂L/∂k‖² differentiated again, through the public entry (float64)."""
    docs = torch.tensor([0] * 6 + [1] * 7)
    requests = [dict(mask_mod=document_mod(docs)), dict(causal=True, window=5),
                dict(causal=True, score_mod=lambda s, b, h, qi, kj: 20.0 * torch.tanh(s / 20.0))]
    for request in requests:
        q, k, v = _qkv(Lq=13, Lk=13)

        def penalty(name):
            out = attention(q, k, v, backend=name, **request)
            dk, = torch.autograd.grad(out.square().sum(), k, create_graph=True)
            return torch.autograd.grad(dk.square().sum(), (q, k, v))

        for got, want in zip(penalty(backend), penalty("reference")):
            torch.testing.assert_close(got, want, **TOL)


def test_score_mod_gradients_reach_captured_tensors_and_modules():
    q, k, v = _qkv()
    slopes = torch.rand(4, dtype=F64, requires_grad=True)
    alibi = attnlab.ALiBi(4).double()
    t5 = attnlab.T5RelativeBias(4, num_buckets=8, max_distance=16).double()
    closure = (lambda sl: lambda s, b, h, qi, kj: s + sl[h] * (kj - qi))(slopes)
    _check(q, k, v, causal=True, score_mod=closure, extra=[slopes])
    _check(q, k, v, score_mod=t5.score_mod(), extra=[t5.relative_attention_bias.weight])
    _check(q, k, v, causal=True, score_mod=alibi.score_mod())
    assert captured_tensors(functools.partial(lambda s, w: s * w, w=slopes)) == [slopes]


def test_float_mask_gradient_with_broadcast_dims():
    q, k, v = _qkv()
    bias = torch.randn(1, 4, 1, 17, dtype=F64, requires_grad=True)
    _check(q, k, v, mask=bias, causal=True, extra=[bias])


def test_empty_rows_zero_output_neg_inf_lse_finite_grads():
    q, k, v = _qkv(Lq=9, Lk=4)  # causal, bottom-right: the first 5 queries see nothing
    out, lse = _check(q, k, v, causal=True)
    assert torch.equal(out[:, :, :5], torch.zeros_like(out[:, :, :5]))
    assert torch.isneginf(lse[:, :, :5]).all() and torch.isfinite(lse[:, :, 5:]).all()


def test_lse_equals_logsumexp_of_scores():
    q, k, v = _qkv()
    kw = dict(window=4, mask=torch.rand(13, 17) > 0.2)
    _, lse = attention(q, k, v, return_lse=True, **kw)
    s = torch.matmul(q, k.repeat_interleave(2, 1).transpose(-2, -1)) * 5 ** -0.5
    allowed = kw["mask"] & ((torch.arange(4, 17)[:, None] - torch.arange(17)).abs() < 4)
    want = torch.logsumexp(s.masked_fill(~allowed, float("-inf")), dim=-1)
    torch.testing.assert_close(lse, want.detach(), **TOL)


def _count_chunks(**kw):
    q, k, v = (torch.randn(1, 1, 256, 8) for _ in range(3))
    cfg_out = {}
    orig = attnlab.backends.tiled._TiledAttention.forward

    def spy(ctx, cfg, *a):
        res = orig(ctx, cfg, *a)
        cfg_out["plan"] = cfg.plan
        return res

    attnlab.backends.tiled._TiledAttention.forward = staticmethod(spy)
    try:
        tiled_attention(q, k, v, scale=0.3, block_q=32, block_k=32, max_chunk=32, **kw)
    finally:
        attnlab.backends.tiled._TiledAttention.forward = staticmethod(orig)
    return sum(ke - ks for _, _, chunks in cfg_out["plan"] for ks, ke, _ in chunks)


def test_block_skipping_work_grows_with_visible_keys_only():
    dense = _count_chunks()
    assert dense == 256 * 256 // 32
    causal = _count_chunks(causal=True)
    assert causal == 32 * sum(range(1, 9))  # key columns visited: lower triangle of blocks
    window = _count_chunks(causal=True, window=16)
    assert window <= 8 * 64  # at most two key blocks per query block
    docs = torch.arange(256) // 64  # four packed documents
    # block-diagonal only: per document, 2 query blocks x 2 key blocks of 32 keys
    assert _count_chunks(mask_mod=document_mod(docs)) == 4 * (2 * 2 * 32)
    assert _count_chunks(mask_mod=prefix_lm_mod(32)) < dense


def test_attention_weights_recovers_chosen_rows_and_heads():
    q, k, v = _qkv()
    slopes = torch.rand(4, dtype=F64)
    kw = dict(causal=True, window=6, score_mod=lambda s, b, h, qi, kj: s + slopes[h] * (kj - qi))
    _, w = attention(q, k, v, return_weights=True, backend="reference", **kw)
    part = attention_weights(q, k, heads=[3, 0], rows=[12, 0, 5], **kw)
    torch.testing.assert_close(part, w[:, [3, 0]][:, :, [12, 0, 5]].detach(), **TOL)
    _, lse = attention(q, k, v, return_lse=True, **kw)
    torch.testing.assert_close(attention_weights(q, k, lse=lse, **kw), w.detach(), **TOL)


def test_attention_weights_bad_arguments():
    q, k, _ = _qkv()
    with pytest.raises(ValueError, match="rows must lie in"):
        attention_weights(q, k, rows=[13])
    with pytest.raises(ValueError, match="heads must be"):
        attention_weights(q, k, heads=[])
    with pytest.raises(ValueError, match="lse must be a tensor of shape"):
        attention_weights(q, k, lse=torch.zeros(2, 4, 12))
    with pytest.raises(ValueError, match="return_lse=True is computed by the 'sdpa' or 'tiled' backend"):
        attention(*_qkv(), return_lse=True, backend="reference")


def test_bf16_inputs_computed_in_float32():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 300, 32) for _ in range(3))
    ref = attention(q, k, v, window=40, causal=True, backend="reference")
    out = attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), window=40, causal=True, backend="tiled")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_unsupported_requests_are_refused_with_reasons():
    q, k, v = _qkv()
    for kw, why in [(dict(normalize="sparsemax"), "softmax only"), (dict(dropout_p=0.1), "dropout"),
                    (dict(return_weights=True), "attention_weights")]:
        with pytest.raises(ValueError, match=why):
            attention(q, k, v, backend="tiled", **kw)


@pytest.mark.parametrize("fn, got", [(lambda s, b, h, qi, kj: s[..., :1], "shape"),
                                     (lambda s, b, h, qi, kj: s.float(), "dtype torch.float32")])
def test_score_mod_returning_wrong_shape_or_dtype_is_named(fn, got):
    with pytest.raises(ValueError, match=f"score_mod must return a tensor of the scores' shape .*{got}"):
        attention(*_qkv(), score_mod=fn, backend="tiled")
