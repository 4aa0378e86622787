"""LMBatches / lm_eval_batches: nanoGPT-style blocks, rank sharding of the global batch, exact resume."""
import io

import pytest
import torch

from attnlab.data.batching import LMBatches, lm_eval_batches

DATA = torch.arange(1000) % 97  # a stream whose offsets are recoverable: data[i] = i % 97


def test_blocks_are_contiguous_and_shifted():
    it = LMBatches(DATA, block_size=16, batch_size=8, seed=0)
    for _ in range(5):
        x, y = next(it)
        assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.long
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert torch.equal((x[:, 1:] - x[:, :-1]) % 97, torch.ones(8, 15, dtype=torch.long))
    assert it.step == 5


def test_every_start_offset_is_reachable_and_in_range():
    data = torch.arange(20)
    it = LMBatches(data, block_size=4, batch_size=64, seed=1)
    starts = torch.cat([next(it)[0][:, 0] for _ in range(20)])
    assert set(starts.tolist()) == set(range(20 - 4))  # the last target is data[N-1]


def test_same_as_nanogpt_draw():
    """The global batch is nanoGPT's get_batch with torch.randint(len(data) - block_size, (B,)) on our generator."""
    it = LMBatches(DATA, block_size=8, batch_size=4, seed=5)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        ix = torch.randint(len(DATA) - 8, (4,), generator=g)
        x_ref = torch.stack([DATA[i:i + 8] for i in ix])
        y_ref = torch.stack([DATA[i + 1:i + 9] for i in ix])
        x, y = next(it)
        assert torch.equal(x, x_ref) and torch.equal(y, y_ref)


def test_ranks_partition_the_single_process_batch():
    single = LMBatches(DATA, block_size=8, batch_size=6, seed=3)
    ranks = [LMBatches(DATA, block_size=8, batch_size=6, seed=3, rank=r, world_size=3) for r in range(3)]
    for _ in range(4):
        x, y = next(single)
        parts = [next(r) for r in ranks]
        assert all(p[0].shape == (2, 8) for p in parts)
        assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)


def test_resume_draws_the_same_batches():
    a = LMBatches(DATA, block_size=8, batch_size=4, seed=0)
    for _ in range(3):
        next(a)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    expected = [next(a) for _ in range(3)]
    b = LMBatches(DATA, block_size=8, batch_size=4, seed=123)
    buf.seek(0)
    b.load_state_dict(torch.load(buf, weights_only=True))
    assert b.step == 3
    for (x, y), (xb, yb) in zip(expected, (next(b) for _ in range(3))):
        assert torch.equal(x, xb) and torch.equal(y, yb)


def test_eval_batches_are_fixed():
    e1 = lm_eval_batches(DATA, block_size=8, batch_size=4, num_batches=3, seed=7)
    torch.manual_seed(99)  # the global RNG plays no part
    e2 = lm_eval_batches(DATA, block_size=8, batch_size=4, num_batches=3, seed=7)
    assert len(e1) == 3 and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(e1, e2))
    e3 = lm_eval_batches(DATA, block_size=8, batch_size=4, num_batches=3, seed=8)
    assert not torch.equal(e1[0][0], e3[0][0])


def test_small_integer_dtypes_give_int64():
    x, _ = next(LMBatches(DATA.to(torch.int16), block_size=4, batch_size=2, seed=0))
    assert x.dtype == torch.long


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(batch_size=5, world_size=2), ValueError, "divisible by world_size"),
    (dict(rank=2, world_size=2), ValueError, "rank must be < world_size"),
    (dict(block_size=0), ValueError, "block_size must be an int >= 1, got 0"),
    (dict(block_size=1000), ValueError, "more than block_size"),
    (dict(batch_size=2.0), TypeError, "batch_size must be an int"),
])
def test_bad_arguments(kwargs, err, match):
    args = dict(block_size=8, batch_size=4, seed=0) | kwargs
    with pytest.raises(err, match=match):
        LMBatches(DATA, **args)


def test_bad_data_and_state():
    with pytest.raises(ValueError, match="1-D integer"):
        LMBatches(torch.rand(100), block_size=4, batch_size=2, seed=0)
    with pytest.raises(TypeError, match=r"data must be a tensor \(N,\) of token ids, got list"):
        LMBatches(list(range(100)), block_size=4, batch_size=2, seed=0)
    it = LMBatches(DATA, block_size=4, batch_size=2, seed=0)
    with pytest.raises(ValueError, match="'generator' and 'step'"):
        it.load_state_dict({"step": 1})


# ---- length-bucketed batches for translation -------------------------------------------------------------

from attnlab.data.batching import TokenBucketBatches, pad_batch  # noqa: E402

G = torch.Generator().manual_seed(0)
PAIRS = list(zip(torch.randint(1, 40, (500,), generator=G).tolist(), torch.randint(1, 40, (500,), generator=G).tolist()))


def _cost(batch, lengths):
    return len(batch) * max(max(lengths[i]) for i in batch)


def test_bucket_epoch_covers_every_example_once_within_budget():
    tb = TokenBucketBatches(PAIRS, max_tokens=200, seed=0)
    epoch = [next(tb) for _ in range(len(tb))]
    assert sorted(i for b in epoch for i in b) == list(range(500))
    assert all(_cost(b, PAIRS) <= 200 for b in epoch)
    assert tb.state_dict() == {"epoch": 0, "position": len(tb), "seed": 0}
    nxt = next(tb)  # rolls into epoch 1, reshuffled
    assert tb.epoch == 1 and nxt == tb.epoch_batches(1)[0] and tb.epoch_batches(1) != epoch


def test_bucket_packs_greedily_in_size_order():
    sizes = [max(p) for p in PAIRS]
    batches = TokenBucketBatches(PAIRS, max_tokens=200, shuffle=False, seed=0).epoch_batches(0)
    for a, b in zip(batches, batches[1:]):
        assert max(sizes[i] for i in a) <= min(sizes[i] for i in b)  # buckets of similar length
        assert (len(a) + 1) * max(sizes[i] for i in a + b[:1]) > 200  # greedy: the next example did not fit
    assert batches == TokenBucketBatches(PAIRS, max_tokens=200, shuffle=False, seed=0).epoch_batches(3)


def test_bucket_deterministic_from_seed_and_max_batch_size():
    a = TokenBucketBatches(PAIRS, max_tokens=200, seed=4).epoch_batches(2)
    assert a == TokenBucketBatches(PAIRS, max_tokens=200, seed=4).epoch_batches(2)
    assert a != TokenBucketBatches(PAIRS, max_tokens=200, seed=5).epoch_batches(2)
    capped = TokenBucketBatches([1] * 100, max_tokens=1000, max_batch_size=8, seed=0)
    assert max(len(b) for b in capped.epoch_batches(0)) == 8 and len(capped) == 13


def test_bucket_resume_is_exact_across_epochs():
    a = TokenBucketBatches(PAIRS, max_tokens=300, seed=1)
    for _ in range(len(a) + 3):
        next(a)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    expected = [next(a) for _ in range(len(a))]
    b = TokenBucketBatches(PAIRS, max_tokens=300, seed=1)
    buf.seek(0)
    b.load_state_dict(torch.load(buf, weights_only=True))
    assert [next(b) for _ in range(len(b))] == expected


def test_bucket_ranks_take_disjoint_batches():
    full = TokenBucketBatches(PAIRS, max_tokens=150, seed=2).epoch_batches(0)
    ranks = [TokenBucketBatches(PAIRS, max_tokens=150, seed=2, rank=r, world_size=3) for r in range(3)]
    per_rank = [r.epoch_batches(0) for r in ranks]
    assert len({len(p) for p in per_rank}) == 1 and len(per_rank[0]) == len(ranks[0]) == -(-len(full) // 3)
    served = [b for step in zip(*per_rank) for b in step]  # round-robin over ranks = the single-process order
    assert served[:len(full)] == full and served[len(full):] == full[:len(served) - len(full)]  # padded


def test_bucket_errors():
    with pytest.raises(ValueError, match="longer than max_tokens=10"):
        TokenBucketBatches([3, 12], max_tokens=10, seed=0)
    with pytest.raises(ValueError, match="empty"):
        TokenBucketBatches([], max_tokens=10, seed=0)
    with pytest.raises(ValueError, match=">= 1"):
        TokenBucketBatches([3, 0], max_tokens=10, seed=0)
    with pytest.raises(ValueError, match="rank must be < world_size"):
        TokenBucketBatches([3], max_tokens=10, seed=0, rank=1, world_size=1)
    with pytest.raises(ValueError, match="position"):
        TokenBucketBatches([3], max_tokens=10, seed=0).load_state_dict({"epoch": 0, "position": 5})


def test_pad_batch():
    out = pad_batch([[5, 6, 7], torch.tensor([8]), []], pad_id=0)
    assert out.dtype == torch.long and out.tolist() == [[5, 6, 7], [8, 0, 0], [0, 0, 0]]
    with pytest.raises(ValueError, match="empty"):
        pad_batch([], pad_id=0)
    with pytest.raises(TypeError, match="pad_id"):
        pad_batch([[1]], pad_id=None)
