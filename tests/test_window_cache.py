"""The sliding-window KV cache (a ring buffer of the keys a window of width w still sees): O(w) memory for any
length; the same tokens as the growing cache with the window mask, and as full recomputation with the window
mask; the same tokens as full attention while the sequence is shorter than w. Float64 models, so that equal
tokens are a property of the computation, not of rounding luck (the keys are the same, in the same order)."""
import pytest
import torch

from attnlab.adapt.deploy import sliding_window
from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel
from attnlab.models.llama import LlamaConfig, LlamaForCausalLM
from attnlab.modules.cache import KVCache
from attnlab.modules.multihead import MultiheadAttention

V = 64


def _llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=1 << 20)
    return LlamaForCausalLM(cfg).eval().double()


def _gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=256, n_embd=32, n_layer=2, n_head=4)).eval().double()


def _recomputed(model, ids):
    """Greedy next tokens of every prefix, from one full forward (the window mask, no cache)."""
    with torch.no_grad():
        return model(ids.clone()).logits.argmax(-1)


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_ring_equals_growing_cache_and_recomputation(make):
    model, w = make(), 8
    ids = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(1))
    full = model.generate(ids, max_new_tokens=4)  # full attention while the sequence is shorter than w
    with sliding_window(model, w):
        ring = model.generate(ids, max_new_tokens=40, cache="window")
        growing = model.generate(ids, max_new_tokens=40, cache="dynamic")
        again = _recomputed(model, ring[:, :-1])
    assert torch.equal(ring, growing)
    assert torch.equal(ring[:, :9], full)  # each of these 4 tokens is predicted from ≤ 8 = w positions: all visible
    assert torch.equal(again[:, 4:], ring[:, 5:])


def test_long_prompt_chunked_prefill_and_beams():
    model, w = _llama(), 6
    ids = torch.randint(0, V, (2, 23), generator=torch.Generator().manual_seed(2))
    with sliding_window(model, w):
        with torch.no_grad():
            reference = model(ids).logits
            cache = model.new_cache(window=w)
            parts = [model(ids[:, a:b], past_key_values=cache, use_cache=True).logits
                     for a, b in ((0, 4), (4, 5), (5, 19), (19, 23))]  # chunks shorter and longer than w
        assert torch.allclose(torch.cat(parts, 1), reference, atol=1e-12, rtol=0)
        assert cache[0].self_attn.k.shape[2] == 2 * w and cache[0].self_attn.length == 23
        beams = model.generate(ids, max_new_tokens=12, num_beams=3, cache="window")
        assert torch.equal(beams, model.generate(ids, max_new_tokens=12, num_beams=3, cache="dynamic"))


def test_left_padding_keeps_the_mask_in_step():
    model, w = _llama(), 5
    ids = torch.randint(1, V, (2, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with sliding_window(model, w):
        ring = model.generate(ids, attention_mask=mask, max_new_tokens=20, cache="window", pad_token_id=0)
        growing = model.generate(ids, attention_mask=mask, max_new_tokens=20, cache="dynamic", pad_token_id=0)
    assert torch.equal(ring, growing)


def test_memory_stays_o_of_w():
    model, w, n = _llama().float(), 16, 2000
    with sliding_window(model, w):
        cache = model.new_cache(window=w)
        x = torch.randint(0, V, (1, 1))
        with torch.inference_mode():
            for _ in range(n):
                x = model(x, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    for layer in cache:
        c = layer.self_attn
        assert c.length == n and c.k.shape == (1, 2, 2 * w, 8) and c.v.shape == (1, 2, 2 * w, 8)
        k, _ = c.stored()
        assert k.shape[2] == w


@pytest.mark.slow
def test_hundred_thousand_tokens_in_constant_memory():
    model, w, n = _llama().float(), 64, 100_000
    with sliding_window(model, w):
        ids = model.generate(torch.zeros(1, 1, dtype=torch.long), max_new_tokens=n, cache="window")
    assert ids.shape == (1, n + 1)


def test_kv_cache_ring_unit():
    """Written one position at a time and in chunks, the stored entries are the w newest, in order."""
    w = 4
    c = KVCache(window=w)
    k = torch.arange(11.0).view(1, 1, 11, 1)
    out_k, _ = c.update(k[:, :, :1], k[:, :, :1])
    assert out_k.flatten().tolist() == [0.0]
    out_k, _ = c.update(k[:, :, 1:7], k[:, :, 1:7])  # a chunk: the w - 1 before it, then the chunk
    assert out_k.flatten().tolist() == [0.0, 1, 2, 3, 4, 5, 6]
    assert c.stored()[0].flatten().tolist() == [3.0, 4, 5, 6]
    for t in range(7, 11):
        out_k, _ = c.update(k[:, :, t:t + 1], k[:, :, t:t + 1])
        assert out_k.flatten().tolist() == [float(t - 3 + i) for i in range(4)]
    assert c.length == 11 and c.k.shape[2] == 2 * w
    assert repr(c) == "KVCache(window=4, length=11)"


def test_bad_window_arguments():
    with pytest.raises(ValueError, match="window must be a positive int"):
        KVCache(window=0)
    with pytest.raises(ValueError, match="give it without max_length or static"):
        KVCache(window=4, max_length=8)
    mha = MultiheadAttention(16, 2)  # no window: it would need every key
    with pytest.raises(ValueError, match="keeps fewer keys than this attention sees"):
        mha(torch.randn(1, 3, 16), cache=KVCache(window=4), need_weights=False)
    model = _llama()
    with pytest.raises(ValueError, match="cache='window' needs a decoder-only model whose every self-attention"):
        model.generate(torch.zeros(1, 2, dtype=torch.long), max_new_tokens=2, cache="window")
