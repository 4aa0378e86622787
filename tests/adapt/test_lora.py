"""LoRA: exact no-op at initialisation, ΔW = (α/r) B A against weights edited by hand, merge/unmerge,
training touches only A and B, adapter save/load onto a base checkpoint, and the errors.

Tolerance (float32, different summation order): adapted outputs vs a base model whose weights were
edited by hand, and merged vs unmerged outputs, agree to max abs ≤ 1e-5 · max(1, max |reference|).
"""
import copy
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from attnlab.adapt import (
    LoRALinear,
    apply_lora,
    load_adapter,
    lora_state_dict,
    merge_lora,
    save_adapter,
    trainable_parameters,
    unload_lora,
    unmerge_lora,
)
from attnlab.adapt.lora import projections
from attnlab.modules.multihead import MultiheadAttention
from attnlab.models.hub import from_pretrained
from attnlab.models.transformer import Transformer

TOL = 1e-5


def _close(got, ref):
    return (got - ref).abs().max() <= TOL * max(1.0, ref.abs().max().item())


def _randomise_lora(model, std=0.3):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, std)


def _hand_edited(base, adapted):
    """A copy of ``base`` with ``W += (α/r) B_s A_s`` written into the rows of each adapted slice."""
    ref = copy.deepcopy(base)
    with torch.no_grad():
        for name, layer in adapted.named_modules():
            if isinstance(layer, LoRALinear):
                w = ref.get_submodule(name).weight
                for s, (lo, hi) in layer.slices.items():
                    w[lo:hi] += layer.alpha / layer.r * layer.lora_B[s] @ layer.lora_A[s]
    return ref


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_fresh_lora_leaves_outputs_exactly_unchanged(kind, make_gpt2, make_bert, ids):
    model = make_gpt2() if kind == "gpt2" else make_bert()
    out = (lambda m: m(ids).logits) if kind == "gpt2" else (lambda m: m(ids).last_hidden_state)
    with torch.no_grad():
        before = out(model)
        apply_lora(model, r=4, alpha=8)
        assert torch.equal(out(model), before)  # B = 0: bit-identical


def test_default_targets_are_query_and_value_slices_of_the_packed_projection(make_gpt2):
    model = apply_lora(make_gpt2(), r=4, alpha=8)
    layer = model.layers[0].self_attn.in_proj
    assert isinstance(layer, LoRALinear)
    E = 32
    assert layer.slices == {"q": (0, E), "v": (2 * E, 3 * E)}
    assert isinstance(model.layers[0].self_attn.out_proj, torch.nn.Linear)  # not targeted
    trainable, total = trainable_parameters(model)
    assert trainable == 2 * 2 * (4 * E + E * 4)  # layers x {q, v} x (A + B)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(lora_state_dict(model))
    assert total == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("targets", [None, ["*.in_proj", "*.out_proj"], [re.compile(r"layers\.1\..*k_proj"), "*w1"]])
def test_adapted_gpt2_equals_hand_edited_weights(targets, make_gpt2, ids):
    base = make_gpt2()
    model = apply_lora(copy.deepcopy(base), r=3, alpha=6, targets=targets)
    _randomise_lora(model)
    ref = _hand_edited(base, model)
    with torch.no_grad():
        assert _close(model(ids).logits, ref(ids).logits)


def test_gqa_slices_of_llama_in_proj(make_llama, ids):
    base = make_llama()
    model = apply_lora(copy.deepcopy(base), r=2, alpha=2, targets=["*q_proj", "*k_proj", "*v_proj"])
    attn = base.layers[0].self_attn  # 4 query heads, 2 key/value heads of width 8
    assert model.layers[0].self_attn.in_proj.slices == {"q": (0, 32), "k": (32, 48), "v": (48, 64)}
    assert attn.num_kv_heads == 2
    _randomise_lora(model)
    with torch.no_grad():
        assert _close(model(ids).logits, _hand_edited(base, model)(ids).logits)


def test_cross_attention_reads_the_adapted_weight():
    """Cross-attention projects q and k/v through row slices of ``in_proj.weight``: the LoRA layer's
    ``weight`` must already hold ``W + ΔW`` there."""
    torch.manual_seed(0)
    base = Transformer(32, 4, num_encoder_layers=1, num_decoder_layers=1, ffn_dim=64, dropout=0.0).eval()
    model = apply_lora(copy.deepcopy(base), r=4, alpha=4, targets=["*cross_attn.q_proj", "*cross_attn.v_proj"])
    _randomise_lora(model)
    src, tgt = torch.randn(2, 7, 32), torch.randn(2, 5, 32)
    with torch.no_grad():
        got, ref, plain = model(src, tgt), _hand_edited(base, model)(src, tgt), base(src, tgt)
    assert _close(got, ref)
    assert (got - plain).abs().max() > 1e-2  # the adapter does act


def test_unpacked_attention_projections_are_targeted_by_name():
    torch.manual_seed(0)
    mha = MultiheadAttention(16, 2, kdim=8, vdim=8)
    assert {"q_proj", "k_proj", "v_proj", "out_proj"} <= set(projections(mha))
    model = apply_lora(copy.deepcopy(mha), r=2, alpha=4)
    assert isinstance(model.q_proj, LoRALinear) and isinstance(model.v_proj, LoRALinear)
    _randomise_lora(model)
    q, kv = torch.randn(2, 3, 16), torch.randn(2, 4, 8)
    with torch.no_grad():
        assert _close(model(q, kv, kv)[0], _hand_edited(mha, model)(q, kv, kv)[0])


def test_merge_unmerge_unload(make_gpt2, ids):
    base = make_gpt2()
    model = apply_lora(copy.deepcopy(base), r=4, alpha=16)
    _randomise_lora(model)
    w0 = base.layers[0].self_attn.in_proj.weight.clone()
    with torch.no_grad():
        unmerged = model(ids).logits
        merge_lora(model)
        assert model.layers[0].self_attn.in_proj.merged
        assert _close(model(ids).logits, unmerged)
        unmerge_lora(model)
        assert (model.layers[0].self_attn.in_proj.base.weight - w0).abs().max() <= 1e-6
        assert _close(model(ids).logits, unmerged)
        plain = unload_lora(model)
        assert not any(isinstance(m, LoRALinear) for m in plain.modules())
        assert set(plain.state_dict()) == set(base.state_dict())  # a plain GPT-2 again (save_pretrained works)
        assert _close(plain(ids).logits, unmerged)


def test_training_updates_only_lora(make_gpt2):
    model = apply_lora(make_gpt2(), r=4, alpha=8, dropout=0.1, targets=["*q_proj", "*v_proj", "*w2"]).train()
    frozen = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    data, target = torch.randint(0, 97, (4, 16)), torch.full((4 * 16,), 5)  # learn to always say token 5
    losses = []
    for _ in range(15):
        loss = F.cross_entropy(model(data).logits.reshape(-1, 97), target)
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is None for n, p in model.named_parameters() if n in frozen)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 2
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    assert all(t.abs().sum() > 0 for n, t in lora_state_dict(model).items() if "lora_B" in n)


def test_save_and_load_adapter_onto_a_base_checkpoint(make_gpt2, ids, tmp_path):
    base = make_gpt2()
    base.save_pretrained(tmp_path / "base")
    model = apply_lora(copy.deepcopy(base), r=4, alpha=8, targets=["*q_proj", "*v_proj", "*.w2"])
    _randomise_lora(model)
    save_adapter(model, tmp_path / "adapter")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json",
                                                                        "adapter_model.safetensors"]
    loaded = load_adapter(from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert set(lora_state_dict(loaded)) == set(lora_state_dict(model))
    assert trainable_parameters(loaded) == trainable_parameters(model)


def test_adapter_weight_stored_as_integers_is_refused_by_name(make_gpt2, tmp_path):
    model = apply_lora(make_gpt2(), r=2, alpha=2)
    save_adapter(model, tmp_path / "a")
    file = tmp_path / "a" / "adapter_model.safetensors"
    sd = load_file(file)
    name = sorted(sd)[0]
    sd[name] = sd[name].view(torch.int32)  # the same bytes, declared I32
    save_file(sd, file)
    base = make_gpt2()
    with pytest.raises(ValueError, match=rf"'{name}' .*stored as torch.int32.*torch.float32"):
        load_adapter(base, tmp_path / "a")
    assert not any(isinstance(m, LoRALinear) for m in base.modules())  # left untouched


def test_errors(make_gpt2, tmp_path):
    for r in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="r "):
            apply_lora(make_gpt2(), r=r, alpha=8)
    with pytest.raises(ValueError, match="alpha"):
        apply_lora(make_gpt2(), r=2, alpha=0)
    with pytest.raises(ValueError, match="no_such_layer"):
        apply_lora(make_gpt2(), r=2, alpha=2, targets=["*no_such_layer*"])
    with pytest.raises(ValueError, match="both all of"):
        apply_lora(make_gpt2(), r=2, alpha=2, targets=["*in_proj", "*q_proj"])
    with pytest.raises(TypeError, match="targets"):
        apply_lora(make_gpt2(), r=2, alpha=2, targets=[3])
    model = apply_lora(make_gpt2(), r=2, alpha=2)
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(model, r=2, alpha=2)
    with pytest.raises(ValueError, match="no LoRA layers"):
        merge_lora(make_gpt2())
    save_adapter(model, tmp_path / "a")
    other = make_gpt2(n_embd=48)  # another base shape
    with pytest.raises(ValueError, match=r"'layers.0.ffn.w1.bias' has shape \(192,\) in this GPT2LMHeadModel but"):
        load_adapter(other, tmp_path / "a")
    assert not any(isinstance(m, LoRALinear) for m in other.modules())  # left untouched
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        load_adapter(make_gpt2(), tmp_path / "missing")
    with pytest.raises(ValueError, match="no adapters"):
        save_adapter(make_gpt2(), tmp_path / "b")
