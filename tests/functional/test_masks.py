"""Masks against explicit Python loops over (b, h, i, j).

Query row ``i`` of ``Lq`` over ``Lk`` keys sits at absolute position ``p = Lk - Lq + i``
(bottom-right alignment). All comparisons are exact (bool tensors).
"""
import itertools

import pytest
import torch

from attnlab.functional.masks import (and_masks, build_mask, causal_mask, causal_mod, document_mod,
                                      evaluate_mask_mod, or_masks, padding_mask, prefix_lm_mod,
                                      sliding_window_mod, window_mask)

SHAPES = [(5, 5), (3, 7), (7, 3), (1, 6), (6, 1), (1, 1)]  # (Lq, Lk): equal, Lq < Lk, Lq > Lk


def loop_mask(Lq, Lk, allowed, B=1, H=1):
    """``(B, H, Lq, Lk)`` bool from ``allowed(b, h, p, j)`` with ``p = Lk - Lq + i``."""
    out = torch.zeros(B, H, Lq, Lk, dtype=torch.bool)
    for b, h, i, j in itertools.product(range(B), range(H), range(Lq), range(Lk)):
        out[b, h, i, j] = bool(allowed(b, h, Lk - Lq + i, j))
    return out


def materialise(mod, B, H, Lq, Lk):
    return evaluate_mask_mod(mod, B, H, Lq, Lk, "cpu").expand(B, H, Lq, Lk)


@pytest.mark.parametrize("Lq,Lk", SHAPES)
def test_causal_mask(Lq, Lk):
    expected = loop_mask(Lq, Lk, lambda b, h, p, j: j <= p)[0, 0]
    assert torch.equal(causal_mask(Lq, Lk), expected)


@pytest.mark.parametrize("Lq,Lk", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
def test_window_mask(Lq, Lk, causal):
    for w in range(1, Lk + 3):
        if causal:
            expected = loop_mask(Lq, Lk, lambda b, h, p, j: 0 <= p - j < w)[0, 0]
        else:
            expected = loop_mask(Lq, Lk, lambda b, h, p, j: p - j < w and j - p < w)[0, 0]
        assert torch.equal(window_mask(Lq, Lk, w, causal=causal), expected), w


@pytest.mark.parametrize("Lq,Lk", SHAPES)
def test_causal_mod_matches_causal_mask(Lq, Lk):
    expected = loop_mask(Lq, Lk, lambda b, h, p, j: j <= p, B=2, H=3)
    assert torch.equal(materialise(causal_mod(), 2, 3, Lq, Lk), expected)


@pytest.mark.parametrize("Lq,Lk", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
def test_sliding_window_mod(Lq, Lk, causal):
    for w in (1, 2, 4):
        if causal:
            expected = loop_mask(Lq, Lk, lambda b, h, p, j: 0 <= p - j < w)
        else:
            expected = loop_mask(Lq, Lk, lambda b, h, p, j: abs(p - j) < w)
        assert torch.equal(materialise(sliding_window_mod(w, causal=causal), 1, 1, Lq, Lk), expected)


@pytest.mark.parametrize("window", [0, -2])
def test_sliding_window_mod_rejects_non_positive_window(window):
    with pytest.raises(ValueError, match="window"):
        sliding_window_mod(window)


@pytest.mark.parametrize("Lq,Lk", SHAPES)
def test_prefix_lm_mod(Lq, Lk):
    for prefix in (0, 2, Lk):
        expected = loop_mask(Lq, Lk, lambda b, h, p, j: j < prefix or j <= p)
        assert torch.equal(materialise(prefix_lm_mod(prefix), 1, 1, Lq, Lk), expected)


@pytest.mark.parametrize("Lq", [7, 3, 1])  # queries are the last Lq of the L = 7 positions
def test_document_mod_shared_ids(Lq):
    ids = torch.tensor([0, 0, 1, 1, 1, 2, 3])
    expected = loop_mask(Lq, 7, lambda b, h, p, j: ids[p] == ids[j], B=2, H=2)
    assert torch.equal(materialise(document_mod(ids), 2, 2, Lq, 7), expected)


def test_document_mod_per_batch_ids():
    ids = torch.tensor([[0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    expected = loop_mask(6, 6, lambda b, h, p, j: ids[b, p] == ids[b, j], B=3, H=2)
    assert torch.equal(materialise(document_mod(ids), 3, 2, 6, 6), expected)


def test_document_mod_follows_ids_refilled_in_place():
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    mod = document_mod(ids)
    before = mod.key_spans(8).clone()
    ids.copy_(torch.tensor([0, 1, 1, 1, 1, 1, 1, 2]))  # the same tensor, new documents
    assert torch.equal(mod.key_spans(8), document_mod(ids.clone()).key_spans(8))
    assert not torch.equal(mod.key_spans(8), before)
    assert torch.equal(materialise(mod, 1, 1, 8, 8), loop_mask(8, 8, lambda b, h, p, j: ids[p] == ids[j]))


def test_and_or_masks():
    doc = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    mods = [causal_mod(), document_mod(doc), lambda b, h, q, kv: (kv + h) % 3 != 0]
    loops = [lambda b, h, p, j: j <= p, lambda b, h, p, j: doc[p] == doc[j],
             lambda b, h, p, j: (j + h) % 3 != 0]
    exp_and = loop_mask(7, 7, lambda *a: all(f(*a) for f in loops), H=3)
    exp_or = loop_mask(7, 7, lambda *a: any(f(*a) for f in loops), H=3)
    assert torch.equal(materialise(and_masks(*mods), 1, 3, 7, 7), exp_and)
    assert torch.equal(materialise(or_masks(*mods), 1, 3, 7, 7), exp_or)
    assert torch.equal(materialise(and_masks(mods[2]), 1, 3, 7, 7), materialise(mods[2], 1, 3, 7, 7))


def test_padding_mask():
    lengths = torch.tensor([3, 0, 5, 1])
    m = padding_mask(lengths, 5)
    assert m.shape == (4, 1, 1, 5) and m.dtype == torch.bool
    expected = loop_mask(1, 5, lambda b, h, p, j: j < lengths[b], B=4)
    assert torch.equal(m, expected)


def test_mod_sees_batch_and_head_indices():
    mod = lambda b, h, q, kv: (b + 2 * h + q + kv) % 3 == 0  # noqa: E731
    expected = loop_mask(4, 6, lambda b, h, p, j: (b + 2 * h + p + j) % 3 == 0, B=2, H=3)
    assert torch.equal(materialise(mod, 2, 3, 4, 6), expected)


def test_evaluate_mask_mod_rejects_non_bool_and_bad_shapes():
    with pytest.raises(ValueError, match="mask_mod must return a bool tensor"):
        evaluate_mask_mod(lambda b, h, q, kv: q - kv, 1, 1, 3, 3, "cpu")
    with pytest.raises(ValueError, match="mask_mod returned shape"):
        evaluate_mask_mod(lambda b, h, q, kv: torch.ones(2, 5, dtype=torch.bool), 1, 1, 3, 3, "cpu")


@pytest.mark.parametrize("Lq,Lk", [(4, 6), (6, 4)])
def test_build_mask_ands_every_constraint(Lq, Lk):
    B, H, w = 2, 3, 3
    user = torch.rand(B, 1, Lq, Lk) > 0.3
    mod = lambda b, h, q, kv: (kv + h) % 2 == 0  # noqa: E731
    for causal in (True, False):
        for window in (None, w):
            got = build_mask(B=B, H=H, Lq=Lq, Lk=Lk, device="cpu", mask=user, causal=causal,
                             window=window, mask_mod=mod).expand(B, H, Lq, Lk)

            def allowed(b, h, p, j):
                ok = bool(user[b, 0, p - (Lk - Lq), j]) and (j + h) % 2 == 0
                if causal:
                    ok = ok and j <= p
                if window is not None:
                    ok = ok and p - j < window and (causal or j - p < window)
                return ok

            assert torch.equal(got, loop_mask(Lq, Lk, allowed, B=B, H=H)), (causal, window)
    assert build_mask(B=B, H=H, Lq=Lq, Lk=Lk, device="cpu") is None
