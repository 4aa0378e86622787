"""`attnlab explain more-heads`: heads at a fixed width, the number of lookups vs each head's rank."""
import pytest
import torch

from attnlab.experiments.explain import run_experiment
from attnlab.experiments.explain.more_heads import DIM, KEYS, PAIRS, SLOTS, LookupModel, make_batch, rank_stats

from _explain import check_files


def test_more_heads_quick(tmp_path):
    r = run_experiment("more-heads", tmp_path, quick=True)
    check_files(r, tmp_path, "more-heads")
    rows = r["rows"]
    assert [row["heads"] for row in rows] == [1, 4, 64] and [row["d_head"] for row in rows] == [64, 16, 1]
    for row in rows:
        assert 0 <= row["all fields"] <= row["field acc"] <= 1 and row["test loss"] > 0
        assert 1 <= row["logit rank"] <= min(row["d_head"], KEYS) and 0 <= row["keys matched"] <= 1
    assert rows[-1]["logit rank"] == 1  # d_head = 1: every head's logits are an outer product


def test_make_batch_pairs_and_queries():
    keys, vals, query, target = make_batch(16, torch.Generator().manual_seed(0))
    assert keys.shape == vals.shape == (16, PAIRS) and query.shape == target.shape == (16, SLOTS)
    for k, v, q, t in zip(keys, vals, query, target):
        assert len(set(k.tolist())) == PAIRS and len(set(q.tolist())) == SLOTS
        for qf, tf in zip(q.tolist(), t.tolist()):
            assert v[k.tolist().index(qf)] == tf  # the value paired with the query key


@pytest.mark.parametrize("heads", [1, 4, 64])
def test_matching_is_the_attention_logits(heads):
    # with the value embeddings and the other slots zeroed, slot f's query attends with softmax(M_f[h, a, keys])
    torch.manual_seed(0)
    model = LookupModel(heads).double()
    keys, vals, query, _ = make_batch(3, torch.Generator().manual_seed(1))
    # random weights: the rank bound min(d_head, K) is attained
    assert rank_stats(model.matching())["logit rank"] == min(DIM // heads, KEYS)
    f = 2
    with torch.no_grad():
        model.val.weight.zero_()
        for g, emb in enumerate(model.slot):
            if g != f:
                emb.weight.zero_()
        q, pairs = model.embed(keys, vals, query)
        w = model.attn(q, pairs, pairs, average_attn_weights=False)[1][:, :, 0]  # (B, H, N)
    m = model.matching()[f]  # (H, K, K)
    want = torch.stack([m[:, query[b, f], keys[b]] for b in range(3)]).softmax(-1)
    assert w.shape == (3, heads, PAIRS) and torch.allclose(w, want, rtol=0, atol=1e-12)


@pytest.mark.slow
def test_more_heads_full_rises_then_falls(tmp_path):
    rows = {row["heads"]: row for row in run_experiment("more-heads", tmp_path)["rows"]}
    best = max(row["field acc"] for row in rows.values())
    assert rows[4]["field acc"] > 0.95 and rows[1]["field acc"] < 0.5
    assert rows[64]["field acc"] < best - 0.2 and rows[64]["logit rank"] == 1
