"""`attnlab explain addressing`: attention vs a learned fixed (position-only) average on associative recall."""
import pytest
import torch

from attnlab.experiments.explain import run_experiment
from attnlab.experiments.explain.addressing import DIM, MIXINGS, FixedMixing, RecallModel, ffn_widths, make_batch

from _explain import check_files


def test_addressing_quick(tmp_path):
    r = run_experiment("addressing", tmp_path, quick=True)
    check_files(r, tmp_path, "addressing")
    att, fix = r["rows"]
    assert [att["mixing"], fix["mixing"]] == list(MIXINGS)
    assert abs(att["params"] - fix["params"]) <= 2 * DIM + 1  # the same budget, to one FFN unit
    assert len(r["by_slot"]) == r["slots"] == 4
    assert 1 / r["slots"] <= r["bag_of_values_best"] <= 1
    for row in r["rows"]:
        assert 0 <= row["max weight elsewhere"] <= 1 and 0 <= row["weight on match"] <= 1
    # the claim, with a wide margin at the fixed seed (quick: attention 1.0, fixed mixing ≈ 0.34)
    assert att["accuracy"] > 0.9 > 0.6 > fix["accuracy"]
    assert all(s["attention weight"] > att["max weight elsewhere"] for s in r["by_slot"])


def test_make_batch_answers_the_matching_value():
    keys, values, query, answer = make_batch(32, 5, torch.Generator().manual_seed(0))
    assert keys.shape == values.shape == (32, 5) and query.shape == answer.shape == (32,)
    for k, v, q, a in zip(keys.tolist(), values.tolist(), query.tolist(), answer.tolist()):
        assert len(set(k)) == 5 and v[k.index(q)] == a


def test_ffn_widths_equalise_the_parameters():
    for slots in (4, 8, 16):
        n = {m: sum(p.numel() for p in RecallModel(m, slots=slots, ffn_dim=w).parameters())
             for m, w in ffn_widths(slots).items()}
        assert abs(n["attention"] - n["fixed mixing"]) <= DIM + 1  # rounding to the nearest FFN unit


def test_weights_follow_the_content_or_do_not():
    # permuting the slots permutes attention's weights (content addressing: no positions), and leaves
    # fixed mixing's weights where they were (position-only): exact identities, float64 round-off
    torch.manual_seed(0)
    keys, values, query, _ = make_batch(8, 6, torch.Generator().manual_seed(1))
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    for mixing in MIXINGS:
        model = RecallModel(mixing, slots=6, ffn_dim=ffn_widths(6)[mixing]).double().eval()
        with torch.no_grad():
            w = model(keys, values, query, need_weights=True)[1]  # (B, K + 1)
            wp = model(keys[:, perm], values[:, perm], query, need_weights=True)[1]
        assert torch.allclose(w.sum(-1), torch.ones(8, dtype=torch.float64), atol=1e-12)
        if mixing == "attention":
            assert torch.allclose(wp[:, :6], w[:, perm], rtol=0, atol=1e-12)
            assert not torch.allclose(wp[:, :6], w[:, :6], atol=1e-3)
        else:
            assert torch.equal(wp, w)
    fixed = FixedMixing(4, 3).double()
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    with torch.no_grad():
        fixed.logits.normal_()
        want = fixed.out_proj(torch.softmax(fixed.logits, -1) @ fixed.v_proj(x))
    assert torch.allclose(fixed(x), want, rtol=0, atol=1e-12)


def test_unknown_mixing_is_refused():
    with pytest.raises(ValueError, match="mixing must be one of"):
        RecallModel("uniform", slots=4, ffn_dim=8)


@pytest.mark.slow
def test_addressing_full_attention_addresses_fixed_mixing_averages(tmp_path):
    r = run_experiment("addressing", tmp_path)
    att, fix = r["rows"]
    assert att["accuracy"] > 0.99 and all(s["attention weight"] > 0.9 for s in r["by_slot"])
    # no better than knowing the bag of values (sampling error of 4096 answers ≈ 0.007, margin 0.05)
    assert fix["accuracy"] < r["bag_of_values_best"] + 0.05
