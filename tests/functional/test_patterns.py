"""Sparse-Transformer and BigBird mask_mods against explicit loops over their definitions.

Query row ``i`` of ``Lq`` over ``Lk`` keys sits at absolute position ``p = Lk - Lq + i``.
Mask comparisons are exact (bool); attention outputs are compared in float64 (atol 1e-12).
"""
import itertools
import math

import pytest
import torch

from attnlab.backends import BACKENDS
from attnlab import attention
from attnlab.functional.masks import bigbird_layout, bigbird_mod, evaluate_mask_mod, fixed_mod, strided_mod

SHAPES = [(12, 12), (5, 13), (13, 5), (1, 9)]  # (Lq, Lk): equal, Lq < Lk, Lq > Lk, decoding


def loop_mask(Lq, Lk, allowed, B=1, H=1):
    """``(B, H, Lq, Lk)`` bool from ``allowed(b, h, p, j)`` with ``p = Lk - Lq + i``."""
    out = torch.zeros(B, H, Lq, Lk, dtype=torch.bool)
    for b, h, i, j in itertools.product(range(B), range(H), range(Lq), range(Lk)):
        out[b, h, i, j] = bool(allowed(b, h, Lk - Lq + i, j))
    return out


def materialise(mod, Lq, Lk, B=1, H=1):
    return evaluate_mask_mod(mod, B, H, Lq, Lk, "cpu").expand(B, H, Lq, Lk)


def density(m):
    return m.float().mean().item()


# ---- Sparse Transformer: strided -------------------------------------------------------

def strided_def(stride, causal, split_heads):
    def allowed(b, h, p, j):
        d = p - j if causal else abs(p - j)
        a1 = 0 <= d <= stride              # A(1): t = max(0, i - l) <= j <= i
        a2 = d >= 0 and d % stride == 0    # A(2): (i - j) mod l = 0
        if split_heads:
            return a1 if h % 2 == 0 else a2
        return a1 or a2
    return allowed


@pytest.mark.parametrize("Lq,Lk", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("split_heads", [False, True])
def test_strided_mod_matches_definition(Lq, Lk, causal, split_heads):
    for stride in (1, 2, 3, 5):
        expected = loop_mask(Lq, Lk, strided_def(stride, causal, split_heads), H=3)
        got = materialise(strided_mod(stride, causal=causal, split_heads=split_heads), Lq, Lk, H=3)
        assert torch.equal(got, expected), f"stride={stride}"


# ---- Sparse Transformer: fixed ---------------------------------------------------------

def fixed_def(block, c, causal, split_heads):
    def allowed(b, h, p, j):
        a1 = p // block == j // block      # A(1): same block
        a2 = j % block >= block - c        # A(2): j mod l in {l - c, ..., l}
        out = (a1 if h % 2 == 0 else a2) if split_heads else (a1 or a2)
        return out and (j <= p or not causal)
    return allowed


@pytest.mark.parametrize("Lq,Lk", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("split_heads", [False, True])
def test_fixed_mod_matches_definition(Lq, Lk, causal, split_heads):
    for block, c in ((1, 1), (3, 1), (4, 2), (5, 5)):
        expected = loop_mask(Lq, Lk, fixed_def(block, c, causal, split_heads), H=3)
        got = materialise(fixed_mod(block, num_summary=c, causal=causal, split_heads=split_heads), Lq, Lk, H=3)
        assert torch.equal(got, expected), f"block={block}, num_summary={c}"


# ---- BigBird ---------------------------------------------------------------------------

@pytest.mark.parametrize("seq_len,block,g,w,r", [(64, 4, 1, 3, 2), (61, 8, 2, 1, 3), (40, 5, 0, 5, 1),
                                                 (24, 4, 1, 3, 10), (7, 8, 1, 3, 2)])
def test_bigbird_layout_is_global_window_and_r_random(seq_len, block, g, w, r):
    layout = bigbird_layout(block, seq_len=seq_len, num_global_blocks=g, window_blocks=w,
                            num_random_blocks=r, seed=3)
    n = math.ceil(seq_len / block)
    assert layout.shape == (n, n) and layout.dtype == torch.bool
    for qb, kb in itertools.product(range(n), range(n)):
        if qb < g or kb < g or abs(qb - kb) <= w // 2:
            assert layout[qb, kb], (qb, kb)
    for qb in range(min(g, n), n):
        fixed = [kb for kb in range(n) if kb < g or abs(qb - kb) <= w // 2]
        extra = int(layout[qb].sum()) - len(fixed)
        assert extra == min(r, n - len(fixed)), f"query block {qb}: {extra} random blocks, wanted {r}"


@pytest.mark.parametrize("Lq,Lk", [(40, 40), (9, 40)])
def test_bigbird_mod_matches_block_definition(Lq, Lk):
    block = 4
    layout = bigbird_layout(block, seq_len=40, num_global_blocks=1, window_blocks=3, num_random_blocks=2, seed=5)
    # the random part is whatever the layout adds beyond global and window (its count is checked above)
    random_blocks = {qb: {kb for kb in range(10) if layout[qb, kb] and kb >= 1 and abs(qb - kb) > 1}
                     for qb in range(10)}

    def allowed(b, h, p, j):
        qb, kb = p // block, j // block
        return qb < 1 or kb < 1 or abs(qb - kb) <= 1 or kb in random_blocks[qb]

    mod = bigbird_mod(block, seq_len=40, num_global_blocks=1, window_blocks=3, num_random_blocks=2, seed=5)
    assert torch.equal(materialise(mod, Lq, Lk, B=2, H=2), loop_mask(Lq, Lk, allowed, B=2, H=2))


def test_bigbird_is_deterministic_for_a_seed_and_differs_across_seeds():
    kw = dict(seq_len=128, num_global_blocks=1, window_blocks=3, num_random_blocks=2)
    a = materialise(bigbird_mod(8, seed=0, **kw), 128, 128)
    assert torch.equal(a, materialise(bigbird_mod(8, seed=0, **kw), 128, 128))
    assert not torch.equal(a, materialise(bigbird_mod(8, seed=1, **kw), 128, 128))


# ---- sparsity, and through attention() --------------------------------------------------

PATTERNS = {
    "strided": lambda: strided_mod(16),
    "strided_split": lambda: strided_mod(16, split_heads=True),
    "fixed": lambda: fixed_mod(16, num_summary=2),
    "fixed_bidirectional": lambda: fixed_mod(16, num_summary=2, causal=False),
    "bigbird": lambda: bigbird_mod(8, seq_len=256, num_global_blocks=1, window_blocks=3, num_random_blocks=2),
}


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_patterns_are_sparse(name):
    m = materialise(PATTERNS[name](), 256, 256, H=2)
    d = density(m)
    assert 0.0 < d < 0.25, f"{name}: density {d:.3f} of the 256x256 matrix"


@pytest.mark.parametrize("name", sorted(PATTERNS))
@pytest.mark.parametrize("backend", ["sdpa", "tiled"])
def test_patterns_through_attention_agree_with_reference(name, backend):
    if backend not in BACKENDS:
        pytest.skip(f"backend {backend!r} is not registered")
    q = torch.randn(2, 4, 64, 8, dtype=torch.float64)
    k = torch.randn(2, 2, 64, 8, dtype=torch.float64)
    v = torch.randn(2, 2, 64, 6, dtype=torch.float64)
    mod = PATTERNS[name]()
    expected = attention(q, k, v, mask_mod=mod, backend="reference")
    got = attention(q, k, v, mask_mod=mod, backend=backend)
    assert torch.allclose(got, expected, atol=1e-12, rtol=0), (got - expected).abs().max()
    assert not torch.isnan(got).any()


# ---- argument checks --------------------------------------------------------------------

@pytest.mark.parametrize("build,arg", [
    (lambda: strided_mod(0), "stride"),
    (lambda: strided_mod(2.0), "stride"),
    (lambda: strided_mod(True), "stride"),
    (lambda: fixed_mod(0), "block"),
    (lambda: fixed_mod(4, num_summary=0), "num_summary"),
    (lambda: fixed_mod(4, num_summary=5), "num_summary"),
    (lambda: bigbird_mod(0, seq_len=8), "block"),
    (lambda: bigbird_mod(4, seq_len=0), "seq_len"),
    (lambda: bigbird_mod(4, seq_len=8, num_global_blocks=-1), "num_global_blocks"),
    (lambda: bigbird_mod(4, seq_len=8, window_blocks=0), "window_blocks"),
    (lambda: bigbird_mod(4, seq_len=8, window_blocks=2), "window_blocks"),
    (lambda: bigbird_mod(4, seq_len=8, num_random_blocks=-2), "num_random_blocks"),
    (lambda: bigbird_mod(4, seq_len=8, seed=-1), "seed"),
    (lambda: bigbird_layout(4, seq_len=8.5), "seq_len"),
])
def test_bad_arguments_raise_value_error_naming_them(build, arg):
    with pytest.raises(ValueError, match=arg):
        build()


@pytest.mark.parametrize("build,arg", [
    (lambda: strided_mod(2, causal=1), "causal"),
    (lambda: fixed_mod(2, split_heads="yes"), "split_heads"),
])
def test_non_bool_flags_raise_type_error(build, arg):
    with pytest.raises(TypeError, match=arg):
        build()
