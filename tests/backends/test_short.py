"""The two CPU training paths ``auto`` chooses between: the ``sdpa`` backend (torch's fused kernel) and the
``short`` backend (its fused C++ kernel, taken for at most ``SHORT_KEYS`` keys; every request the kernel does not
take by :func:`~attnlab.backends.short.formula`).

The conformance suite already holds both dtypes of the short path to the float64 reference
(it trains with gradients on short sequences); here: which path runs when, gradcheck, the short backend against
SDPA (float32, 1e-5), bf16 against float64 (2e-2), a learned additive bias.
"""
import pytest
import torch

from attnlab import attention
from attnlab.backends import short

F64 = torch.float64


def _qkv(B=2, H=3, Lq=9, Lk=9, D=8, Dv=5, dtype=torch.float32, grad=True):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, L, d, generator=gen, dtype=F64).to(dtype).requires_grad_(grad)
            for L, d in ((Lq, D), (Lk, D), (Lk, Dv))]


def _grads(out, leaves):
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=F64).to(out.dtype)
    return torch.autograd.grad((out * weights).sum(), leaves)


@pytest.fixture
def formula_calls(monkeypatch):
    """How many times the short backend ran its general path, :func:`~attnlab.backends.short.formula`."""
    calls = []
    orig = short.formula
    monkeypatch.setattr(short, "formula", lambda *a, **kw: calls.append(1) or orig(*a, **kw))
    return calls


def _path(out) -> str:
    """``out``'s autograd node: a Python Function's (…Backward), or the fused kernel's op's (attnlab::short_attention,
    called ShortAttention here)."""
    name = out.grad_fn.name()
    return "ShortAttention (the fused op)" if "attnlab_short_attention" in name else name


def test_short_path_runs_only_when_training_short_sequences_on_cpu(monkeypatch, formula_calls):
    q, k, v = _qkv()  # a value width other than D: the short backend's formula
    attention(q, k, v, causal=True, backend="auto")
    assert formula_calls == [1]
    with torch.no_grad():  # inference: the fused kernel
        assert attention(q, k, v, causal=True, backend="auto").grad_fn is None
    attention(q, k, v, causal=True, backend="auto", dropout_p=0.1)
    monkeypatch.setattr(short, "SHORT_KEYS", 8)  # 9 keys is now long
    attention(q, k, v, causal=True, backend="auto")
    assert formula_calls == [1]
    q, k, v = _qkv(Dv=8)
    assert "ShortAttention (the fused op)" == _path(attention(q, k, v, causal=True, backend="short"))


def test_gqa_keeps_the_fused_kernel():
    q, _, _ = _qkv(H=4)
    _, k, v = _qkv(H=2)
    assert "ShortAttention" not in _path(attention(q, k, v, causal=True, backend="auto"))


def test_short_is_a_registered_backend_that_auto_takes_only_for_cpu_training():
    from attnlab.backends import AUTO_ORDER, BACKENDS, select_backend

    assert BACKENDS["short"].auto_when is short.auto_when and AUTO_ORDER.index("short") < AUTO_ORDER.index("sdpa")
    q, k, v = _qkv()
    request = dict(mask=None, causal=True, window=None, scale=0.5, score_mod=None, mask_mod=None, dropout_p=0.0,
                   normalize="softmax", top_k=None, return_weights=False)
    assert select_backend(q, k, v, **request).name == "short"
    with torch.no_grad():
        assert select_backend(q, k, v, **request).name == "sdpa"
    assert select_backend(q.detach(), k.detach(), v.detach(), **request).name == "sdpa"


def test_asked_for_by_name_it_computes_inference_and_grouped_queries_exactly():
    q, _, _ = _qkv(H=4, dtype=F64)
    _, k, v = _qkv(H=2, dtype=F64)
    mask = torch.rand(9, 9, generator=torch.Generator().manual_seed(5)) > 0.3
    for kw in (dict(causal=True), dict(mask=mask), dict(window=3)):
        out = attention(q, k, v, backend="short", **kw)
        ref = attention(q, k, v, backend="reference", **kw)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        for a, b in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v))):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(attention(q, k, v, backend="short"), attention(q, k, v, backend="reference"),
                                   rtol=1e-12, atol=1e-12)
    for kw, why in ((dict(dropout_p=0.1), "dropout"), (dict(normalize="sparsemax"), "softmax"),
                    (dict(score_mod=lambda s, b, h, i, j: s), "score_mod"), (dict(return_weights=True), "weights")):
        with pytest.raises(ValueError, match=f"backend='short' cannot compute this request: .*{why}"):
            attention(q, k, v, backend="short", **kw)


def test_gradcheck_and_empty_rows():
    q, k, v = _qkv(B=1, H=2, Lq=4, Lk=5, D=3, Dv=2, dtype=F64)

    def formula(q, k, v, mask=None):
        return short.formula(q, k, v, mask=mask, causal=False, window=None, scale=0.7, mask_mod=None)
    assert torch.autograd.gradcheck(formula, (q, k, v))
    finite = torch.randn(1, 2, 4, 5, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(formula, (q, k, v, finite))
    # second derivatives (create_graph=True: the backward is differentiable again, not detached)
    assert torch.autograd.gradgradcheck(formula, (q, k, v, finite))
    bias = torch.randn(1, 2, 4, 5, dtype=F64)
    bias[0, :, 1] = -torch.inf  # query 1 sees no key
    bias.requires_grad_(True)
    out = formula(q, k, v, bias)
    gq, gb = torch.autograd.grad(out.sum(), (q, bias))
    assert torch.equal(out[0, :, 1], torch.zeros_like(out[0, :, 1]))
    assert torch.equal(gq[0, :, 1], torch.zeros_like(gq[0, :, 1])) and torch.equal(gb[0, :, 1], torch.zeros_like(gb[0, :, 1]))
    assert torch.isfinite(gq).all() and torch.isfinite(gb).all()


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(causal=True, window=4)])
def test_gradient_penalty_through_auto_equals_reference(kw, formula_calls):
    """A gradient penalty ‖∂L/∂k‖² differentiated again through ``auto``'s short path (float64)."""
    q, k, v = _qkv(dtype=F64)

    def penalty(backend):
        out = attention(q, k, v, backend=backend, **kw)
        dk, = torch.autograd.grad(out.square().sum(), k, create_graph=True)
        return out, torch.autograd.grad(dk.square().sum(), (q, k, v))

    (out, got), (_, want) = penalty("auto"), penalty("reference")
    assert formula_calls == [1]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_half_precision_training_outside_the_short_path_runs_the_kernel_in_float32():
    """Attention dropout and GQA in bf16: the fused kernel in float32, cast back (its bf16 backward is slow)."""
    q, _, _ = _qkv(H=4, dtype=torch.bfloat16)
    _, k, v = _qkv(H=2, Dv=8, dtype=torch.bfloat16)
    out = attention(q, k, v, causal=True, backend="auto")
    assert out.dtype == torch.bfloat16 and _path(out) == "ToCopyBackward0"
    leaves = [t.detach().to(F64) for t in (q, k, v)]
    ref = attention(*leaves, causal=True, backend="reference")
    torch.testing.assert_close(out.to(F64), ref, rtol=0, atol=2e-2)
    q2, k2, v2 = _qkv(dtype=torch.bfloat16)
    assert _path(attention(q2, k2, v2, causal=True, backend="auto", dropout_p=0.1)) == "ToCopyBackward0"


@pytest.mark.parametrize("kw", [dict(causal=True), dict(mask="bool"), dict(mask="float"), dict(window=3, causal=True)],
                         ids=["causal", "bool_mask", "float_mask", "window"])
def test_short_path_equals_fused_kernel_float32(kw, monkeypatch, formula_calls):
    q, k, v = _qkv(Lq=7, Lk=11)
    if kw.get("mask") == "bool":
        kw = dict(mask=torch.rand(2, 1, 7, 11, generator=torch.Generator().manual_seed(2)) > 0.3)
    elif kw.get("mask") == "float":
        kw = dict(mask=torch.randn(7, 11, generator=torch.Generator().manual_seed(3)))
    ours = attention(q, k, v, backend="short", **kw)
    g_short = _grads(ours, (q, k, v))
    fused = attention(q, k, v, backend="sdpa", **kw)
    assert formula_calls == [1] and "ShortAttention" not in _path(fused)  # Dv != D: the formula
    torch.testing.assert_close(ours, fused, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_short, _grads(fused, (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bf16_training_path_against_float64_reference():
    q, k, v = _qkv(B=4, H=4, Lq=64, Lk=64, D=32, Dv=32, dtype=torch.bfloat16)
    out = attention(q, k, v, causal=True, backend="auto")
    assert out.dtype == torch.bfloat16 and "ShortAttention" in _path(out)
    ref_leaves = [t.detach().to(F64).requires_grad_(True) for t in (q, k, v)]
    ref = attention(*ref_leaves, causal=True, backend="reference")
    torch.testing.assert_close(out.to(F64), ref, rtol=0, atol=2e-2)
    for a, b in zip(_grads(out.float(), (q, k, v)), _grads(ref, ref_leaves)):
        torch.testing.assert_close(a.to(F64), b, rtol=0, atol=5e-2)


def test_learned_bias_gets_the_reference_gradient(formula_calls):
    q, k, v = _qkv(dtype=F64)
    bias = torch.randn(1, 3, 9, 9, dtype=F64, requires_grad=True)
    out = attention(q, k, v, mask=bias, causal=True, backend="short")
    assert formula_calls == [1]
    got = _grads(out, (q, k, v, bias))
    ref = attention(q, k, v, mask=bias, causal=True, backend="reference")
    for a, b in zip(got, _grads(ref, (q, k, v, bias))):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_short_attention_backward_under_bf16_autocast_with_padding():
    """A training step of an encoder-decoder under CPU bf16 autocast (the demo's and multi30k's shape:
    the short backend's formula with key padding). The incoming gradient can be float32 while q, k, v are bf16."""
    import torch.nn.functional as F

    from attnlab.data.synthetic import PAD, ReverseTask
    from attnlab.experiments.demo import demo_config
    from attnlab.models.transformer import Seq2SeqTransformer

    torch.manual_seed(0)
    task = ReverseTask(seed=0)
    model = Seq2SeqTransformer(demo_config(task.vocab_size))
    src, tgt = task.train_batch(16, torch.Generator().manual_seed(0))
    grads = {}
    for dtype in (torch.float32, torch.bfloat16):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            logits = model(src, tgt[:, :-1], src_key_padding_mask=src == PAD, tgt_key_padding_mask=tgt[:, :-1] == PAD)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt[:, 1:].reshape(-1),
                                   ignore_index=PAD)
        loss.backward()
        grads[dtype] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    g32, g16 = grads[torch.float32], grads[torch.bfloat16]
    assert torch.isfinite(g16).all()
    # bf16 rounds each product's inputs to 8 significant bits: the gradient direction survives
    assert F.cosine_similarity(g32, g16, dim=0) > 0.98


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_packed_node_equals_the_node_on_the_views(dtype, causal):
    """The fused kernel on a packed projection ``qkv (B, L, 3E)`` (one node, ``∂L/∂qkv`` written whole) gives the
    output and the gradient of the node on the q, k, v views cut from it, bit for bit, in float32 and bf16."""
    from attnlab import _native
    if not _native.available():
        pytest.skip(f"the fused kernel needs attnlab's native kernels: {_native.status()}")
    gen = torch.Generator().manual_seed(5)
    B, L, H, D = 3, 21, 4, 8
    qkv = torch.randn(B, L, 3 * H * D, generator=gen).to(dtype).requires_grad_(True)
    dout = torch.randn(B, L, H * D, generator=gen).to(dtype)
    out = short.fused_short_attention_packed(qkv, H, 0.4, causal, None)
    (g_packed,) = torch.autograd.grad(out, qkv, dout)
    q, k, v = (t.view(B, L, H, D).transpose(1, 2) for t in qkv.split(H * D, -1))
    ref = short.fused_short_attention(q, k, v, 0.4, causal, None).transpose(1, 2).reshape(B, L, H * D)
    (g_views,) = torch.autograd.grad(ref, qkv, dout)
    assert out.shape == (B, L, H * D) and out.dtype == dtype
    assert torch.equal(out, ref) and torch.equal(g_packed, g_views)
    with pytest.raises(RuntimeError, match="qkv must be"):
        short.fused_short_attention_packed(qkv[..., :-1], H, 0.4, causal, None)


@pytest.mark.parametrize("reduce", ["sum", "mean_over_heads"])
def test_a_gradient_that_arrives_expanded_reaches_the_fused_kernel_exactly(reduce):
    """The gradient of ``sum()`` / ``mean(dim)`` arrives as a stride-0 view; the fused backward takes it as rows."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 48, 16) for _ in range(3))
    grads = []
    for backend in ("auto", "reference"):
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attention(*xs, causal=True, backend=backend)
        (out.sum() if reduce == "sum" else out.mean(dim=1).sum()).backward()
        grads.append([x.grad for x in xs])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
