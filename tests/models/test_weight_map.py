"""The one declarative HF weight map (attnlab.models.weight_map): both directions from one declaration,
for every family, and clear errors for a declaration that cannot be right."""
import re

import pytest
import torch
import transformers
from safetensors.torch import load_file

from attnlab.models.bart import BartConfig, BartForConditionalGeneration
from attnlab.models.bert import BertConfig, BertForMaskedLM, BertForPreTraining, BertModel
from attnlab.models.clip import CLIPConfig, CLIPModel
from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel
from attnlab.models.llama import LlamaConfig, LlamaForCausalLM
from attnlab.models.t5 import T5Config, T5ForConditionalGeneration
from attnlab.models.vit import ViTConfig, ViTForImageClassification, ViTModel
from attnlab.models.weight_map import Rule, WeightMap, pack, rename

BERT = dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
            max_position_embeddings=20)
VIT = dict(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
           intermediate_size=24, num_labels=3)
LLAMA = dict(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32)
T5 = dict(vocab_size=50, d_model=16, d_kv=6, d_ff=24, num_layers=2, num_decoder_layers=1, num_heads=2)
CLIP = dict(text_config=dict(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                             num_attention_heads=2, max_position_embeddings=10),
            vision_config=dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                               image_size=16, patch_size=8), projection_dim=8)
BART = dict(vocab_size=50, d_model=16, encoder_layers=2, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24, max_position_embeddings=20)

MODELS = {
    "bert": lambda: BertModel(BertConfig(**BERT)),
    "bert-no-pooler": lambda: BertModel(BertConfig(**BERT), add_pooling_layer=False),
    "bert-mlm": lambda: BertForMaskedLM(BertConfig(**BERT)),
    "bert-pretraining": lambda: BertForPreTraining(BertConfig(**BERT)),
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2)),
    "gpt2-no-bias": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2,
                                                       n_head=2, bias=False)),
    "llama-gqa-tied": lambda: LlamaForCausalLM(LlamaConfig(**LLAMA, tie_word_embeddings=True)),
    "llama-gqa-untied": lambda: LlamaForCausalLM(LlamaConfig(**LLAMA, tie_word_embeddings=False)),
    "t5-relu-tied": lambda: T5ForConditionalGeneration(T5Config(**T5)),
    "t5-gated-untied": lambda: T5ForConditionalGeneration(T5Config(**T5, feed_forward_proj="gated-gelu",
                                                                   tie_word_embeddings=False)),
    "vit": lambda: ViTModel(ViTConfig(**VIT)),
    "vit-classifier": lambda: ViTForImageClassification(ViTConfig(**VIT)),
    "clip": lambda: CLIPModel(CLIPConfig(**CLIP)),
    "bart": lambda: BartForConditionalGeneration(BartConfig(**BART)),
}


def _randomized(model):
    """Every tensor distinct (zero biases and unit norms would let a swapped pair pass unseen)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.uniform_(-1, 1)
    return model


@pytest.mark.parametrize("name", sorted(MODELS))
def test_ours_to_hf_to_ours_is_the_identity(name):
    model = _randomized(MODELS[name]())
    ours = model.state_dict()
    hf = model.to_hf_state_dict()
    back = model.from_hf_state_dict(hf)
    assert back.keys() == ours.keys()
    for k, t in ours.items():
        assert torch.equal(back[k], t), k
    # every value stored once: tied parameters are written under one name
    unique = {t.data_ptr(): t.numel() for t in ours.values()}
    assert sum(t.numel() for t in hf.values()) == sum(unique.values())
    model.load_state_dict(back, strict=True)


@pytest.mark.parametrize("name", sorted(set(MODELS) - {"gpt2-no-bias"}))  # HF's GPT-2 always has biases
def test_hf_names_and_shapes_are_those_transformers_saves(name, tmp_path):
    """The map's HF side is exactly what ``transformers`` writes for the same config (less what the map
    ignores), so to_hf and from_hf both speak HF's checkpoint format, not only each other's."""
    model = MODELS[name]()
    cls = getattr(transformers, model.hf_architecture)
    kwargs = {"add_pooling_layer": False} if getattr(model, "pooler", True) is None else {}
    theirs = cls(cls.config_class(**model.config.to_hf()), **kwargs)
    hf = model.to_hf_state_dict()
    if "lm_head.weight" in hf and theirs.get_output_embeddings().weight is theirs.get_input_embeddings().weight:
        # T5 v1.1: an LM head of its own (transformers 5 builds every T5 tied; see T5's adapt_hf_checkpoint)
        theirs.get_output_embeddings().weight = torch.nn.Parameter(torch.empty_like(hf["lm_head.weight"]))
    theirs.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    ignored = [re.compile(p) for p in model.hf_weight_map().ignore]
    expected = {k: tuple(t.shape) for k, t in saved.items() if k in hf or not any(p.search(k) for p in ignored)}
    assert {k: tuple(t.shape) for k, t in hf.items()} == expected
    model.load_state_dict(model.from_hf_state_dict(saved), strict=True)


# ---- the map itself ------------------------------------------------------------------------

def _toy():
    return WeightMap("toy", [
        rename("emb.weight", "model.embed.weight"),
        pack("layers.{i}.qkv.{p}", *(f"h.{{i}}.{x}.{{p}}" for x in "qkv"), sizes=(4, 2, 2)),
        rename("layers.{i}.fc.{p}", "h.{i}.mlp.{p}", transpose=True),
        rename("{s:enc|dec}.norm.weight", "{s}.ln.weight"),
    ], tied={"head.weight": "emb.weight"}, ignore=(r"\.masked_bias$",))


def _toy_state():
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(5, 3, generator=g)
    return {"emb.weight": emb, "head.weight": emb, "layers.0.qkv.weight": torch.randn(8, 3, generator=g),
            "layers.0.qkv.bias": torch.randn(8, generator=g), "layers.0.fc.weight": torch.randn(2, 3, generator=g),
            "layers.0.fc.bias": torch.randn(2, generator=g), "enc.norm.weight": torch.randn(3, generator=g),
            "dec.norm.weight": torch.randn(3, generator=g)}


def test_packs_with_sizes_transposes_and_ties_both_ways():
    sd = _toy_state()
    hf = _toy().to_hf(sd)
    assert sorted(hf) == ["dec.ln.weight", "enc.ln.weight", "h.0.k.bias", "h.0.k.weight", "h.0.mlp.bias",
                          "h.0.mlp.weight", "h.0.q.bias", "h.0.q.weight", "h.0.v.bias", "h.0.v.weight",
                          "model.embed.weight"]
    assert torch.equal(hf["h.0.q.weight"], sd["layers.0.qkv.weight"][:4])
    assert torch.equal(hf["h.0.v.bias"], sd["layers.0.qkv.bias"][6:])
    assert torch.equal(hf["h.0.mlp.weight"], sd["layers.0.fc.weight"].T)  # Conv1D layout
    assert torch.equal(hf["h.0.mlp.bias"], sd["layers.0.fc.bias"])  # vectors are not transposed
    back = _toy().from_hf({**hf, "h.0.attn.masked_bias": torch.zeros(1)})  # ignored
    assert back.keys() == sd.keys() and all(torch.equal(back[k], v) for k, v in sd.items())
    assert back["head.weight"] is back["emb.weight"]


def test_a_rule_that_matches_nothing_is_refused_in_both_directions():
    wm = WeightMap("toy", [rename("a.weight", "A.weight"), rename("b.weight", "B.weight")])
    with pytest.raises(ValueError, match=r"rule 'b.weight' <-> 'B.weight' matches none of the model's tensors"):
        wm.to_hf({"a.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"rule 'b.weight' <-> 'B.weight' matches none in the checkpoint"):
        wm.from_hf({"A.weight": torch.zeros(1)})


def test_two_rules_producing_one_name_are_refused():
    wm = WeightMap("toy", [rename("a.weight", "X.weight"), rename("b.weight", "X.weight")])
    with pytest.raises(ValueError, match=r"'a.weight' and 'b.weight' both map to 'X.weight'"):
        wm.to_hf({"a.weight": torch.zeros(1), "b.weight": torch.zeros(1)})
    wm = WeightMap("toy", [rename("x.weight", "A.weight"), rename("x.weight", "B.weight")])
    with pytest.raises(ValueError, match=r"'A.weight' and 'B.weight' both map to our 'x.weight'"):
        wm.from_hf({"A.weight": torch.zeros(1), "B.weight": torch.zeros(1)})


def test_unknown_names_and_incomplete_packs_are_named():
    with pytest.raises(ValueError, match=r"no rule maps our tensor 'extra.weight'"):
        _toy().to_hf({**_toy_state(), "extra.weight": torch.zeros(1)})
    hf = _toy().to_hf(_toy_state())
    with pytest.raises(ValueError, match=r"'h.0.extra' is not a Hugging Face toy weight"):
        _toy().from_hf({**hf, "h.0.extra": torch.zeros(1)})
    del hf["h.0.k.weight"]
    with pytest.raises(ValueError, match=r"'layers.0.qkv.weight' packs 3 tensors but the checkpoint lacks "
                                         r"\['h.0.k.weight'\]"):
        _toy().from_hf(hf)
    with pytest.raises(ValueError, match=r"cannot be split into parts of lengths \[4, 2, 2\]"):
        _toy().to_hf({**_toy_state(), "layers.0.qkv.bias": torch.zeros(9)})
    with pytest.raises(ValueError, match=r"lacks 'emb.weight'"):
        _toy().to_hf({k: v for k, v in _toy_state().items() if k != "emb.weight"})


@pytest.mark.parametrize("rule, match", [
    (rename("layers.{i}.w", "h.w"), r"placeholders \['i'\] on our side but \[\] in 'h.w'"),
    (rename("{s}.w", "{s}.W"), r"placeholder \{s\} needs its alternatives"),
    (rename("{s:a|b}.w", "{s:a|c}.W"), r"two different lists of alternatives"),
    (pack("x", "a", "b", sizes=(1, 2, 3)), r"has 2 parts but sizes=\(1, 2, 3\)"),
    (Rule("x", ("a", "b"), transpose=True), r"packs and transposes"),
    ("x", r"rules must be built with rename\(\) or pack\(\)"),
])
def test_malformed_declarations_are_refused_when_built(rule, match):
    with pytest.raises(ValueError, match=match):
        WeightMap("toy", [rule])


def test_a_tied_alias_must_name_an_untied_source():
    with pytest.raises(ValueError, match="tied alias 'a' must name an untied source"):
        WeightMap("toy", [], tied={"a": "b", "b": "c"})
