"""The flex backend (FlexAttention) against the reference backend.

Fast tests run FlexAttention eagerly (``set_compile(False)``: unfused, fine for small shapes);
the ``slow`` test compiles it. Tolerances: float32 atol 1e-5, float64 atol 1e-12.
"""
import functools
import logging
import math
import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed

from attnlab.backends import BACKENDS, dispatch, flex
from attnlab import attention
from attnlab.functional.masks import (bigbird_mod, causal_mod, document_mod, fixed_mod, sliding_window_mod,
                                      strided_mod)

TOL = {torch.float32: 1e-5, torch.float64: 1e-12}
needs_tiled = pytest.mark.skipif("tiled" not in BACKENDS,
                                 reason="the 'tiled' backend (the fallback) is not registered yet")


@pytest.fixture(autouse=True)
def eager():
    previous = flex.set_compile(False)
    yield
    flex.set_compile(previous)


def request(q, **kw):
    r = dict(mask=None, causal=False, window=None, scale=1.0 / math.sqrt(q.shape[-1]), score_mod=None,
             mask_mod=None, dropout_p=0.0, normalize="softmax", top_k=None, return_weights=False)
    r.update(kw)
    return r


def run_flex(q, k, v, **kw):
    """The flex backend as the dispatcher runs it (falling back to tiled where flex cannot run)."""
    out, weights = dispatch._call(BACKENDS["flex"], q, k, v, request(q, **kw), return_lse=False)
    assert weights is None
    return out


def run_reference(q, k, v, **kw):
    return BACKENDS["reference"].fn(q, k, v, **request(q, **kw))[0]


def qkv(B=2, H=4, Hkv=4, Lq=24, Lk=24, D=8, Dv=6, dtype=torch.float32):
    return (torch.randn(B, H, Lq, D, dtype=dtype), torch.randn(B, Hkv, Lk, D, dtype=dtype),
            torch.randn(B, Hkv, Lk, Dv, dtype=dtype))


def assert_close(got, expected, dtype):
    assert not torch.isnan(got).any()
    err = (got - expected).abs().max().item()
    assert err <= TOL[dtype], f"max error {err:.2e} > {TOL[dtype]:.0e}"


SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])


def alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES.to(score.dtype)[h] * (kv_idx - q_idx)


CASES = {  # name -> (qkv kwargs, request kwargs)
    "plain": (dict(), dict()),
    "causal": (dict(), dict(causal=True)),
    "causal_bottom_right": (dict(Lq=7, Lk=24), dict(causal=True)),
    "causal_decode": (dict(Lq=1, Lk=24), dict(causal=True)),
    "window_causal": (dict(Lq=10, Lk=24), dict(window=5, causal=True)),
    "window_bidirectional": (dict(), dict(window=4)),
    "mask_mod_causal_bottom_right": (dict(Lq=9, Lk=24), dict(mask_mod=causal_mod())),
    "mask_mod_strided": (dict(Lq=9, Lk=24), dict(mask_mod=strided_mod(4))),
    "mask_mod_fixed_split": (dict(), dict(mask_mod=fixed_mod(6, num_summary=2, split_heads=True))),
    "mask_mod_bigbird": (dict(), dict(mask_mod=bigbird_mod(4, seq_len=24, num_random_blocks=1))),
    "mask_mod_document": (dict(), dict(mask_mod=document_mod(torch.tensor([0] * 10 + [1] * 9 + [2] * 5)))),
    "alibi": (dict(), dict(score_mod=alibi)),
    "alibi_causal_bottom_right": (dict(Lq=5, Lk=24), dict(score_mod=alibi, causal=True)),
    "gqa_causal": (dict(Hkv=2), dict(causal=True)),
    "mqa_window_alibi": (dict(Hkv=1, Lq=11), dict(window=6, causal=True, score_mod=alibi)),
    "scale": (dict(), dict(scale=0.7)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(CASES))
def test_flex_matches_reference(name, dtype):
    shape_kw, req_kw = CASES[name]
    q, k, v = qkv(dtype=dtype, **shape_kw)
    assert_close(run_flex(q, k, v, **req_kw), run_reference(q, k, v, **req_kw), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bool_and_float_masks(dtype):
    q, k, v = qkv(Lq=9, dtype=dtype)
    bool_mask = torch.rand(2, 1, 9, 24) > 0.4
    bias = torch.randn(1, 4, 9, 24, dtype=dtype)
    for kw in (dict(mask=bool_mask), dict(mask=bias), dict(mask=bias, causal=True, score_mod=alibi),
               dict(mask=bool_mask, mask_mod=strided_mod(3), window=8, causal=True)):
        assert_close(run_flex(q, k, v, **kw), run_reference(q, k, v, **kw), dtype)


def test_empty_rows_give_zeros():
    q, k, v = qkv(Lq=6, Lk=6)
    bool_mask = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    bool_mask[..., 2, :] = False
    bias = torch.zeros(1, 1, 6, 6)
    bias[..., 4, :] = float("-inf")
    for kw, row in ((dict(mask=bool_mask), 2), (dict(mask=bias), 4),
                    (dict(mask_mod=fixed_mod(3, split_heads=True)), 0)):  # odd heads: nothing before j=2
        out = run_flex(q, k, v, **kw)
        assert not torch.isnan(out).any()
        rows = out[:, 1::2, row] if "mask_mod" in kw else out[:, :, row]
        assert torch.equal(rows, torch.zeros_like(rows)), kw
        assert_close(out, run_reference(q, k, v, **kw), torch.float32)


def test_mods_see_absolute_query_positions():
    """Attending only to ``kv_idx == q_idx`` copies value row ``Lk - Lq + i`` into output row ``i``."""
    q, k, v = qkv(Lq=3, Lk=10)
    diagonal = lambda b, h, q_idx, kv_idx: kv_idx == q_idx  # noqa: E731
    only_diagonal = lambda s, b, h, q_idx, kv_idx: torch.where(kv_idx == q_idx, s, float("-inf"))  # noqa: E731
    assert torch.allclose(run_flex(q, k, v, mask_mod=diagonal), v[:, :, 7:], atol=1e-6)
    assert torch.allclose(run_flex(q, k, v, score_mod=only_diagonal), v[:, :, 7:], atol=1e-6)


def test_unsupported_requests_give_reasons():
    q, k, v = qkv()
    assert flex.unsupported(q, k, v, **request(q)) == ""
    assert "normalize" in flex.unsupported(q, k, v, **request(q, normalize="topk", top_k=2))
    assert "dropout" in flex.unsupported(q, k, v, **request(q, dropout_p=0.1))
    assert "return_weights" in flex.unsupported(q, k, v, **request(q, return_weights=True))


def test_block_mask_is_built_once_per_mask_and_shape(monkeypatch):
    calls = []
    real = flex.create_block_mask
    monkeypatch.setattr(flex, "create_block_mask", lambda *a, **kw: calls.append(a[1:5]) or real(*a, **kw))
    mod = strided_mod(3)
    mask = torch.rand(1, 1, 24, 24) > 0.3
    q, k, v = qkv()
    for _ in range(3):
        run_flex(q, k, v, mask_mod=mod)
        run_flex(q, k, v, mask=mask)
    assert len(calls) == 2, calls
    run_flex(q[:, :, :5], k, v, mask_mod=mod)  # new shape
    mask[..., 0, 1] = ~mask[..., 0, 1]          # mutated in place: rebuilt
    run_flex(q, k, v, mask=mask)
    assert len(calls) == 4, calls
    assert_close(run_flex(q, k, v, mask=mask), run_reference(q, k, v, mask=mask), torch.float32)


def test_block_mask_follows_document_ids_refilled_in_place():
    ids = torch.tensor([0] * 256 + [1] * 256)
    mod = document_mod(ids)
    blocks = functools.partial(flex._block_mask, 1, 2, 512, 512, "cpu", None, False, None)
    before = blocks(mod).to_dense()
    ids.copy_(torch.tensor([0] * 8 + [1] * 504))  # the first query block now reaches the second document's keys
    after = blocks(mod).to_dense()
    assert torch.equal(after, blocks(document_mod(ids.clone())).to_dense())
    assert not torch.equal(after, before)
    q, k, v = qkv(B=1, H=2, Hkv=2, Lq=512, Lk=512)
    assert_close(run_flex(q, k, v, mask_mod=mod), run_reference(q, k, v, mask_mod=document_mod(ids.clone())),
                 torch.float32)

# ---- fallbacks to tiled -----------------------------------------------------------------

def _fallback_records(caplog):
    return [r for r in caplog.records if r.name == "attnlab.backends.flex" and r.levelno == logging.DEBUG
            and "tiled" in r.getMessage()]


@needs_tiled
def test_requires_grad_on_cpu_falls_back_to_tiled_with_correct_gradients(caplog):
    q, k, v = qkv(Hkv=2, Lq=9, dtype=torch.float64)
    q.requires_grad_()
    v.requires_grad_()
    with caplog.at_level(logging.DEBUG, logger="attnlab.backends.flex"):
        out = run_flex(q, k, v, causal=True, score_mod=alibi)
    assert any("requires grad" in r.getMessage() or "require grad" in r.getMessage()
               for r in _fallback_records(caplog)), caplog.text
    (dq, dv) = torch.autograd.grad(out.square().sum(), (q, v))
    ref = run_reference(q, k, v, causal=True, score_mod=alibi)
    (rq, rv) = torch.autograd.grad(ref.square().sum(), (q, v))
    assert_close(out, ref, torch.float64)
    assert_close(dq, rq, torch.float64)
    assert_close(dv, rv, torch.float64)


@needs_tiled
def test_captured_tensor_requiring_grad_falls_back(caplog):
    slopes = torch.rand(4, dtype=torch.float64, requires_grad=True)
    q, k, v = qkv(dtype=torch.float64)
    with caplog.at_level(logging.DEBUG, logger="attnlab.backends.flex"):
        out = run_flex(q, k, v, score_mod=lambda s, b, h, i, j: s + slopes[h] * (j - i))
    assert _fallback_records(caplog), caplog.text
    assert out.requires_grad


def test_no_grad_mode_runs_flex_on_inputs_that_require_grad(caplog):
    q, k, v = qkv()
    q.requires_grad_()
    with caplog.at_level(logging.DEBUG, logger="attnlab.backends.flex"), torch.no_grad():
        out = run_flex(q, k, v, causal=True)
    assert not _fallback_records(caplog), caplog.text
    assert_close(out, run_reference(q.detach(), k, v, causal=True), torch.float32)


@needs_tiled
def test_compiled_float64_on_cpu_falls_back_without_compiling(caplog, monkeypatch):
    monkeypatch.setattr(flex, "_compiled", lambda: pytest.fail("must not compile for float64 on CPU"))
    flex.set_compile(True)
    q, k, v = qkv(dtype=torch.float64)
    with caplog.at_level(logging.DEBUG, logger="attnlab.backends.flex"):
        out = run_flex(q, k, v, window=3)
    assert any("float64" in r.getMessage() for r in _fallback_records(caplog)), caplog.text
    assert_close(out, run_reference(q, k, v, window=3), torch.float64)


@needs_tiled
def test_compile_failure_is_remembered_and_falls_back(caplog, monkeypatch):
    attempts = []

    def broken_compile():
        def fn(*a, **kw):
            attempts.append(1)
            raise BackendCompilerFailed(fn, RuntimeError("no C++ compiler"), None)
        return fn

    monkeypatch.setattr(flex, "_compiled", broken_compile)
    monkeypatch.setattr(flex, "_compiled_signatures", set())
    flex.set_compile(True)
    q, k, v = qkv()
    with caplog.at_level(logging.DEBUG, logger="attnlab.backends.flex"):
        first = run_flex(q, k, v, causal=True)
        second = run_flex(q, k, v, causal=True)
    assert len(attempts) == 1
    assert sum("no C++ compiler" in r.getMessage() for r in _fallback_records(caplog)) == 2, caplog.text
    expected = run_reference(q, k, v, causal=True)
    assert_close(first, expected, torch.float32)
    assert_close(second, expected, torch.float32)
    flex.set_compile(True)  # forgets the failure
    run_flex(q, k, v, causal=True)
    assert len(attempts) == 2


@needs_tiled
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_new_shapes_beyond_the_recompile_limit_fall_back(caplog, monkeypatch):
    compiled_calls = []

    def fake_compile():  # stands in for the compiled kernel: counts calls, computes eagerly
        return lambda *a, **kw: compiled_calls.append(1) or flex.flex_attention(*a, **kw)

    monkeypatch.setattr(flex, "_compiled", fake_compile)
    monkeypatch.setattr(flex, "_compiled_signatures", set())
    flex.set_compile(True)
    k, v = qkv()[1:]
    queries = [torch.randn(2, 4, Lq, 8) for Lq in (3, 4, 5)]
    with caplog.at_level(logging.DEBUG, logger="attnlab.backends.flex"), \
            torch._dynamo.config.patch(recompile_limit=2):
        outs = [run_flex(q, k, v, causal=True) for q in queries + queries[:1]]
    assert len(compiled_calls) == 3  # Lq = 3, 4, then 3 again; Lq = 5 is a third shape
    assert sum("recompile_limit" in r.getMessage() for r in _fallback_records(caplog)) == 1, caplog.text
    for q, out in zip(queries + queries[:1], outs, strict=True):
        assert_close(out, run_reference(q, k, v, causal=True), torch.float32)


def test_env_var_selects_eager_mode():
    env = dict(os.environ, ATTNLAB_FLEX_COMPILE="0")
    code = "import attnlab.backends.flex as f; print(f.set_compile(True))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_through_attention_when_registered():
    if "flex" not in BACKENDS:
        pytest.skip("backend 'flex' is not registered in attnlab.backends.BACKENDS")
    q, k, v = qkv(Hkv=2, Lq=9)
    mod = bigbird_mod(4, seq_len=24)
    assert_close(attention(q, k, v, mask_mod=mod, score_mod=alibi, backend="flex"),
                 attention(q, k, v, mask_mod=mod, score_mod=alibi, backend="reference"), torch.float32)
    with pytest.raises(ValueError, match="normalize"):
        attention(q, k, v, normalize="sparsemax", backend="flex")


# ---- compiled (slow: seconds per compile) -------------------------------------------------

@pytest.mark.slow
def test_compiled_matches_eager_and_reference(caplog):
    caplog.set_level(logging.DEBUG, logger="attnlab.backends.flex")
    flex.set_compile(True)
    allowed = torch.rand(2, 1, 150, 150) > 0.2
    allowed[:, :, 5] = False            # an empty row
    bias = torch.randn(1, 4, 150, 150)
    bias[:, :, 7] = float("-inf")       # another
    cases = {
        "causal_bottom_right": (dict(Lq=40, Lk=150), dict(causal=True)),
        "bigbird_gqa_alibi": (dict(Hkv=2, Lq=150, Lk=150),
                              dict(mask_mod=bigbird_mod(16, seq_len=150), score_mod=alibi)),
        "window_masks": (dict(Lq=150, Lk=150),
                         dict(window=20, causal=True, mask=allowed, mask_mod=sliding_window_mod(50))),
        "float_mask_strided": (dict(Lq=150, Lk=150), dict(mask=bias, mask_mod=strided_mod(8))),
    }
    for name, (shape_kw, req_kw) in cases.items():
        q, k, v = qkv(**shape_kw)
        compiled = run_flex(q, k, v, **req_kw)
        flex.set_compile(False)
        eager = run_flex(q, k, v, **req_kw)
        flex.set_compile(True)
        assert_close(compiled, eager, torch.float32)
        assert_close(compiled, run_reference(q, k, v, **req_kw), torch.float32)
        if name == "window_masks":
            assert torch.equal(compiled[:, :, 5], torch.zeros_like(compiled[:, :, 5]))
        if name == "float_mask_strided":
            assert torch.equal(compiled[:, :, 7], torch.zeros_like(compiled[:, :, 7]))
    # decoding: one query over a growing cache compiles once per length (static shapes)
    mod = strided_mod(8)
    for Lk in range(100, 103):  # 4 + 3 shapes: within torch._dynamo's recompile_limit (8)
        q, k, v = qkv(Hkv=2, Lq=1, Lk=Lk)
        expected = run_reference(q, k, v, causal=True, mask_mod=mod, score_mod=alibi)
        assert_close(run_flex(q, k, v, causal=True, mask_mod=mod, score_mod=alibi), expected, torch.float32)
    assert not _fallback_records(caplog), caplog.text  # every case ran compiled, none fell back
