"""attnlab's C++ decoding-step kernels (csrc/decode.cpp, and gated_matvec in csrc/matvec.cpp) against independent
oracles on every instruction set this CPU runs, and the layers that call them.

Oracles and tolerances (float32, ε = 2⁻²⁴ per rounding):
- ``rms_norm``: the float64 formula; a sum of E squares (γ_E relative), a square root, a reciprocal and two
  products: ≤ (E / 2 + 6) ε relative to each output (the half: the sum's error enters under the square root).
- ``attend_decode``: float64 SDPA over the cache with the float64 RoPE of the same angles. Each score is a D-term
  dot product (γ_D of Σ|q_d k_d| · scale), each exponential is within ~2 ulps, the weighted sum a further S-term
  sum of non-negative weights: ≤ (D · scale · max Σ|q k| + S + 8) ε · max|v| absolute.
- ``gated_matvec``: its two products are matvec's (the same kernel, the same order: equal bit for bit to
  ``matvec``'s outputs) and the gate is torch's formula in float32: ≤ 8 ε (|a| + 1) |c| of ``act(a) · c``.
"""
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from attnlab import _native
from attnlab.functional.positional import apply_rope, rope_frequencies
from attnlab.modules.cache import KVCache
from _tolerance import tolerance  # tests/_tolerance.py: from the dtype and the magnitude
from _native_isas import EPS32, ISA_IDS, ISAS, isa, needs_native  # noqa: F401 (isa: a fixture)

GATE_FNS = {"glu": torch.sigmoid, "geglu": F.gelu, "geglu_tanh": lambda a: F.gelu(a, approximate="tanh"),
            "swiglu": F.silu, "relu2_glu": lambda a: F.relu(a).square()}


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@pytest.mark.parametrize("E", [1, 7, 64, 1000, 4096])
def test_rms_norm_equals_the_float64_formula(isa, E):
    gen = torch.Generator().manual_seed(E)
    x, w = torch.randn(3, 5, E, generator=gen) * 4, torch.randn(E, generator=gen)
    y = _native.rms_norm(x, w, 1e-6)
    xd = x.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert y.shape == x.shape and y.dtype == torch.float32
    assert ((y.double() - ref).abs() <= (E / 2 + 6) * EPS32 * ref.abs() + 1e-30).all()


def _case(B, H, Hkv, D, R, interleaved, position, gen):
    cap = position + 5
    qkv = torch.randn(B, 1, (H + 2 * Hkv) * D, generator=gen) * 2
    k_cache, v_cache = torch.randn(B, Hkv, cap, D, generator=gen), torch.randn(B, Hkv, cap, D, generator=gen)
    cos = sin = None
    if R:
        cos, sin = (t[position].contiguous() for t in rope_frequencies(R, torch.arange(position + 1)))
    return qkv, k_cache, v_cache, cos, sin


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@pytest.mark.parametrize("B,H,Hkv,D,R,interleaved,position", [
    (1, 16, 4, 64, 64, False, 40),     # Llama: grouped-query heads, half-split RoPE
    (2, 12, 12, 64, None, False, 0),   # GPT-2: no RoPE, the first position (one key)
    (3, 4, 2, 8, 4, True, 17),         # interleaved pairs, partial rotary (R < D)
    (1, 2, 1, 5, 2, False, 3),         # odd head size: scalar tails everywhere
    (2, 8, 8, 128, 128, True, 600),    # a long cache: several threads' worth
])
def test_attend_decode_equals_float64_rope_and_sdpa(isa, B, H, Hkv, D, R, interleaved, position):
    gen = torch.Generator().manual_seed(position + D)
    qkv, k_cache, v_cache, cos, sin = _case(B, H, Hkv, D, R, interleaved, position, gen)
    k0, v0 = k_cache.clone(), v_cache.clone()
    scale = 1 / math.sqrt(D)
    out = _native.attend_decode(qkv, k_cache, v_cache, position, H, Hkv, cos, sin, interleaved, scale)

    q, k, v = qkv.double().view(B, H + 2 * Hkv, 1, D).split([H, Hkv, Hkv], dim=1)
    if R:
        q, k = (apply_rope(t, cos.double().view(1, -1), sin.double().view(1, -1), interleaved=interleaved)
                for t in (q, k))
    # the new entries went to slot `position`, the rest of the buffers untouched
    assert (k_cache[:, :, position:position + 1].double() - k).abs().max() <= 4 * EPS32 * k.abs().max()
    assert torch.equal(v_cache[:, :, position:position + 1].double(), v)
    for new, old in ((k_cache, k0), (v_cache, v0)):
        assert torch.equal(new[:, :, :position], old[:, :, :position])
        assert torch.equal(new[:, :, position + 1:], old[:, :, position + 1:])
    keys = torch.cat([k0[:, :, :position].double(), k], 2)
    values = torch.cat([v0[:, :, :position].double(), v], 2)
    ref = F.scaled_dot_product_attention(q, keys, values, scale=scale, enable_gqa=True)  # (B, H, 1, D)
    assert out.shape == (B, 1, H * D)
    S = position + 1
    qk = (q.abs() * scale).sum(-1).max() * keys.abs().max()
    bound = (D * qk + S + 8) * EPS32 * values.abs().max()
    assert (out.view(B, H, 1, D).double() - ref).abs().max() <= bound


@needs_native
def test_attend_decode_propagates_nan_and_overflow_and_checks_its_arguments():
    gen = torch.Generator().manual_seed(0)
    qkv, k_cache, v_cache, _, _ = _case(1, 2, 2, 8, None, False, 2, gen)
    qkv[0, 0, 0] = float("nan")  # head 0's query
    out = _native.attend_decode(qkv, k_cache, v_cache, 2, 2, 2, None, None, False, 0.3)
    assert out[0, 0, :8].isnan().all() and out[0, 0, 8:].isfinite().all()
    big = torch.full_like(qkv, 1e30)  # scores overflow to inf: NaN out, as softmax's own arithmetic gives
    assert _native.attend_decode(big, k_cache, v_cache, 2, 2, 2, None, None, False, 1.0).isnan().all()
    for args, what in [((qkv, k_cache, v_cache, 7, 2, 2), "outside the cache.s room"),
                       ((qkv, k_cache, v_cache, 2, 3, 2), "multiple of kv_heads"),
                       ((qkv[..., :-1], k_cache, v_cache, 2, 2, 2), "qkv must be"),
                       ((qkv, k_cache.double(), v_cache, 2, 2, 2), "k_cache must be a contiguous float32"),
                       ((qkv, k_cache.transpose(2, 3), v_cache, 2, 2, 2), "k_cache")]:
        with pytest.raises(RuntimeError, match=what):
            _native.attend_decode(*args, None, None, False, 1.0)
    with pytest.raises(RuntimeError, match="both cos and sin"):
        _native.attend_decode(qkv, k_cache, v_cache, 2, 2, 2, torch.ones(4), None, False, 1.0)


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("activation", list(GATE_FNS))
@pytest.mark.parametrize("M,K,N", [(1, 64, 176), (3, 33, 7), (4, 256, 700)])
def test_gated_matvec_equals_its_two_products_and_torchs_gate(isa, kind, activation, M, K, N):
    gen = torch.Generator().manual_seed(M * K + N)
    x = torch.randn(M, K, generator=gen)
    args = []
    for _ in range(2):
        if kind == "int8":
            w, s = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=gen), torch.rand(N, generator=gen) / 50
        else:
            w, s = (torch.randn(N, K, generator=gen) / 4).to(torch.bfloat16 if kind == "bf16" else torch.float32), None
        args.append((w, s, torch.randn(N, generator=gen)))
    y = _native.gated_matvec(x, args[0], args[1], activation)
    a, c = (_native.matvec(x, *t) for t in args)
    ref = GATE_FNS[activation](a) * c
    assert y.shape == (M, N)
    assert ((y - ref).abs() <= 8 * EPS32 * (a.abs() + 1) * c.abs()).all()


@needs_native
def test_gated_matvec_checks_its_arguments():
    x, w = torch.randn(1, 8), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="same shape and dtype"):
        _native.gated_matvec(x, (w, None, None), (torch.randn(5, 8), None, None), "swiglu")
    with pytest.raises(RuntimeError, match="w must be a contiguous"):
        _native.gated_matvec(x, (torch.randn(4, 7), None, None), (w, None, None), "swiglu")


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "quick_gelu", "relu2"])
def test_activate_equals_torchs_activation_on_a_large_tensor(isa, activation):
    from attnlab.nn.feedforward import ACTIVATIONS
    x = torch.randn(300, 1001, generator=torch.Generator().manual_seed(0)) * 4  # not a multiple of any width
    x[0, :3] = torch.tensor([float("nan"), 50.0, -50.0])
    y = _native.activate(x, activation)
    ref = ACTIVATIONS[activation](x)
    assert y.shape == x.shape and y.data_ptr() != x.data_ptr() and y[0, 0].isnan()
    ok = ~x.isnan()
    assert ((y - ref).abs()[ok] <= 8 * EPS32 * (x.abs() + 1)[ok]).all()


@needs_native
def test_an_ffn_in_inference_takes_the_vectorised_gelu_tanh_and_keeps_autograd_in_training(monkeypatch):
    from attnlab.nn.feedforward import FeedForward
    calls = []
    orig = _native.activate
    monkeypatch.setattr(_native, "activate", lambda *a: calls.append(a[1]) or orig(*a))
    ffn = FeedForward(32, 96, activation="gelu_tanh").eval()
    x = torch.randn(2, 50, 32)
    with torch.no_grad():
        got = ffn(x)
        ref = ffn.w2(F.gelu(ffn.w1(x), approximate="tanh"))
    assert calls == ["gelu_tanh"] and (got - ref).abs().max() <= tolerance(ref, n=96, depth=2)
    xg = x.clone().requires_grad_()
    ffn(xg).sum().backward()  # with a gradient wanted: PyTorch's activation, whose backward flows
    assert calls == ["gelu_tanh"] and xg.grad is not None and xg.grad.abs().sum() > 0


# ---- the layers that call them ---------------------------------------------------------------------------------

@needs_native
@pytest.mark.parametrize("activation", list(GATE_FNS))
@pytest.mark.parametrize("mode", ["fp32", "int8"])
def test_a_gated_ffn_fuses_its_products_for_few_rows(activation, mode, monkeypatch):
    """FeedForward in inference layouts: few rows take the one fused call, which equals the same layers called one
    by one (the fused path switched off) to the gate's rounding; many rows and training keep the plain forward."""
    from attnlab.adapt.quantize import quantize
    from attnlab.nn.feedforward import FeedForward

    torch.manual_seed(0)
    wrapper = torch.nn.Sequential(FeedForward(48, 96, activation=activation)).eval()
    if mode == "int8":
        wrapper = quantize(wrapper, "int8")
    else:
        from attnlab.nn.inference import optimize_linears_
        optimize_linears_(wrapper, dtype=torch.float32, rows=1)
    ffn = wrapper[0]
    calls = []
    real = _native.gated_matvec
    monkeypatch.setattr(_native, "gated_matvec", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(2, 1, 48)
    with torch.no_grad():
        fused = ffn(x)
        assert calls == [1]
        monkeypatch.setattr(type(ffn), "_gated_native", lambda self, x: None)
        plain = ffn(x)
    assert (fused - plain).abs().max() <= 64 * EPS32 * max(1.0, float(plain.abs().max()))
    monkeypatch.undo()
    calls.clear()
    monkeypatch.setattr(_native, "gated_matvec", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        ffn(torch.randn(3, 8, 48))  # 24 rows: not a decoding step's
    assert calls == []


@needs_native
def test_rms_norm_layer_runs_the_kernel_in_inference_and_keeps_autograd_in_training(monkeypatch):
    from attnlab.nn.norms import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(40)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    counts = _count(monkeypatch, ["rms_norm"])
    x = torch.randn(3, 40, requires_grad=True)
    y = norm(x)  # autograd wants x and g: the Function
    y.sum().backward()
    assert x.grad is not None and norm.weight.grad is not None and counts["rms_norm"] == 0
    with torch.no_grad():
        fast = norm(x)
    assert counts["rms_norm"] == 1 and fast.grad_fn is None
    assert (fast - y.detach()).abs().max() <= (20 + 6) * EPS32 * y.abs().max()
    norm.weight.requires_grad_(False)
    assert norm(x).grad_fn is not None and counts["rms_norm"] == 1  # x wants a gradient: the Function


@needs_native
def test_a_layer_step_with_gradients_on_keeps_autograd(monkeypatch):
    """DecoderLayer.step called with gradients on (a user probing a step): the C++ calls have no backward, so the
    step takes PyTorch's operations: the gradients of x and of norm₁'s gain equal those with the kernels off."""
    from attnlab.nn.block import DecoderLayer

    torch.manual_seed(0)
    layer = DecoderLayer(32, 4, cross_attention=False, ffn_dim=64, activation="swiglu", norm_first=True,
                         norm="rmsnorm").eval()
    context, x0 = torch.randn(1, 5, 32), torch.randn(1, 1, 32)

    def grads():
        cache = _layer_cache(KVCache())
        with torch.no_grad():
            layer(context, cache=cache, is_causal=True)
        x = x0.clone().requires_grad_(True)
        layer.zero_grad()
        layer.step(x, cache).pow(2).sum().backward()
        return x.grad, layer.norm1.weight.grad

    gx, gw = grads()
    monkeypatch.setattr(_native, "available", lambda: False)
    rx, rw = grads()
    assert gw is not None and rw.abs().sum() > 0
    assert (gx - rx).abs().max() <= tolerance(rx, n=64, depth=2) and (gw - rw).abs().max() <= tolerance(rw, n=64, depth=2)


def test_a_cache_gives_room_in_place_and_counts_what_was_written():
    cache = KVCache()
    assert cache.room_for(1) is None  # nothing cached: shapes unknown
    k = torch.randn(2, 3, 5, 4)
    cache.update(k, k.clone())
    kb, vb = cache.room_for(1)  # grown (doubled) and contiguous, the 5 entries kept
    assert kb.shape == (2, 3, 10, 4) and kb.is_contiguous() and torch.equal(kb[:, :, :5], k)
    kb[:, :, 5] = 7.0
    cache.advance(1, finite=True)
    assert cache.length == 6 and cache.finite
    assert torch.equal(cache.update(k[:, :, :1], k[:, :, :1])[0][:, :, 5], torch.full((2, 3, 4), 7.0))
    cache.advance(0, finite=False)
    assert not cache.finite
    static = KVCache(max_length=6)
    static.update(k, k)
    assert static.room_for(1)[0].shape[2] == 6
    with pytest.raises(ValueError, match="overflow"):
        static.room_for(2)
    ring = KVCache(window=4)
    ring.update(k, k)
    assert ring.room_for(1) is None


@needs_native
def test_a_decode_without_the_native_kernels_gives_the_same_tokens():
    """A Llama (RMSNorm, RoPE, grouped-query heads, SwiGLU) greedy decode with the kernels and with
    ATTNLAB_NATIVE=0 (PyTorch's operations throughout): the same tokens."""
    code = ("import torch\nfrom attnlab.models.llama import LlamaConfig, LlamaForCausalLM\n"
            "torch.manual_seed(0)\n"
            "m = LlamaForCausalLM(LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128, "
            "num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)).eval()\n"
            "m.optimize_for_inference(dtype=torch.float32)\n"
            "ids = torch.randint(0, 101, (2, 7), generator=torch.Generator().manual_seed(1))\n"
            "print(m.generate(ids, max_new_tokens=24).tolist())\n")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "ATTNLAB_NATIVE": flag}) for flag in ("1", "0")]
    for r in runs:
        assert r.returncode == 0, r.stderr
    assert runs[0].stdout == runs[1].stdout and len(runs[0].stdout) > 100


def _small(family):
    from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel
    from attnlab.models.llama import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if family == "gpt2":  # LayerNorm, biases, GELU-tanh, learned positions, a tied head
        return GPT2LMHeadModel(GPT2Config(vocab_size=101, n_positions=128, n_embd=64, n_layer=2, n_head=4)).eval()
    return LlamaForCausalLM(LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)).eval()


def _count(monkeypatch, names):
    counts = dict.fromkeys(names, 0)
    for name in names:
        real = getattr(_native, name)
        monkeypatch.setattr(_native, name, lambda *a, _n=name, _r=real, **k: counts.__setitem__(_n, counts[_n] + 1)
                            or _r(*a, **k))
    return counts


@needs_native
def test_a_llama_step_takes_one_call_per_layer(monkeypatch):
    """One decoding step of a 2-layer Llama in inference layouts: one decoder_step per layer (plus the final
    RMSNorm); with the whole-layer call refused, per layer one attend_decode, two RMSNorms and one gated FFN."""
    from attnlab.nn.block import DecoderLayer

    m = _small("llama").optimize_for_inference(dtype=torch.float32)
    ids = torch.randint(0, 101, (1, 5), generator=torch.Generator().manual_seed(1))
    for fused, expected in ((True, {"decoder_step": 2, "attend_decode": 0, "rms_norm": 1, "gated_matvec": 0}),
                            (False, {"decoder_step": 0, "attend_decode": 2, "rms_norm": 5, "gated_matvec": 2})):
        if not fused:
            monkeypatch.setattr(DecoderLayer, "_step_native", lambda self, x, cache: None)
        with torch.no_grad():
            cache = m.new_cache()
            m(ids, past_key_values=cache, use_cache=True)
            counts = _count(monkeypatch, list(expected))
            m(ids[:, :1], past_key_values=cache, use_cache=True)
        assert counts == expected
        monkeypatch.undo()


@needs_native
@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("weights", ["fp32", "bf16", "int8"])
def test_the_one_call_layer_step_equals_the_step_in_parts(family, weights, monkeypatch):
    """decoder_step against the same step computed by the layer's parts (DecoderLayer._step_native refused: the
    same kernels called one by one), 12 greedy steps at batch 2: logits to float32 rounding, the same tokens,
    the same cache length; GPT-2 covers LayerNorm, biases and a plain FFN, Llama RMSNorm, RoPE, GQA and SwiGLU."""
    from attnlab.adapt.quantize import quantize
    from attnlab.nn.block import DecoderLayer

    m = _small(family)
    if weights == "int8":
        m = quantize(m, "int8")
    else:
        m.optimize_for_inference(dtype=torch.float32 if weights == "fp32" else torch.bfloat16)
    ids = torch.randint(0, 101, (2, 6), generator=torch.Generator().manual_seed(2))

    def decode(fused):
        if not fused:
            monkeypatch.setattr(DecoderLayer, "_step_native", lambda self, x, cache: None)
        counts = _count(monkeypatch, ["decoder_step"])
        with torch.no_grad():
            cache = m.new_cache()
            logits = [m(ids, past_key_values=cache, use_cache=True).logits[:, -1:]]
            for _ in range(12):
                logits.append(m(logits[-1].argmax(-1), past_key_values=cache, use_cache=True).logits)
        monkeypatch.undo()
        assert counts["decoder_step"] == (24 if fused else 0)  # 2 layers × 12 steps
        return torch.cat(logits, 1), cache

    fused, cache = decode(True)
    parts, cache2 = decode(False)
    assert (fused - parts).abs().max() <= tolerance(parts, n=128, depth=2)
    assert torch.equal(fused.argmax(-1), parts.argmax(-1))
    assert cache[0].self_attn.length == cache2[0].self_attn.length == 18


@needs_native
def test_the_one_call_layer_step_writes_nothing_for_a_non_finite_projection():
    m = _small("llama").optimize_for_inference(dtype=torch.float32)
    layer = m.layers[0]
    ids = torch.randint(0, 101, (1, 4), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cache = m.new_cache()
        m(ids, past_key_values=cache, use_cache=True)
        c = cache[0].self_attn
        x = torch.full((1, 1, 64), float("nan"))
        assert layer._step_native(x, c) is None and c.length == 4  # the caller's step takes it from here
        x = torch.randn(1, 1, 64)
        out = layer._step_native(x, c)
        assert out.shape == (1, 1, 64) and out.isfinite().all() and c.length == 5


@needs_native
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "quick_gelu", "relu2", "glu", "geglu",
                                        "geglu_tanh", "swiglu", "relu2_glu"])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_every_ffn_activation_and_norm_in_the_one_call_step(activation, norm):
    """A pre-norm decoder-only layer with each FFN activation (the kernel's vectorised gates: e^x within ~1 ulp,
    erf within 1.5e-7) and each norm: the one-call step against the same layer's step in parts (the unfused
    path, PyTorch's activations and norms), from the same cache, to float32 rounding of the layer's output."""
    from attnlab.nn.block import DecoderLayer
    from attnlab.nn.inference import optimize_linears_

    torch.manual_seed(0)
    layer = DecoderLayer(64, 4, cross_attention=False, ffn_dim=96, activation=activation, norm_first=True,
                         norm=norm, bias=norm == "layernorm").eval()
    optimize_linears_(layer, dtype=torch.float32, rows=1)
    ctx = torch.randn(2, 9, 64)
    fused_cache, parts_cache = KVCache(), KVCache()
    with torch.no_grad():
        for c in (fused_cache, parts_cache):
            layer(ctx, cache=_layer_cache(c), is_causal=True)
        x = torch.randn(2, 1, 64) * 2
        fused = layer._step_native(x, fused_cache)
        h = x + layer.self_attn.step(layer.norm1(x), parts_cache)
        parts = h + layer.ffn(layer.norm2(h))
    assert fused is not None and fused_cache.length == parts_cache.length == 10
    assert (fused - parts).abs().max() <= tolerance(parts, n=96, depth=2)


@needs_native
def test_the_layers_decoding_plan_follows_its_norms_hooks_and_mode():
    """The plan for decoding is cached on the layer (nn.layer_native.plan) and made again where the layer changes:
    norms of two kinds take the step in parts, one kind again the one call; a hook, while registered, the step in
    parts; train() then eval() the one call again."""
    from torch import nn

    from attnlab.nn.block import DecoderLayer
    from attnlab.nn.inference import optimize_linears_
    from attnlab.nn.norms import RMSNorm

    torch.manual_seed(0)
    layer = DecoderLayer(64, 4, cross_attention=False, ffn_dim=96, norm_first=True).eval()
    optimize_linears_(layer, dtype=torch.float32, rows=1)
    cache = KVCache()
    x = torch.randn(2, 1, 64)
    with torch.no_grad():
        layer(torch.randn(2, 5, 64), cache=_layer_cache(cache), is_causal=True)
        assert layer._step_native(x, cache) is not None
        norm2 = layer.norm2
        layer.norm2 = RMSNorm(64)
        assert layer._step_native(x, cache) is None
        layer.norm2 = norm2
        assert layer._step_native(x, cache) is not None
        hook = layer.norm1.register_forward_hook(lambda m, i, o: None)
        assert layer._step_native(x, cache) is None
        hook.remove()
        layer.train().eval()
        assert layer._step_native(x, cache) is not None and cache.length == 8


def _layer_cache(kv):
    from attnlab.nn.block import LayerCache

    return LayerCache(kv)


@needs_native
@pytest.mark.parametrize("dtype,batch,fused", [(torch.float32, 8, True), (torch.float32, 9, False),
                                               (torch.bfloat16, 4, True), (torch.bfloat16, 8, False)])
def test_batches_up_to_the_kernels_rows_take_the_one_call_step(dtype, batch, fused, monkeypatch):
    """The kernel serves up to max_rows rows (fp32 weights 8, bf16 4: measured against oneDNN's GEMM), so a
    decoding batch up to that takes decoder_step; a larger one the step in parts (oneDNN's products)."""
    m = _small("llama").optimize_for_inference(dtype=dtype)
    ids = torch.randint(0, 101, (batch, 4), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        cache = m.new_cache()
        m(ids, past_key_values=cache, use_cache=True)
        counts = _count(monkeypatch, ["decoder_step"])
        m(ids[:, :1], past_key_values=cache, use_cache=True)
    assert counts["decoder_step"] == (2 if fused else 0)
