"""attnlab.MultiheadAttention: a drop-in for torch.nn.MultiheadAttention, plus GQA and the KV cache.

Tolerances: float32 parity with torch 1e-5 (observed ~3e-7); float64 identities 1e-12.
"""
import pytest
import torch
from torch import nn

from attnlab import KVCache, MultiheadAttention


def _pair(kdim=None, vdim=None, bias=True):
    t = nn.MultiheadAttention(32, 4, batch_first=True, kdim=kdim, vdim=vdim, bias=bias).eval()
    return t, MultiheadAttention.from_torch(t).eval()


MASKS = {
    "none": lambda L, S: {},
    "key_padding": lambda L, S: {"key_padding_mask": torch.arange(S).expand(3, S) >= torch.tensor([[S], [S - 3], [2]])},
    "attn_bool": lambda L, S: {"attn_mask": torch.rand(L, S) > 0.7},
    "attn_float": lambda L, S: {"attn_mask": torch.randn(L, S)},
    "per_head": lambda L, S: {"attn_mask": torch.rand(3 * 4, L, S) > 0.6},
    "both_float": lambda L, S: {"key_padding_mask": torch.randn(3, S), "attn_mask": torch.randn(L, S)},
}


@pytest.mark.parametrize("dims", [(None, None), (24, 16)], ids=["packed", "kdim_vdim"])
@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("average", [True, False])
def test_matches_torch(dims, mask, average):
    t, m = _pair(*dims)
    x = torch.randn(3, 7, 32)
    kdim, vdim = dims
    key = torch.randn(3, 9, kdim or 32)
    value = torch.randn(3, 9, vdim or 32) if vdim else key
    kw = MASKS[mask](7, 9)
    a, wa = t(x, key, value, average_attn_weights=average, **kw)
    b, wb = m(x, key, value, average_attn_weights=average, **kw)
    # fully blocked rows: torch gives NaN, we give zeros — compare where torch is finite
    ok = torch.isfinite(a)
    assert torch.allclose(a[ok], b[ok], atol=1e-5)
    assert torch.isfinite(b).all()
    assert wb.shape == wa.shape
    okw = torch.isfinite(wa)
    assert torch.allclose(wa[okw], wb[okw], atol=1e-5)


def test_self_attention_defaults_and_no_weights():
    t, m = _pair()
    x = torch.randn(2, 5, 32)
    a, _ = t(x, x, x, need_weights=False)
    b, w = m(x, need_weights=False)
    assert w is None
    assert torch.allclose(a, b, atol=1e-5)


def test_causal_matches_torch_with_causal_mask():
    t, m = _pair()
    x = torch.randn(2, 6, 32)
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    a, wa = t(x, x, x, attn_mask=causal)
    b, wb = m(x, is_causal=True)
    assert torch.allclose(a, b, atol=1e-5) and torch.allclose(wa, wb, atol=1e-5)
    assert torch.count_nonzero(torch.triu(wb[0], 1)) == 0


def test_unbiased_and_training_gradients_match_torch():
    t, m = _pair(bias=False)
    t.train(), m.train()
    x = torch.randn(2, 5, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    t(x, x, x, need_weights=False)[0].square().sum().backward()
    m(x2, need_weights=False)[0].square().sum().backward()
    assert torch.allclose(x.grad, x2.grad, atol=1e-5)
    assert torch.allclose(t.in_proj_weight.grad, m.in_proj.weight.grad, atol=1e-5)


def test_gqa_equals_mha_with_repeated_kv_heads():
    torch.manual_seed(1)
    E, H, Hkv, Dh = 24, 6, 2, 4
    g = MultiheadAttention(E, H, num_kv_heads=Hkv, dtype=torch.float64).eval()
    full = MultiheadAttention(E, H, dtype=torch.float64).eval()
    with torch.no_grad():
        Wq, Wk, Wv = g.in_proj.weight.split([H * Dh, Hkv * Dh, Hkv * Dh])
        bq, bk, bv = g.in_proj.bias.split([H * Dh, Hkv * Dh, Hkv * Dh])
        rep = lambda w: w.view(Hkv, Dh, -1).repeat_interleave(H // Hkv, 0).reshape(H * Dh, *w.shape[1:])
        full.in_proj.weight.copy_(torch.cat([Wq, rep(Wk), rep(Wv)]))
        full.in_proj.bias.copy_(torch.cat([bq, rep(bk.unsqueeze(-1)).squeeze(-1), rep(bv.unsqueeze(-1)).squeeze(-1)]))
        full.out_proj.load_state_dict(g.out_proj.state_dict())
    x = torch.randn(2, 5, E, dtype=torch.float64)
    a, wa = g(x, is_causal=True, average_attn_weights=False)
    b, wb = full(x, is_causal=True, average_attn_weights=False)
    assert torch.allclose(a, b, atol=1e-12) and torch.allclose(wa, wb, atol=1e-12)
    assert g.in_proj.weight.shape == ((H + 2 * Hkv) * Dh, E)


@pytest.mark.parametrize("max_length", [None, 16], ids=["growing", "static"])
@pytest.mark.parametrize("num_kv_heads", [4, 1], ids=["mha", "mqa"])
def test_kv_cache_decoding_equals_full_forward(max_length, num_kv_heads):
    m = MultiheadAttention(32, 4, num_kv_heads=num_kv_heads).eval()
    x = torch.randn(2, 9, 32)
    full, _ = m(x, is_causal=True, need_weights=False)
    cache = KVCache(max_length=max_length)
    steps = [m(x[:, :4], is_causal=True, need_weights=False, cache=cache)[0]]  # prompt
    for t in range(4, 9):
        steps.append(m(x[:, t:t + 1], is_causal=True, need_weights=False, cache=cache)[0])
    assert cache.length == 9
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)


def test_static_cross_attention_cache_reuses_memory():
    m = MultiheadAttention(32, 4).eval()
    mem = torch.randn(2, 6, 32)
    cache = KVCache(static=True)
    y1, _ = m(torch.randn(2, 1, 32), mem, mem, cache=cache)
    q = torch.randn(2, 1, 32)
    y2, _ = m(q, torch.zeros_like(mem), torch.zeros_like(mem), cache=cache)  # memory ignored now
    ref, _ = m(q, mem, mem)
    assert cache.length == 6
    assert torch.allclose(y2, ref, atol=1e-6)
    assert not torch.allclose(y1, y2)


def test_cache_overflow_and_reorder():
    c = KVCache(max_length=3)
    k = torch.randn(2, 1, 2, 4)
    c.update(k, k)
    with pytest.raises(ValueError, match="max_length=3"):
        c.update(k, k)
    c.reorder(torch.tensor([1, 1]))
    assert torch.equal(c.k[0, :, :2], k[1]) and torch.equal(c.k[1, :, :2], k[1])
    with pytest.raises(ValueError, match="max_length"):
        KVCache(max_length=0)


def test_permutation_equivariance_without_positions():
    """The seeds' "I love you" / "you love I": self-attention alone cannot see word order."""
    torch.manual_seed(0)
    emb = nn.Embedding(3, 32)
    m = MultiheadAttention(32, 4).eval()
    i_love_you = emb(torch.tensor([[0, 1, 2]]))
    you_love_i = emb(torch.tensor([[2, 1, 0]]))
    a, _ = m(i_love_you)
    b, _ = m(you_love_i)
    # the same outputs, permuted: each word's vector does not depend on where it stands
    assert torch.allclose(a[0, [2, 1, 0]], b[0], atol=1e-6)
    # with sinusoidal positions added, "I" at position 0 and at position 2 differ
    from attnlab.functional.positional import sinusoidal_table
    pe = sinusoidal_table(3, 32)
    a, _ = m(i_love_you + pe)
    b, _ = m(you_love_i + pe)
    assert not torch.allclose(a[0, [2, 1, 0]], b[0], atol=1e-3)


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="num_kv_heads"):
        MultiheadAttention(32, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match="embed_dim=30"):
        MultiheadAttention(30, 4)
    with pytest.raises(ValueError, match="dropout"):
        MultiheadAttention(32, 4, dropout=1.0)
    with pytest.raises(ValueError, match="q_norm and k_norm go together"):
        MultiheadAttention(32, 4, q_norm=nn.LayerNorm(8))
    m = MultiheadAttention(32, 4)
    with pytest.raises(ValueError, match="query must be"):
        m(torch.randn(2, 5, 31))
    with pytest.raises(ValueError, match="key_padding_mask"):
        m(torch.randn(2, 5, 32), key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask"):
        m(torch.randn(2, 5, 32), attn_mask=torch.zeros(4, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="query"):
        m([1, 2, 3])
    with pytest.raises(ValueError, match="add_bias_kv"):
        MultiheadAttention.from_torch(nn.MultiheadAttention(8, 2, add_bias_kv=True))


@pytest.mark.parametrize("kind", ["alibi", "t5"])
def test_position_bias_dense_and_score_mod_paths_agree(kind, monkeypatch):
    """Small inputs add the bias as a dense mask (SDPA); large ones pass its score_mod (tiled)."""

    from attnlab import ALiBi, T5RelativeBias

    from attnlab.backends import dispatch  # where a position bias becomes a dense mask or a score_mod

    bias = ALiBi(4) if kind == "alibi" else T5RelativeBias(4, num_buckets=8, max_distance=32)
    m = MultiheadAttention(32, 4, position_bias=bias).eval()
    x = torch.randn(2, 40, 32, requires_grad=True)
    dense, _ = m(x, is_causal=True, need_weights=False)
    g_dense = torch.autograd.grad(dense.sum(), [x, *bias.parameters()])
    monkeypatch.setattr(dispatch, "DENSE_BIAS_LIMIT", 0)
    modded, _ = m(x, is_causal=True, need_weights=False)
    g_mod = torch.autograd.grad(modded.sum(), [x, *bias.parameters()])
    assert torch.allclose(dense, modded, atol=1e-5)
    for a, b in zip(g_dense, g_mod):
        assert torch.allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("num_kv_heads", [4, 2], ids=["mha", "gqa"])
def test_decode_step_fast_path_equals_reference_backend(num_kv_heads):
    """A one-query step with no mask goes straight to SDPA; it must equal the readable reference path."""
    from attnlab.nn.positional import RotaryEmbedding

    torch.manual_seed(0)
    fast = MultiheadAttention(32, 4, num_kv_heads=num_kv_heads, rotary=RotaryEmbedding(8)).eval()
    ref = MultiheadAttention(32, 4, num_kv_heads=num_kv_heads, rotary=RotaryEmbedding(8), backend="reference").eval()
    ref.load_state_dict(fast.state_dict())
    x = torch.randn(2, 6, 32)
    caches = KVCache(max_length=6), KVCache()
    for m, c in zip((fast, ref), caches):
        m(x[:, :5], is_causal=True, need_weights=False, cache=c)
    a, wa = fast(x[:, 5:], is_causal=True, need_weights=False, cache=caches[0])
    b, _ = ref(x[:, 5:], is_causal=True, need_weights=False, cache=caches[1])
    assert wa is None and (a - b).abs().max() <= 1e-6
    _, w = fast(x[:, :1], need_weights=True)  # weights requested: the pipeline serves them
    assert w.shape == (2, 1, 1)


@pytest.mark.parametrize("scale", [1.0, 0.05])
def test_scale_sets_kappa_on_every_path(scale):
    """``softmax(κ (Q W_Q)(K W_K)ᵀ) V W_V`` with the given κ (T5: 1), with weights materialised (gradients),
    recovered from the log-sum-exp (no gradients) and on a cached decode step; the formula written out in
    float64."""
    torch.manual_seed(0)
    m = MultiheadAttention(16, 2, head_dim=5, scale=scale, bias=False).double().eval()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    q, k, v = (t.view(2, 6, 2, 5).transpose(1, 2) for t in m.in_proj(x).split(10, dim=-1))  # (B, H, L, 5)
    w = torch.softmax(scale * q @ k.transpose(-1, -2), dim=-1)  # (B, H, L, L)
    expected = m.out_proj((w @ v).transpose(1, 2).reshape(2, 6, 10))
    out, weights = m(x, average_attn_weights=False)
    tol = 64 * torch.finfo(torch.float64).eps
    assert (out - expected).abs().max() <= tol and (weights - w).abs().max() <= tol
    with torch.no_grad():
        out2, recovered = m(x, average_attn_weights=False)
    assert (out2 - expected).abs().max() <= tol and (recovered - w).abs().max() <= tol
    cache = KVCache()
    m(x[:, :5], is_causal=True, need_weights=False, cache=cache)
    step, none = m(x[:, 5:], is_causal=True, need_weights=False, cache=cache)  # one query over the cache
    assert none is None and (step - expected[:, 5:]).abs().max() <= tol


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), True, "1"])
def test_bad_scale_names_the_argument(scale):
    with pytest.raises(ValueError, match="scale must be a positive finite float"):
        MultiheadAttention(16, 2, scale=scale)


def test_packed_self_attention_checks_its_projection_once(monkeypatch):
    """Without a cache, q, k and v cut from one packed projection are checked for NaN/inf as that one tensor (one
    reduction, not three over strided views), and a NaN in it still takes the pipeline's guarded path."""
    import attnlab.backends.dispatch as dispatch
    import attnlab.modules.multihead as multihead

    checked, original = [], dispatch.all_finite

    def counting(*tensors):
        checked.append([tuple(t.shape) for t in tensors])
        return original(*tensors)

    monkeypatch.setattr(multihead, "all_finite", counting)
    monkeypatch.setattr(dispatch, "all_finite", counting)
    torch.manual_seed(0)
    mha = MultiheadAttention(16, 2)
    x = torch.randn(2, 5, 16)
    out, _ = mha(x, x, x, need_weights=False, is_causal=True)
    assert checked == [[(2, 5, 48)], [(2, 5, 16)]]  # the packed projection, then the output (the packed node's)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *[t.view(2, 5, 2, 8).transpose(1, 2) for t in mha.in_proj(x).split(16, -1)], is_causal=True)
    torch.testing.assert_close(out, mha.out_proj(ref.transpose(1, 2).reshape(2, 5, 16)), atol=1e-5, rtol=1e-5)
    x = x.clone()
    x[1, 4] = float("nan")  # the last position of sequence 1: causal rows before it never see it
    out, _ = mha(x, x, x, need_weights=False, is_causal=True)
    assert out[0].isfinite().all() and out[1, :4].isfinite().all() and out[1, 4].isnan().all()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("backend", ["auto", "short"])
def test_training_takes_the_plain_path_with_the_pipelines_bits(causal, scale, backend, monkeypatch):
    """Training with nothing but causal and a scale (the short backend's fused kernel): ``attend_plain`` runs it
    without building the request — no ``prepare`` — on the packed projection whole (one node on ``qkv``), and the
    output and every gradient equal those of the kernel on the q, k, v views and the pipeline's to the bit (the same
    kernel call); a request it cannot take (a mask, weights asked for) goes through the pipeline."""
    import attnlab.backends.short as short
    import attnlab.modules.multihead as multihead
    from attnlab import _native
    if not _native.available():
        pytest.skip(f"the fused kernel needs attnlab's native kernels: {_native.status()}")
    prepared, original = [], multihead.prepare
    monkeypatch.setattr(multihead, "prepare", lambda *a, **kw: prepared.append(1) or original(*a, **kw))
    whole, packed_kernel = [], short.fused_short_attention_packed
    monkeypatch.setattr(short, "fused_short_attention_packed", lambda *a: whole.append(1) or packed_kernel(*a))
    torch.manual_seed(0)
    mha = MultiheadAttention(32, 4, scale=scale, backend=backend)
    x = torch.randn(2, 11, 32, requires_grad=True)
    dout = torch.randn(2, 11, 32)

    def run():
        out, _ = mha(x, x, x, need_weights=False, is_causal=causal)
        return (out, *torch.autograd.grad(out, (x, *mha.parameters()), dout))

    plain = run()
    assert prepared == [] and whole == [1]
    def on_views(qkv, heads, scale, causal, window):  # the unpacked node on q, k, v cut from the projection
        B, L, E = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
        q, k, v = (t.view(B, L, heads, E // heads).transpose(1, 2) for t in qkv.split(E, -1))
        return short.fused_short_attention(q, k, v, scale, causal, window).transpose(1, 2).reshape(B, L, E)

    monkeypatch.setattr(short, "fused_short_attention_packed", on_views)
    views = run()
    assert prepared == [] and whole == [1]
    for a, b in zip(plain, views):
        assert torch.equal(a, b)
    monkeypatch.setattr(multihead, "attend_plain", lambda *a, **kw: None)  # the pipeline
    general = run()
    assert prepared == [1]
    for a, b in zip(plain, general):
        assert torch.equal(a, b)
    monkeypatch.undo()
    prepared.clear()
    monkeypatch.setattr(multihead, "prepare", lambda *a, **kw: prepared.append(1) or original(*a, **kw))
    mha(x, x, x, need_weights=False, attn_mask=torch.zeros(11, 11, dtype=torch.bool))
    if backend == "auto":  # (short returns no weights)
        mha(x, x, x, need_weights=True, is_causal=causal)
    assert len(prepared) == (2 if backend == "auto" else 1)


def test_the_plain_path_keeps_the_pipelines_refusals():
    x = torch.randn(1, 5, 16, requires_grad=True)
    with pytest.raises(ValueError, match="top_k"):
        MultiheadAttention(16, 2, top_k=2)(x, x, x, need_weights=False, is_causal=True)
    with pytest.raises(TypeError, match="causal"):
        MultiheadAttention(16, 2)(x, x, x, need_weights=False, is_causal=1)
