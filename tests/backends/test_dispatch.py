"""Every choice of backend is made in :mod:`attnlab.backends.dispatch`: ``auto``, explicit names and their
fallbacks, ``return_lse``, a position bias as a dense mask or a score_mod; and attention weights take one
route (the forward keeps its fast backend, the weights follow from the rows' log-sum-exp).

Tolerances: float64 against the reference 1e-12; float32 recovered weights against float64 ones, from the
dtype (``tests/_tolerance.py``).
"""
import logging

import pytest
import torch

import attnlab
from attnlab import MultiheadAttention, attention, attention_weights
from attnlab.backends import BACKENDS, dispatch, flex, reference
from attnlab.backends.base import BackendUnavailable

from _tolerance import tolerance

F64 = torch.float64


def _qkv(B=2, H=4, Hkv=4, L=11, D=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, L, D, generator=g, dtype=F64).to(dtype) for h in (H, Hkv, Hkv)]


def _no_reference(monkeypatch):
    """Make the materialising path fail loudly if anything takes it."""
    def refuse(*a, **kw):
        raise AssertionError("the reference backend must not run here")
    monkeypatch.setitem(BACKENDS, "reference", BACKENDS["reference"].__class__("reference", refuse, reference.unsupported))


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(mask="bool"), dict(mask="float")],
                         ids=["plain", "causal", "bool_mask", "float_mask"])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_sdpa_returns_the_log_sum_exp_with_the_plain_calls_output(kw, dtype):
    q, k, v = _qkv(dtype=dtype)
    if kw.get("mask") == "bool":
        kw = dict(mask=torch.rand(2, 1, 11, 11, generator=torch.Generator().manual_seed(1)) > 0.4)
        kw["mask"][0, 0, 3] = False  # a row that sees no key: zeros and lse = -inf
    elif kw.get("mask") == "float":
        kw = dict(mask=torch.randn(1, 4, 11, 11, generator=torch.Generator().manual_seed(2), dtype=dtype))
    with torch.no_grad():
        out, lse = attention(q, k, v, return_lse=True, **kw)
        assert dispatch.choose("auto", q, k, v, dispatch.prepare(
            q, k, v, mask=kw.get("mask"), causal=kw.get("causal", False), window=None, scale=None, score_mod=None,
            mask_mod=None, dropout_p=0.0, normalize="softmax", top_k=None, return_weights=False),
            return_lse=True).name == "sdpa"
        assert torch.equal(out, attention(q, k, v, **kw))  # bitwise: the same kernel
        _, lse_tiled = attention(q, k, v, return_lse=True, backend="tiled", **kw)
    tol = tolerance(lse_tiled[torch.isfinite(lse_tiled)], n=8, depth=1)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_tiled))
    finite = torch.isfinite(lse_tiled)
    assert (lse[finite] - lse_tiled[finite]).abs().max() <= tol


def test_return_lse_with_gradients_is_served_by_tiled():
    q, k, v = (t.requires_grad_() for t in _qkv(dtype=F64))
    out, lse = attention(q, k, v, causal=True, return_lse=True)
    assert "Tiled" in type(out.grad_fn).__name__
    ref, w = attention(q, k, v, causal=True, return_weights=True, backend="reference")
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="backend='sdpa' cannot compute this request: return_lse=True with gradients"):
        attention(q, k, v, causal=True, return_lse=True, backend="sdpa")


@pytest.mark.parametrize("masks", [dict(), dict(key_padding_mask="pad"), dict(attn_mask="float")],
                         ids=["none", "padding", "float_attn_mask"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_multihead_weights_keep_the_fast_forward_and_equal_the_reference(masks, is_causal, monkeypatch):
    torch.manual_seed(0)
    fast = MultiheadAttention(32, 4).eval()
    slow = MultiheadAttention(32, 4, backend="reference").eval()
    slow.load_state_dict(fast.state_dict())
    x = torch.randn(3, 9, 32)
    kw = {}
    if masks.get("key_padding_mask"):
        kw["key_padding_mask"] = torch.arange(9).expand(3, 9) >= torch.tensor([[9], [6], [4]])
    if masks.get("attn_mask"):
        kw["attn_mask"] = torch.randn(9, 9)
    with torch.no_grad():
        plain, none = fast(x, need_weights=False, is_causal=is_causal, **kw)
        want, w_ref = slow(x, average_attn_weights=False, is_causal=is_causal, **kw)
        _no_reference(monkeypatch)
        out, w = fast(x, average_attn_weights=False, is_causal=is_causal, **kw)
    assert none is None and torch.equal(out, plain)  # weights do not change the output
    assert w.shape == (3, 4, 9, 9)
    assert (w - w_ref).abs().max() <= tolerance(w_ref, n=9, depth=2)
    assert (out - want).abs().max() <= tolerance(want, n=32, depth=2)


def test_multihead_weights_that_need_gradients_are_materialised_exactly():
    torch.manual_seed(0)
    m = MultiheadAttention(16, 2).double()
    x = torch.randn(2, 5, 16, dtype=F64, requires_grad=True)
    _, w = m(x, average_attn_weights=False, is_causal=True)
    (g,) = torch.autograd.grad((w * torch.randn_like(w)).sum(), x)
    assert torch.isfinite(g).all() and g.abs().sum() > 0  # the weights carry their gradient


def test_models_output_attentions_never_take_the_reference_path(monkeypatch):
    from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=32, n_embd=32, n_layer=2, n_head=4)).eval()
    ids = torch.randint(50, (2, 12))
    with torch.no_grad():
        plain = model(ids).logits
        _no_reference(monkeypatch)
        out = model(ids, output_attentions=True)
    assert torch.equal(out.logits, plain)
    for w in out.attentions:
        assert w.shape == (2, 4, 12, 12)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 12), rtol=0, atol=1e-5)
        assert (w.triu(1) == 0).all()  # causal


def test_position_bias_terms_dense_below_the_limit_score_mod_above(monkeypatch):
    bias = attnlab.ALiBi(4)
    dense, mod = dispatch.position_bias_terms(bias, backend="auto", heads=4, q_len=3, k_len=7, device="cpu",
                                              dtype=torch.float32)
    assert mod is None and dense.shape == (1, 4, 3, 7)
    torch.testing.assert_close(dense, bias(torch.arange(4, 7), torch.arange(7)))  # queries are the last positions
    for backend in ("tiled", "flex"):
        assert dispatch.position_bias_terms(bias, backend=backend, heads=4, q_len=3, k_len=7, device="cpu",
                                            dtype=torch.float32)[0] is None
    monkeypatch.setattr(dispatch, "DENSE_BIAS_LIMIT", 4 * 3 * 7 - 1)
    dense, mod = dispatch.position_bias_terms(bias, backend="auto", heads=4, q_len=3, k_len=7, device="cpu",
                                              dtype=torch.float32)
    assert dense is None and callable(mod)


def test_a_backend_that_finds_it_cannot_run_falls_back_through_the_registry(monkeypatch, caplog):
    q, k, v = _qkv(dtype=F64)
    monkeypatch.setattr(flex, "unavailable", lambda *a, **kw: "")

    def broken(*a, **kw):
        raise BackendUnavailable("no kernel today")

    monkeypatch.setitem(BACKENDS, "flex", BACKENDS["flex"].__class__(
        "flex", broken, flex.unsupported, unavailable=lambda *a, **kw: "", fallback="tiled"))
    with caplog.at_level(logging.DEBUG, logger="attnlab.backends.flex"):
        out = attention(q, k, v, causal=True, backend="flex")
    assert any("falls back to tiled: no kernel today" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(out, attention(q, k, v, causal=True, backend="reference"), rtol=1e-12, atol=1e-12)
    monkeypatch.setitem(BACKENDS, "flex", BACKENDS["flex"].__class__("flex", broken, flex.unsupported))
    with pytest.raises(BackendUnavailable, match="no kernel today"):  # no fallback registered: the error stands
        attention(q, k, v, causal=True, backend="flex")


def test_no_module_outside_backends_calls_a_kernel_or_picks_a_backend():
    """The choices live in backends/: nothing else calls SDPA or names a backend's internals."""
    import pathlib
    import re

    src = pathlib.Path(attnlab.__file__).parent
    offenders = []
    for path in src.rglob("*.py"):
        if path.parent.name == "backends":
            continue
        text = path.read_text()
        for pattern in (r"scaled_dot_product_attention\(", r"fused_short_attention", r"DENSE_BIAS_LIMIT",
                        r"from attnlab\.backends\.(tiled|sdpa|short|flex|reference) import"):
            if re.search(pattern, text):
                offenders.append(f"{path.relative_to(src)}: {pattern}")
    assert offenders == []


def test_a_kv_cache_remembers_finiteness_and_a_decode_step_checks_its_projection_once(monkeypatch):
    from attnlab import KVCache
    from attnlab.modules import multihead

    torch.manual_seed(0)
    m = MultiheadAttention(16, 2).eval()
    cache = KVCache(max_length=8)
    x = torch.randn(1, 4, 16)
    with torch.no_grad():
        m(x, is_causal=True, need_weights=False, cache=cache)
        assert cache.finite
        seen = []
        real = dispatch.all_finite

        def spy(*t):
            seen.append([tuple(a.shape) for a in t])
            return real(*t)

        monkeypatch.setattr(dispatch, "all_finite", spy)
        monkeypatch.setattr(multihead, "all_finite", spy)
        m(torch.randn(1, 1, 16), is_causal=True, need_weights=False, cache=cache)
        # the packed q|k|v projection of the new token, once (for the cache's new entries and for q; the cache
        # vouched for its 4 older keys and values), then the output's overflow check: nothing else is read
        assert seen == [[(1, 1, 48)], [(1, 2, 1, 8)]]
        bad = torch.randn(1, 1, 16)
        bad[0, 0, 3] = float("nan")
        out, _ = m(bad, is_causal=True, need_weights=False, cache=cache)  # the NaN token's own row is NaN
        assert not cache.finite and out.isnan().all()
        later, _ = m(torch.randn(1, 1, 16), is_causal=True, need_weights=False, cache=cache)
        assert later.isnan().all()  # a later query sees the bad key: NaN, as the formula says, never hidden
    cache.reset()
    assert cache.finite


@pytest.mark.parametrize("request_", [dict(causal=True, window=64), dict(causal=True, mask_mod=lambda b, h, i, j: i >= j),
                                      dict(score_mod=lambda s, b, h, i, j: s * 0.5)], ids=["window", "mask_mod", "mod"])
@pytest.mark.parametrize("grad", [False, True])
def test_auto_never_takes_flex_on_the_cpu(request_, grad):
    """flex comes first in SPARSE_ORDER for CUDA (its auto_when); on the CPU tiled is the fast path and flex has no
    backward, so auto must skip it with or without gradients."""
    q, k, v = (t.requires_grad_(grad) for t in _qkv(L=512, D=16))
    base = {"mask": None, "causal": False, "window": None, "scale": None, "score_mod": None, "mask_mod": None,
            "dropout_p": 0.0, "normalize": "softmax", "top_k": None, "return_weights": False}
    assert dispatch.SPARSE_ORDER[0] == "flex"
    assert not flex.auto_when(q, k, v, **{**base, **request_})
    assert dispatch.select_backend(q, k, v, **{**base, **request_}).name == "tiled"


def test_finite_fp16_inputs_whose_sum_exceeds_fp16_stay_on_the_fast_path():
    """all_finite sums fp16 in fp32: 100,000 ones sum past fp16's 65504, yet hold no NaN or inf."""
    ones = torch.ones(100_000, dtype=torch.float16)
    assert dispatch.all_finite(ones, ones)
    assert not dispatch.all_finite(ones, torch.tensor([float("nan")], dtype=torch.float16))
    assert not dispatch.all_finite(torch.tensor([float("inf")], dtype=torch.float16))
