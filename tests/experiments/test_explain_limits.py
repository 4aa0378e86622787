"""`attnlab explain limits`: parity vs length for one attention layer and a GRU; order without positions."""
import itertools
import math

import pytest
import torch
from torch import nn

from attnlab.experiments.explain import run_experiment
from attnlab.experiments.explain.limits import (MODELS, AttentionClassifier, build, evaluate, first_bit,
                                                order_blind_bound, parity)

from _explain import check_files


def test_limits_quick(tmp_path):
    r = run_experiment("limits", tmp_path, quick=True)
    data = check_files(r, tmp_path, "limits")
    lengths = sorted({row["length"] for row in r["rows"]})
    assert len(r["rows"]) == len(MODELS) * len(lengths) and lengths[0] == 2
    for row in r["rows"]:
        assert 0 <= row["accuracy"] <= 1 and 0 <= row["prediction flips"] <= 1 and row["mean |Δ logit|"] >= 0
        assert row["trained on it"] == (row["length"] <= r["train_lengths"][1])
    # no positions: the [CLS] logit is a function of the multiset of bits (float64 round-off)
    assert all(gap < 1e-12 for gap in r["permutation_gap"].values()) and len(data["permutation_gap"]) == 2
    for row in r["first_bit"]:
        assert row["order-blind bound"] == order_blind_bound(8) and 0 < row["± (1 s.e.)"] < 0.02


def test_order_blind_bound_is_the_best_count_based_guess():
    for n in range(1, 11):  # brute force: for each count of ones, guess the majority value of b_1
        by_count = {}
        for bits in itertools.product((0, 1), repeat=n):
            by_count.setdefault(sum(bits), []).append(bits[0])
        best = sum(max(v.count(0), v.count(1)) for v in by_count.values()) / 2 ** n
        assert math.isclose(order_blind_bound(n), best, rel_tol=1e-12)
    assert order_blind_bound(1) == 1.0 and order_blind_bound(16) < 0.6


class _ExactParity(nn.Module):
    """logit = +1 when the count of ones is odd, −1 otherwise: parity itself."""

    def forward(self, bits):
        return 2.0 * (bits.sum(-1) % 2).float() - 1.0


def test_evaluate_on_exact_parity_and_a_constant():
    bits = torch.randint(2, (40, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(parity(bits), bits.sum(-1) % 2) and torch.equal(first_bit(bits), bits[:, 0])
    ev = evaluate(_ExactParity(), bits, parity)
    assert ev == {"accuracy": 1.0, "prediction flips": 1.0, "mean |Δ logit|": 2.0}
    const = evaluate(lambda b: torch.zeros(b.shape[0]), bits, parity)
    assert const["prediction flips"] == 0.0 and const["mean |Δ logit|"] == 0.0
    assert const["accuracy"] == (parity(bits) == 0).float().mean().item()


def test_attention_without_positions_is_permutation_invariant():
    torch.manual_seed(0)
    model = AttentionClassifier().double().eval()
    bits = torch.randint(2, (16, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(bits)
        for perm in (torch.arange(19, -1, -1), torch.randperm(20, generator=torch.Generator().manual_seed(2))):
            assert torch.allclose(model(bits[:, perm]), base, rtol=0, atol=1e-12)
        assert not torch.allclose(model(1 - bits), base, atol=1e-6)  # not blind to the content


def test_unknown_model_is_refused():
    with pytest.raises(ValueError, match="model must be one of"):
        build("lstm")


@pytest.mark.slow
def test_limits_full_gru_generalises_attention_does_not(tmp_path):
    r = run_experiment("limits", tmp_path)
    n_train = r["train_lengths"][1]
    by = {(row["model"], row["length"]): row for row in r["rows"]}
    lengths = sorted({n for _, n in by})
    assert all(by["GRU", n]["accuracy"] > 0.99 and by["GRU", n]["prediction flips"] > 0.99 for n in lengths)
    assert by["attention", 2]["accuracy"] == 1.0  # it fits tiny lengths ...
    longer = [n for n in lengths if n > n_train]
    assert all(by["attention", n]["accuracy"] < 0.65 for n in longer)  # ... and is near chance beyond
    assert all(by["attention", n]["accuracy"] < 0.6 for n in longer if n >= 2 * n_train)
    assert by["attention", lengths[-1]]["prediction flips"] < 0.05
    att, gru = r["first_bit"]
    assert att["accuracy"] < att["order-blind bound"] + 3 * att["± (1 s.e.)"] and gru["accuracy"] > 0.95
