"""Houlsby bottleneck adapters: identity at initialisation, the layer formula computed by hand,
only adapters train, removal, deep copies, save/load onto a base checkpoint, errors.

Tolerance: against the formula written out with the base layer's own sub-modules, max abs ≤ 1e-5 ·
max(1, max|ref|) (float32).
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from attnlab.adapt import (
    BottleneckAdapter,
    apply_adapters,
    apply_lora,
    load_adapter,
    remove_adapters,
    save_adapter,
    trainable_parameters,
)
from attnlab.adapt.io import adapter_state_dict
from attnlab.models.hub import from_pretrained


def _close(got, ref, tol=1e-5):
    return (got - ref).abs().max() <= tol * max(1.0, ref.abs().max().item())


def _randomise(model):
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, BottleneckAdapter):
                m.up.weight.normal_(0, 0.5)
                m.up.bias.uniform_(-0.2, 0.2)
                m.down.weight.normal_(0, 0.5)


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_fresh_adapters_leave_outputs_exactly_unchanged(kind, make_bert, make_gpt2, ids):
    model = make_bert() if kind == "bert" else make_gpt2()
    out = (lambda m: m(ids).last_hidden_state) if kind == "bert" else (lambda m: m(ids).logits)
    with torch.no_grad():
        before = out(model)
        apply_adapters(model, bottleneck=8)
        assert torch.equal(out(model), before)


@torch.no_grad()
def test_post_norm_bert_layer_equals_the_formula(make_bert, ids):
    base = make_bert()
    model = apply_adapters(copy.deepcopy(base), bottleneck=8, activation="relu")
    _randomise(model)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    pad = mask == 0
    x = base.embeddings(ids, torch.zeros_like(ids))
    for plain, adapted in zip(base.layers, model.layers):
        a1, a2 = adapted.adapters["self_attn"], adapted.adapters["ffn"]
        attn = plain.self_attn(x, x, x, key_padding_mask=pad, need_weights=False)[0]
        x = plain.norm1(x + a1(attn))                          # LN(x + Adapter(Attn(x)))
        x = plain.norm2(x + a2(plain.ffn(x)))                  # LN(x + Adapter(FFN(x)))
        assert _close(a1(attn), attn + a1.up(F.relu(a1.down(attn))))
    got = model(ids, mask).last_hidden_state
    assert _close(got, x)
    assert (got - base(ids, mask).last_hidden_state).abs().max() > 1e-2


def test_only_adapters_train_and_removal_restores_the_base(make_gpt2, ids):
    base = make_gpt2()
    model = apply_adapters(copy.deepcopy(base), bottleneck=4, sublayers=["ffn"]).train()
    assert set(model.layers[0].adapters) == {"ffn"}
    trainable, _ = trainable_parameters(model)
    E, m, L = 32, 4, 2
    assert trainable == L * (E * m + m + m * E + E)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        loss = F.cross_entropy(model(ids).logits.reshape(-1, 97), torch.full((ids.numel(),), 5))
        opt.zero_grad()
        loss.backward()
        assert all((p.grad is None) != ("adapters" in n) for n, p in model.named_parameters())
        opt.step()
    with torch.no_grad():
        assert (model.eval()(ids).logits - base(ids).logits).abs().max() > 1e-3
        remove_adapters(model)
        assert not any(isinstance(m, BottleneckAdapter) for m in model.modules())
        assert torch.equal(model(ids).logits, base(ids).logits)


@torch.no_grad()
def test_deep_copy_keeps_its_own_hooks(make_gpt2, ids):
    model = apply_adapters(make_gpt2(), bottleneck=4)
    _randomise(model)
    twin = copy.deepcopy(model)
    assert torch.equal(twin(ids).logits, model(ids).logits)
    before = model(ids).logits
    remove_adapters(twin)
    assert torch.equal(model(ids).logits, before)  # the original still has its adapters
    twin2 = copy.deepcopy(model)
    for m in twin2.modules():
        if isinstance(m, BottleneckAdapter):
            m.up.bias.add_(1.0)
    assert torch.equal(model(ids).logits, before)  # the copy's hooks call the copy's adapters


def test_cross_attention_adapters_and_lora_together(make_gpt2, ids, tmp_path):
    base = make_gpt2()
    base.save_pretrained(tmp_path / "base")
    model = apply_lora(copy.deepcopy(base), r=2, alpha=4)
    apply_adapters(model, bottleneck=4, sublayers=["self_attn", "cross_attn", "ffn"])  # GPT-2 has no cross_attn
    assert set(model.layers[0].adapters) == {"self_attn", "ffn"}
    _randomise(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    save_adapter(model, tmp_path / "both")
    loaded = load_adapter(from_pretrained(tmp_path / "base"), tmp_path / "both")
    assert set(adapter_state_dict(loaded)) == set(adapter_state_dict(model))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_errors(make_bert):
    for b in (0, -3, 2.0):
        with pytest.raises(ValueError, match="bottleneck"):
            apply_adapters(make_bert(), bottleneck=b)
    with pytest.raises(ValueError, match="activation"):
        apply_adapters(make_bert(), bottleneck=4, activation="tanh")
    with pytest.raises(ValueError, match="sublayers"):
        apply_adapters(make_bert(), bottleneck=4, sublayers=["attention"])
    with pytest.raises(ValueError, match="no EncoderLayer"):
        apply_adapters(torch.nn.Linear(4, 4), bottleneck=2)
    model = apply_adapters(make_bert(), bottleneck=4)
    with pytest.raises(ValueError, match="already has adapters"):
        apply_adapters(model, bottleneck=4)
    with pytest.raises(ValueError, match="no adapters"):
        remove_adapters(make_bert())
