"""The decoding step's short path (``DecoderOnlyLM._step`` → ``DecoderLayer.step`` → ``MultiheadAttention.step``)
against the pipeline it stands in for (the same model with the short path switched off).

Oracle: the pipeline's logits for the same cached steps. The two compute the same formulas — the step with
attnlab's C++ kernels where they are built (RoPE + cache write + attention in one call, ``_native.attend_decode``;
the pipeline: SDPA over the same cache) — so float32 agreement is to rounding (:func:`_tolerance.tolerance`), for
the logits and the cached keys; tokens are identical. Non-finite values and overflow must come out exactly
as the pipeline gives them (the step reruns through it), with the caches consistent.
"""
import pytest
import torch

from attnlab.adapt.deploy import sliding_window
from attnlab.models.causal_lm import DecoderOnlyLM
from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel
from attnlab.models.llama import LlamaConfig, LlamaForCausalLM
from _tolerance import tolerance  # tests/_tolerance.py: from the dtype and the magnitude

V = 97


def _model(family):
    torch.manual_seed(0)
    if family == "gpt2":
        m = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4))
    else:  # grouped-query attention and rotary positions
        m = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    return m.eval()


def _decode(model, ids, steps, *, short_path, monkeypatch, max_length=None):
    """Logits of a prefill of ``ids`` then ``steps`` greedy one-token steps, and the caches."""
    if not short_path:
        monkeypatch.setattr(DecoderOnlyLM, "_step", lambda self, *a: None)
    cache = model.new_cache(max_length=max_length)
    out = model(ids, past_key_values=cache, use_cache=True)
    logits = [out.logits[:, -1:]]
    for _ in range(steps):
        nxt = logits[-1].argmax(-1)
        logits.append(model(nxt, past_key_values=cache, use_cache=True).logits)
    monkeypatch.undo()
    return torch.cat(logits, 1), cache


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("max_length", [None, 20], ids=["growing", "static"])
@pytest.mark.parametrize("inference", ["fp32", "packed"])
@torch.no_grad()
def test_the_step_equals_the_pipeline(family, max_length, inference, monkeypatch):
    model = _model(family)
    if inference == "packed":  # PackedLinear (attnlab's matvec where built, else oneDNN), fp32
        model.optimize_for_inference(dtype=torch.float32)
    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(1))
    calls = []
    real = DecoderOnlyLM._step
    monkeypatch.setattr(DecoderOnlyLM, "_step", lambda self, *a: calls.append(1) or real(self, *a))
    fast, cache = _decode(model, ids, 8, short_path=True, monkeypatch=monkeypatch, max_length=max_length)
    slow, cache2 = _decode(model, ids, 8, short_path=False, monkeypatch=monkeypatch, max_length=max_length)
    assert len(calls) == 8  # every one-token step took the short path
    assert (fast - slow).abs().max() <= tolerance(slow, n=32, depth=2)
    assert torch.equal(fast.argmax(-1), slow.argmax(-1))
    assert cache[0].self_attn.length == cache2[0].self_attn.length == 14
    k_fast, k_slow = cache[1].self_attn.k[:, :, :14], cache2[1].self_attn.k[:, :, :14]
    assert (k_fast - k_slow).abs().max() <= tolerance(k_slow, n=32, depth=2)


@torch.no_grad()
def test_a_non_finite_step_reruns_through_the_pipeline_with_its_semantics(monkeypatch):
    model = _model("llama")  # an untied head: a NaN embedding row poisons only the sequences that read it
    ids = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(2))
    cache, ref_cache = model.new_cache(), model.new_cache()
    model(ids, past_key_values=cache, use_cache=True)
    model(ids, past_key_values=ref_cache, use_cache=True)
    model.embed_tokens.weight[7] = float("nan")
    step = torch.tensor([[7], [8]])
    got = model(step, past_key_values=cache, use_cache=True).logits
    monkeypatch.setattr(DecoderOnlyLM, "_step", lambda self, *a: None)
    want = model(step, past_key_values=ref_cache, use_cache=True).logits
    assert got[0].isnan().all() and got[1].isfinite().all()
    assert torch.equal(got.isnan(), want.isnan()) and (got[1] - want[1]).abs().max() <= tolerance(want[1], n=32, depth=2)
    for c, r in zip(cache, ref_cache):  # one entry written per layer (not two), its finiteness recorded
        assert c.self_attn.length == r.self_attn.length == 6 and c.self_attn.finite is r.self_attn.finite is False


@pytest.mark.parametrize("short_path", [True, False])
@torch.no_grad()
def test_overflow_in_a_step_raises_the_pipelines_error(short_path, monkeypatch):
    model = _model("gpt2")
    cache = model.new_cache()
    model(torch.tensor([[1, 2, 3]]), past_key_values=cache, use_cache=True)
    if not short_path:
        monkeypatch.setattr(DecoderOnlyLM, "_step", lambda self, *a: None)
    model.layers[1].self_attn.in_proj.weight.mul_(1e21)  # q, k finite (~1e20), their scores overflow float32
    with pytest.raises(ValueError, match="overflow torch.float32|overflowed torch.float32"):
        model(torch.tensor([[4]]), past_key_values=cache, use_cache=True)


@torch.no_grad()
def test_what_the_step_does_not_cover_goes_through_the_pipeline(monkeypatch):
    """A windowed (ring) cache, padding, attention weights, gradients: the pipeline, with its results."""
    model = _model("llama")
    ids = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(3))
    calls = []
    real = DecoderOnlyLM._step
    monkeypatch.setattr(DecoderOnlyLM, "_step", lambda self, *a: calls.append(1) or real(self, *a))
    with sliding_window(model, 4):
        cache = model.new_cache(window=4)
        model(ids, past_key_values=cache, use_cache=True)
        ring = model(torch.tensor([[5]]), past_key_values=cache, use_cache=True).logits
        full = model(torch.cat([ids, torch.tensor([[5]])], 1)).logits[:, -1:]
    assert (ring - full).abs().max() <= tolerance(full, n=32, depth=2)
    cache = model.new_cache()
    model(ids, past_key_values=cache, use_cache=True)
    out = model(torch.tensor([[5]]), past_key_values=cache, use_cache=True, output_attentions=True)
    assert out.attentions is not None and len(calls) == 1  # windowed: tried, its layers fell back; weights: not tried
    mask = torch.ones(1, 8, dtype=torch.long)
    mask[0, 0] = 0
    model(torch.tensor([[6]]), attention_mask=mask, past_key_values=cache, use_cache=True)
    assert len(calls) == 1  # padding: not tried


@torch.no_grad()
def test_rotary_at_one_position_equals_forward():
    from attnlab.nn.positional import RotaryEmbedding

    for interleaved, rotary_dim in ((False, None), (True, None), (False, 8)):
        rope = RotaryEmbedding(16, rotary_dim=rotary_dim, interleaved=interleaved, max_positions=8)
        x = torch.randn(2, 3, 1, 16)
        for p in (0, 5, 30):  # 30: past the cache, through forward (which grows it)
            assert torch.equal(rope.at(x, p), rope(x, torch.tensor([p])))
        assert torch.equal(rope.at(x.double(), 3), rope(x.double(), torch.tensor([3])))


def test_a_cache_rewinds_to_its_mark_and_a_ring_refuses():
    from attnlab import KVCache

    cache = KVCache(max_length=8)
    k = torch.randn(1, 2, 3, 4)
    cache.update(k, k)
    mark = cache.mark()
    cache.update(torch.full((1, 2, 1, 4), float("nan")), k[:, :, :1])
    assert cache.length == 4 and not cache.finite
    cache.rewind(mark)
    assert cache.length == 3 and cache.finite
    nxt = torch.randn(1, 2, 1, 4)
    keys, _ = cache.update(nxt, nxt)
    assert torch.equal(keys[:, :, :3], k) and torch.equal(keys[:, :, 3:], nxt)  # the forgotten entry overwritten
    ring = KVCache(window=4)
    with pytest.raises(ValueError, match="ring"):
        ring.rewind(ring.mark())
