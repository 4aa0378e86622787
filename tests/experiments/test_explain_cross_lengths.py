"""`attnlab explain cross-lengths`: cross-attention between a query and a key sequence of different lengths."""
import pytest
import torch

from attnlab.experiments.explain import run_experiment
from attnlab.experiments.explain.cross_lengths import (BOS, DIGIT0, EOS, MAX_LEN, MIN_LEN, PAD, TEST_MAX, make_batch,
                                                       shape_check)

from _explain import check_files

EPS64 = torch.finfo(torch.float64).eps


def _exact(checks):
    for c in checks:
        assert c["out"] == f"2×{c['Lq']}×16" and c["weights"] == f"2×4×{c['Lq']}×{c['Lk']}"
        # float64, E = 16, unit-normal inputs: outputs O(1), so agreement to a few hundred ulps
        assert c["max|Δout|"] < 256 * EPS64 and c["max|Δweights|"] < 256 * EPS64
        assert c["max|Σ_k w − 1|"] < 64 * EPS64
        assert c["weight on padding"] == 0.0  # masked keys: exp(-inf) = 0 exactly


def test_cross_lengths_quick(tmp_path):
    r = run_experiment("cross-lengths", tmp_path, quick=True)
    data = check_files(r, tmp_path, "cross-lengths")
    _exact(r["checks"])
    assert [(c["Lq"], c["Lk"]) for c in r["checks"]] == [(3, 7), (7, 3), (1, 16), (5, 11)]
    rows = r["by_length"]
    assert [row["source length"] for row in rows] == list(range(MIN_LEN, TEST_MAX + 1))
    for row in rows:
        S = row["source length"]
        assert row["trained on"] == (S <= MAX_LEN) and 0 <= row["exact match"] <= 1
        assert 1 < row["mean target length"] <= min(S, 10) + 1  # distinct digits, then EOS
    align = torch.tensor(data["alignment"])
    assert align.shape == (2, 4) and (align >= 0).all() and (align <= 1 + 1e-6).all()
    assert 0 < r["uniform_share"] < 1
    ex = data["example"]
    w = torch.tensor(ex["weights"])
    assert w.shape == (len(ex["target"]), len(ex["source"])) == (len(ex["target"]), 14)
    assert torch.allclose(w.sum(-1), torch.ones(len(ex["target"])), atol=1e-5)


def test_shape_check_other_seed_is_exact_too():
    _exact(shape_check(seed=3))


def test_make_batch_targets_are_the_sorted_distinct_digits():
    src, dec_in, labels = make_batch(8, torch.Generator().manual_seed(0))
    for s, d, y in zip(src, dec_in, labels):
        digits = s[s != PAD]
        assert MIN_LEN <= len(digits) <= MAX_LEN and (s[len(digits):] == PAD).all()
        want = torch.cat([torch.unique(digits), torch.tensor([EOS])])
        n = len(want)
        assert torch.equal(y[:n], want) and (y[n:] == -100).all()
        # teacher forcing: BOS, then the target shifted right (the EOS input, if it fits, predicts ignored labels)
        assert d[0] == BOS and torch.equal(d[1:n], want[:-1]) and (d[n + 1:] == PAD).all()
        assert (digits >= DIGIT0).all() and (digits < DIGIT0 + 10).all()


@pytest.mark.slow
def test_cross_lengths_full_learns_and_aligns(tmp_path):
    r = run_experiment("cross-lengths", tmp_path)
    _exact(r["checks"])
    trained = [row["exact match"] for row in r["by_length"] if row["trained on"]]
    assert min(trained) > 0.9
    assert max(max(layer) for layer in r["alignment"]) > 3 * r["uniform_share"]
