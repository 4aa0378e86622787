"""Positional modules against oracles: tables indexed by hand, Hugging Face Llama RoPE and
T5 ``compute_bias``, formula loops, and the attention pipeline (score_mod path == bias path).

Tolerances: float64 1e-12 (loops, score_mod vs bias through the reference backend);
float32 vs HF 1e-6; exact (==) where the two computations are the same arithmetic.
"""
import pytest
import torch
from transformers import LlamaConfig, T5Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.t5.modeling_t5 import T5Attention

from attnlab import attention
from attnlab.functional.positional import alibi_slopes, apply_rope, rope_frequencies, sinusoidal_table
from attnlab.nn.positional import (ALiBi, LearnedPositionalEmbedding, RotaryEmbedding, SinusoidalPositionalEmbedding,
                                   T5RelativeBias)

# ----------------------------------------------------------------------------- absolute


def test_sinusoidal_module_indexes_the_table():
    emb = SinusoidalPositionalEmbedding(10, max_positions=32)
    positions = torch.tensor([[0, 5, 31], [2, 2, 7]])
    out = emb(positions)
    assert out.shape == (2, 3, 10)
    assert torch.equal(out, sinusoidal_table(32, 10)[positions])
    assert emb.state_dict() == {}  # non-persistent buffer


def test_learned_module_is_an_embedding():
    emb = LearnedPositionalEmbedding(16, 4)
    positions = torch.tensor([3, 0, 15])
    assert torch.equal(emb(positions), emb.weight[positions])
    assert list(emb.state_dict()) == ["weight"] and emb.max_positions == 16
    emb(positions).sum().backward()
    assert emb.weight.grad[3].abs().sum() > 0 and emb.weight.grad[1].abs().sum() == 0


@pytest.mark.parametrize("make", [lambda: SinusoidalPositionalEmbedding(8, max_positions=10),
                                  lambda: LearnedPositionalEmbedding(10, 8)])
def test_absolute_embeddings_reject_positions_past_max(make):
    emb = make()
    with pytest.raises(ValueError, match="max_positions=10"):
        emb(torch.tensor([3, 10]))
    with pytest.raises(ValueError, match="positions must be >= 0"):
        emb(torch.tensor([-1]))
    with pytest.raises(TypeError, match="positions"):
        emb(torch.tensor([1.0]))


@pytest.mark.parametrize("make,name", [(lambda: SinusoidalPositionalEmbedding(0), "dim"),
                                       (lambda: SinusoidalPositionalEmbedding(4, max_positions=0), "max_positions"),
                                       (lambda: LearnedPositionalEmbedding(0, 4), "max_positions"),
                                       (lambda: LearnedPositionalEmbedding(4, -1), "dim")])
def test_absolute_embeddings_reject_bad_args(make, name):
    with pytest.raises(ValueError, match=name):
        make()


# ----------------------------------------------------------------------------- RoPE


def test_rotary_module_equals_hf_llama_and_grows_its_cache():
    B, H, L, D = 2, 4, 6, 8
    config = LlamaConfig(hidden_size=H * D, num_attention_heads=H, head_dim=D,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    q, k = torch.randn(B, H, L, D), torch.randn(B, H, L, D)
    positions = torch.arange(40, 40 + L)  # past the initial cache: it must grow
    cos, sin = LlamaRotaryEmbedding(config)(q, positions.expand(B, L))
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    rotary = RotaryEmbedding(D, max_positions=4)
    torch.testing.assert_close(rotary(q, positions), q_hf, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rotary(k, positions), k_hf, rtol=1e-6, atol=1e-6)
    assert rotary.cached_positions >= 46
    assert rotary.state_dict() == {}
    # a grown cache gives exactly what a large-enough cache gives
    assert torch.equal(rotary(q, positions), RotaryEmbedding(D, max_positions=64)(q, positions))


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_module_matches_functional_and_per_sample_positions(interleaved):
    x = torch.randn(2, 3, 5, 12, dtype=torch.float64)
    rotary = RotaryEmbedding(12, rotary_dim=8, interleaved=interleaved, base=500.0)
    pos = torch.arange(7, 12)
    cos, sin = rope_frequencies(8, pos, base=500.0, dtype=torch.float64)
    expected = apply_rope(x, cos, sin, interleaved=interleaved)
    torch.testing.assert_close(rotary(x, pos), expected, rtol=0, atol=1e-12)
    assert torch.equal(rotary(x, pos)[..., 8:], x[..., 8:])
    # (B, L) positions: sample 0 at 7.., sample 1 at 0..
    per_sample = rotary(x, torch.stack([pos, torch.arange(5)]))
    torch.testing.assert_close(per_sample[0], expected[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(per_sample[1], rotary(x, torch.arange(5))[1], rtol=0, atol=1e-12)


def test_rotary_float32_uses_cache_float64_is_exact():
    x = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    pos = torch.arange(1000, 1004)
    rotary = RotaryEmbedding(8)
    torch.testing.assert_close(rotary(x.float(), pos).double(), rotary(x, pos), rtol=0, atol=5e-4)
    assert rotary(x.half(), pos).dtype == torch.float16


@pytest.mark.parametrize("kwargs,name", [(dict(head_dim=7), "head_dim"), (dict(head_dim=0), "head_dim"),
                                         (dict(head_dim=8, rotary_dim=5), "rotary_dim"),
                                         (dict(head_dim=8, rotary_dim=10), "rotary_dim"),
                                         (dict(head_dim=8, max_positions=0), "max_positions"),
                                         (dict(head_dim=8, base=1.0), "base")])
def test_rotary_rejects_bad_args(kwargs, name):
    with pytest.raises(ValueError, match=name):
        RotaryEmbedding(**kwargs)


def test_rotary_rejects_bad_inputs():
    rotary = RotaryEmbedding(8)
    with pytest.raises(ValueError, match="x must be"):
        rotary(torch.randn(1, 2, 3, 6), torch.arange(3))
    with pytest.raises(ValueError, match="positions must be"):
        rotary(torch.randn(1, 2, 3, 8), torch.arange(4))
    with pytest.raises(ValueError, match="positions must be >= 0"):
        rotary(torch.randn(1, 2, 3, 8), torch.arange(-1, 2))


# ----------------------------------------------------------------------------- ALiBi / T5


@pytest.mark.parametrize("causal", [True, False])
def test_alibi_forward_equals_formula(causal):
    H = 6
    alibi = ALiBi(H, causal=causal)
    q_pos, k_pos = torch.arange(3, 7), torch.arange(7)
    bias = alibi(q_pos, k_pos)
    assert bias.shape == (1, H, 4, 7) and bias.dtype == torch.float32
    slopes = alibi_slopes(H, dtype=torch.float64).tolist()
    for h in range(H):
        for i, qp in enumerate(q_pos.tolist()):
            for j, kp in enumerate(k_pos.tolist()):
                expected = slopes[h] * (kp - qp) if causal else -slopes[h] * abs(kp - qp)
                assert abs(float(bias[0, h, i, j]) - expected) < 1e-6
    assert alibi.state_dict() == {}


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("past", [0, 5])
def test_t5_forward_equals_hf_compute_bias(bidirectional, past):
    H, Lq = 4, 3
    config = T5Config(d_model=16, d_kv=4, num_heads=H, relative_attention_num_buckets=16,
                      relative_attention_max_distance=20, is_decoder=not bidirectional)
    hf = T5Attention(config, has_relative_attention_bias=True, layer_idx=0)
    ours = T5RelativeBias(H, bidirectional=bidirectional, num_buckets=16, max_distance=20)
    ours.load_state_dict(hf.state_dict(), strict=False)  # shares HF's name relative_attention_bias.weight
    assert torch.equal(ours.relative_attention_bias.weight, hf.relative_attention_bias.weight)
    Lk = past + Lq if not bidirectional else 40
    expected = hf.compute_bias(Lq, Lk, past_seen_tokens=past)
    got = ours(torch.arange(past, past + Lq), torch.arange(Lk))
    assert got.shape == (1, H, Lq, Lk)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def _bias_vs_score_mod(module, *, Lq, Lk, causal):
    """Attention output with the bias as a float mask vs with the module's score_mod."""
    H = module.num_heads
    q = torch.randn(2, H, Lq, 8, dtype=torch.float64)
    k, v = torch.randn(2, H, Lk, 8, dtype=torch.float64), torch.randn(2, H, Lk, 5, dtype=torch.float64)
    bias = module(torch.arange(Lk - Lq, Lk), torch.arange(Lk))  # queries bottom-right aligned
    via_bias, w_bias = attention(q, k, v, mask=bias, causal=causal, backend="reference", return_weights=True)
    via_mod, w_mod = attention(q, k, v, score_mod=module.score_mod(), causal=causal, backend="reference",
                               return_weights=True)
    torch.testing.assert_close(via_mod, via_bias, rtol=0, atol=1e-12)
    torch.testing.assert_close(w_mod, w_bias, rtol=0, atol=1e-12)
    return via_mod


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("Lq,Lk", [(6, 6), (2, 9)])
def test_alibi_score_mod_equals_bias(causal, Lq, Lk):
    out = _bias_vs_score_mod(ALiBi(5, causal=causal).double(), Lq=Lq, Lk=Lk, causal=causal)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("Lq,Lk", [(6, 6), (2, 30)])
def test_t5_score_mod_equals_bias_and_trains(bidirectional, Lq, Lk):
    t5 = T5RelativeBias(3, bidirectional=bidirectional, num_buckets=8, max_distance=16).double()
    out = _bias_vs_score_mod(t5, Lq=Lq, Lk=Lk, causal=not bidirectional)
    out.sum().backward()
    assert t5.relative_attention_bias.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("make", [lambda: ALiBi(0), lambda: T5RelativeBias(-1), lambda: ALiBi(2.5)])
def test_bias_modules_reject_bad_num_heads(make):
    with pytest.raises(ValueError, match="num_heads"):
        make()


def test_bias_modules_reject_bad_args_and_positions():
    with pytest.raises(ValueError, match="num_buckets"):
        T5RelativeBias(2, num_buckets=3)
    with pytest.raises(ValueError, match="max_distance"):
        T5RelativeBias(2, num_buckets=32, max_distance=4)
    for module in (ALiBi(2), T5RelativeBias(2)):
        with pytest.raises(ValueError, match="q_positions"):
            module(torch.arange(4).view(2, 2), torch.arange(4))
        with pytest.raises(ValueError, match="k_positions must be >= 0"):
            module(torch.arange(2), torch.arange(-1, 3))
