"""Positional functions against independent oracles: float64 formula loops, complex arithmetic,
and the Hugging Face implementations (Llama RoPE, BLOOM ALiBi, T5 buckets).

Tolerances: float64 comparisons 1e-12; float32 comparisons with HF 1e-6; exact (==) where
the arithmetic is integer or bit-identical by construction.
"""
import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.bloom.modeling_bloom import build_alibi_tensor
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.t5.modeling_t5 import T5Attention

from attnlab.functional.positional import (alibi_score_mod, alibi_slopes, apply_rope, rope_frequencies,
                                           sinusoidal_table, t5_relative_buckets)

# ----------------------------------------------------------------------------- sinusoidal


@pytest.mark.parametrize("dim,base", [(16, 10000.0), (7, 10000.0), (6, 100.0)])
def test_sinusoidal_table_equals_paper_formula(dim, base):
    P = 50
    expected = torch.empty(P, dim, dtype=torch.float64)
    for pos in range(P):
        for j in range(dim):
            i2 = j - j % 2  # the "2i" of column j
            angle = pos / base ** (i2 / dim)
            expected[pos, j] = math.sin(angle) if j % 2 == 0 else math.cos(angle)
    got = sinusoidal_table(P, dim, base=base, dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    assert sinusoidal_table(P, dim, base=base).dtype == torch.float32


@pytest.mark.parametrize("kwargs,name", [(dict(num_positions=-1, dim=4), "num_positions"),
                                         (dict(num_positions=4, dim=0), "dim"),
                                         (dict(num_positions=4, dim=4, base=1.0), "base")])
def test_sinusoidal_table_rejects_bad_args(kwargs, name):
    with pytest.raises(ValueError, match=name):
        sinusoidal_table(**kwargs)


# ----------------------------------------------------------------------------- RoPE


def _rope(x, positions, *, interleaved=False, rotary_dim=None, base=10000.0):
    cos, sin = rope_frequencies(rotary_dim or x.shape[-1], positions, base=base, dtype=x.dtype)
    return apply_rope(x, cos, sin, interleaved=interleaved)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [None, 8])
def test_rope_preserves_norms(interleaved, rotary_dim):
    x = torch.randn(2, 3, 10, 16, dtype=torch.float64)
    pos = torch.arange(100, 110)
    y = _rope(x, pos, interleaved=interleaved, rotary_dim=rotary_dim)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(y, x)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_inner_product_depends_only_on_offset(interleaved):
    q = torch.randn(16, dtype=torch.float64).expand(1, 1, 1, 16)
    k = torch.randn(16, dtype=torch.float64).expand(1, 1, 1, 16)

    def score(m, n):
        qm = _rope(q, torch.tensor([m]), interleaved=interleaved)
        kn = _rope(k, torch.tensor([n]), interleaved=interleaved)
        return float((qm * kn).sum())

    for offset in (-7, 0, 3, 40):
        scores = [score(m, m - offset) for m in (50, 61, 300, 1000)]
        assert max(scores) - min(scores) < 1e-9, (offset, scores)
    # and it does change with the offset
    assert abs(score(50, 47) - score(50, 43)) > 1e-3


@pytest.mark.parametrize("base", [10000.0, 500000.0])
def test_rope_half_split_equals_hf_llama(base):
    B, H, L, D = 2, 3, 12, 16
    config = LlamaConfig(hidden_size=H * D, num_attention_heads=H, head_dim=D, max_position_embeddings=64,
                         rope_parameters={"rope_type": "default", "rope_theta": base})
    hf_rope = LlamaRotaryEmbedding(config)
    q, k = torch.randn(B, H, L, D), torch.randn(B, H, L, D)
    position_ids = torch.arange(20, 20 + L).expand(B, L)
    cos_hf, sin_hf = hf_rope(q, position_ids)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos_hf, sin_hf)
    pos = torch.arange(20, 20 + L)
    torch.testing.assert_close(_rope(q, pos, base=base), q_hf, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(_rope(k, pos, base=base), k_hf, rtol=1e-6, atol=1e-6)


def test_rope_interleaved_equals_complex_multiplication():
    B, H, L, D = 2, 2, 9, 12
    x = torch.randn(B, H, L, D, dtype=torch.float64)
    pos = torch.arange(3, 3 + L)
    theta = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)         # (D/2,)
    rotation = torch.polar(torch.ones(L, D // 2, dtype=torch.float64), pos[:, None].double() * theta)
    xc = torch.view_as_complex(x.reshape(B, H, L, D // 2, 2).contiguous())
    expected = torch.view_as_real(xc * rotation).reshape(B, H, L, D)
    torch.testing.assert_close(_rope(x, pos, interleaved=True), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("interleaved", [False, True])
def test_partial_rotary_leaves_tail_untouched(interleaved):
    x = torch.randn(2, 2, 5, 20, dtype=torch.float64)
    pos = torch.arange(5)
    y = _rope(x, pos + 7, interleaved=interleaved, rotary_dim=8)
    assert torch.equal(y[..., 8:], x[..., 8:])
    torch.testing.assert_close(y[..., :8], _rope(x[..., :8].contiguous(), pos + 7, interleaved=interleaved),
                               rtol=0, atol=0)


def test_rope_frequencies_shape_and_values():
    cos, sin = rope_frequencies(8, torch.arange(6).view(2, 3), base=100.0, dtype=torch.float64)
    assert cos.shape == sin.shape == (2, 3, 4)
    m, i = 5, 3
    torch.testing.assert_close(cos[1, 2, i], torch.tensor(math.cos(m * 100.0 ** (-2 * i / 8)), dtype=torch.float64))
    torch.testing.assert_close(sin[1, 2, i], torch.tensor(math.sin(m * 100.0 ** (-2 * i / 8)), dtype=torch.float64))


def test_rope_rejects_bad_inputs():
    with pytest.raises(ValueError, match="head_dim"):
        rope_frequencies(7, torch.arange(3))
    with pytest.raises(ValueError, match="base"):
        rope_frequencies(8, torch.arange(3), base=0.5)
    with pytest.raises(TypeError, match="positions"):
        rope_frequencies(8, torch.arange(3.0))
    cos, sin = rope_frequencies(8, torch.arange(3))
    with pytest.raises(ValueError, match="rotate 8 dims"):
        apply_rope(torch.randn(1, 1, 3, 6), cos, sin)


# ----------------------------------------------------------------------------- ALiBi


def test_alibi_slopes_power_of_two():
    assert alibi_slopes(8).tolist() == [2.0 ** -h for h in range(1, 9)]
    assert alibi_slopes(4, dtype=torch.float64).tolist() == [2.0 ** (-2 * h) for h in range(1, 5)]


def test_alibi_slopes_twelve_heads_written_out():
    expected = [2.0 ** -h for h in range(1, 9)] + [2.0 ** -0.5, 2.0 ** -1.5, 2.0 ** -2.5, 2.0 ** -3.5]
    torch.testing.assert_close(alibi_slopes(12, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64),
                               rtol=1e-15, atol=0)


@pytest.mark.parametrize("num_heads", [1, 2, 3, 5, 6, 8, 12, 16, 20, 24, 40])
def test_alibi_slopes_equal_hf_bloom(num_heads):
    # build_alibi_tensor(ones) puts slope_h * position; at position 1 that is the slope itself
    alibi = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), num_heads, torch.float32)  # (H, 1, 2)
    torch.testing.assert_close(alibi_slopes(num_heads), alibi[:, 0, 1], rtol=1e-6, atol=0)


@pytest.mark.parametrize("num_heads", [0, -2, 2.0, True])
def test_alibi_slopes_reject_bad_num_heads(num_heads):
    with pytest.raises(ValueError, match="num_heads"):
        alibi_slopes(num_heads)


@pytest.mark.parametrize("causal", [True, False])
def test_alibi_score_mod_formula(causal):
    H, Lq, Lk = 3, 4, 6
    slopes = alibi_slopes(H, dtype=torch.float64)
    score = torch.randn(2, H, Lq, Lk, dtype=torch.float64)
    b = torch.arange(2).view(2, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    q_idx = torch.arange(Lk - Lq, Lk).view(1, 1, Lq, 1)
    kv_idx = torch.arange(Lk).view(1, 1, 1, Lk)
    got = alibi_score_mod(slopes, causal=causal)(score, b, h, q_idx, kv_idx)
    expected = score.clone()
    for hh in range(H):
        for i in range(Lq):
            for j in range(Lk):
                d = j - (Lk - Lq + i)
                expected[:, hh, i, j] += slopes[hh] * d if causal else -slopes[hh] * abs(d)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    # float16 scores stay float16
    assert alibi_score_mod(slopes)(score.half(), b, h, q_idx, kv_idx).dtype == torch.float16


# ----------------------------------------------------------------------------- T5 buckets


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 20), (6, 7)])
def test_t5_buckets_equal_hf(bidirectional, num_buckets, max_distance):
    relative = torch.arange(-400, 401).view(1, -1) + torch.tensor([[0], [3]])  # (2, 801)
    expected = T5Attention._relative_position_bucket(relative, bidirectional=bidirectional,
                                                     num_buckets=num_buckets, max_distance=max_distance)
    got = t5_relative_buckets(relative, bidirectional=bidirectional, num_buckets=num_buckets,
                              max_distance=max_distance)
    assert got.dtype == torch.long
    assert torch.equal(got, expected)
    assert int(got.min()) >= 0 and int(got.max()) < num_buckets


def test_t5_buckets_small_distances_are_exact():
    r = torch.arange(-7, 8)
    got = t5_relative_buckets(r, bidirectional=True, num_buckets=32, max_distance=128)
    # r <= 0 -> |r| ; r > 0 -> 16 + r
    assert got.tolist() == [7, 6, 5, 4, 3, 2, 1, 0] + [16 + d for d in range(1, 8)]
    got = t5_relative_buckets(r, bidirectional=False, num_buckets=32, max_distance=128)
    assert got.tolist() == [7, 6, 5, 4, 3, 2, 1, 0] + [0] * 7


def test_t5_buckets_reject_bad_args():
    r = torch.arange(-3, 3)
    with pytest.raises(ValueError, match="num_buckets"):
        t5_relative_buckets(r, num_buckets=2)
    with pytest.raises(ValueError, match="max_distance"):
        t5_relative_buckets(r, num_buckets=32, max_distance=8)
    with pytest.raises(TypeError, match="relative_position"):
        t5_relative_buckets(r.float())
