"""Prompt and prefix tuning: equal to prepending real tokens when initialised from them, equal to
Hugging Face GPT-2 fed the same soft prompt (``inputs_embeds``) or prefix (a pre-filled
``DynamicCache``), gradients reach only the virtual tokens, ``generate`` works, save/load.

Tolerances (float32): against our own model on the concatenated input, max abs ≤ 1e-5 · max(1, max|ref|);
against transformers ≤ 1e-4 (the GPT-2 parity tolerance of tests/models/test_gpt.py).
"""
import copy

import pytest
import torch
import torch.nn.functional as F
import transformers

from attnlab.adapt import PrefixTuningLM, PromptTuningLM, load_adapter, save_adapter, trainable_parameters
from attnlab.models.gpt import state_dict_to_hf
from attnlab.models.hub import from_pretrained

transformers.logging.set_verbosity_error()
N = 4
KINDS = {"prompt": PromptTuningLM, "prefix": PrefixTuningLM}


def _close(got, ref, tol=1e-5):
    return (got - ref).abs().max() <= tol * max(1.0, ref.abs().max().item())


def _hf_gpt2(model):
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**model.config.to_hf())).eval()
    hf.load_state_dict(state_dict_to_hf(model.state_dict()), strict=True)
    return hf


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_initialised_from_tokens_equals_prepending_them(kind, family, make_gpt2, make_llama, ids):
    model = make_gpt2() if family == "gpt2" else make_llama()
    init = torch.randint(0, 97, (N,))
    wrapped = KINDS[kind](model, num_tokens=N, init_ids=init)
    with torch.no_grad():
        ref = model(torch.cat([init.expand(ids.shape[0], -1), ids], dim=1)).logits[:, N:]
        assert _close(wrapped(ids).logits, ref)


@torch.no_grad()
def test_soft_prompt_matches_transformers_inputs_embeds(make_gpt2, ids):
    model = make_gpt2()
    wrapped = PromptTuningLM(model, num_tokens=N)
    wrapped.prompt.normal_(0, 1.0)  # a trained-looking prompt, not any token's embedding
    hf = _hf_gpt2(model)
    B = ids.shape[0]
    # transformers adds wpe[position] to inputs_embeds; our prompt vectors are the layer-0 inputs
    prompt_in = wrapped.prompt - model.wpe.weight[:N]
    embeds = torch.cat([prompt_in.expand(B, -1, -1), model.wte(ids)], dim=1)
    ref = hf(inputs_embeds=embeds).logits[:, N:]
    assert (wrapped(ids).logits - ref).abs().max() <= 1e-4


@torch.no_grad()
def test_prefix_matches_transformers_prefilled_cache(make_gpt2, ids):
    model = make_gpt2()
    wrapped = PrefixTuningLM(model, num_tokens=N)
    wrapped.prefix_keys.normal_(0, 1.0)
    wrapped.prefix_values.normal_(0, 1.0)
    hf = _hf_gpt2(model)
    B, T = ids.shape
    cache = transformers.DynamicCache()
    for i in range(model.config.n_layer):
        cache.update(wrapped.prefix_keys[i].expand(B, -1, -1, -1).clone(),
                     wrapped.prefix_values[i].expand(B, -1, -1, -1).clone(), i)
    mask = torch.ones(B, N + T, dtype=torch.long)
    ref = hf(ids, past_key_values=cache, attention_mask=mask, position_ids=torch.arange(N, N + T).expand(B, -1)).logits
    assert (wrapped(ids).logits - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_training_moves_only_the_virtual_tokens(kind, make_gpt2, ids):
    model = make_gpt2()
    base_state = copy.deepcopy(model.state_dict())
    wrapped = KINDS[kind](model, num_tokens=N).train()
    trainable, total = trainable_parameters(wrapped)
    L, E = model.config.n_layer, model.config.n_embd
    assert trainable == (N * E if kind == "prompt" else 2 * L * N * E)
    assert total == trainable + sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        before = wrapped(ids).logits
    opt = torch.optim.Adam([p for p in wrapped.parameters() if p.requires_grad], lr=5e-2)
    target = torch.full((ids.numel(),), 5)
    for _ in range(5):
        loss = F.cross_entropy(wrapped(ids).logits.reshape(-1, 97), target)
        opt.zero_grad()
        loss.backward()
        grads = {n: p.grad for n, p in wrapped.named_parameters()}
        assert all(g is None for n, g in grads.items() if n.startswith("model."))
        assert all(g is not None and g.abs().sum() > 0 for n, g in grads.items() if not n.startswith("model."))
        opt.step()
    with torch.no_grad():
        assert (wrapped.eval()(ids).logits - before).abs().max() > 1e-2
    assert all(torch.equal(t, base_state[k]) for k, t in model.state_dict().items())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("opts", [dict(), dict(cache="static"), dict(num_beams=2)])
def test_generate_with_virtual_tokens(kind, opts, make_gpt2):
    model = make_gpt2()
    init = torch.randint(0, 97, (N,))
    wrapped = KINDS[kind](model, num_tokens=N, init_ids=init)
    prompt = torch.randint(0, 97, (2, 5))
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0  # left padding
    got = wrapped.generate(prompt, attention_mask=mask, max_new_tokens=6, **opts)
    full = torch.cat([init.expand(2, -1), prompt], dim=1)
    ref = model.generate(full, attention_mask=torch.cat([torch.ones(2, N, dtype=torch.long), mask], 1),
                         max_new_tokens=6, **opts)
    assert torch.equal(got, ref[:, N:])


@pytest.mark.parametrize("kind", KINDS)
def test_save_and_load(kind, make_gpt2, ids, tmp_path):
    model = make_gpt2()
    model.save_pretrained(tmp_path / "base")
    wrapped = KINDS[kind](model, num_tokens=N)
    with torch.no_grad():
        for p in wrapped.parameters():
            if p.requires_grad:
                p.normal_()
    save_adapter(wrapped, tmp_path / "adapter")
    loaded = load_adapter(from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    assert type(loaded) is type(wrapped)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, wrapped(ids).logits)


def test_errors(make_gpt2, make_bert):
    with pytest.raises(TypeError, match="decoder-only"):
        PromptTuningLM(make_bert(), num_tokens=2)
    for n in (0, -1, 2.5):
        with pytest.raises(ValueError, match="num_tokens"):
            PrefixTuningLM(make_gpt2(), num_tokens=n)
    with pytest.raises(ValueError, match="no room"):
        PromptTuningLM(make_gpt2(), num_tokens=64)
    with pytest.raises(ValueError, match="init_ids"):
        PromptTuningLM(make_gpt2(), num_tokens=3, init_ids=[1, 2])
    with pytest.raises(ValueError, match="init_ids"):
        PromptTuningLM(make_gpt2(), num_tokens=2, init_ids=[1, 970])
