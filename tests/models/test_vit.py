"""ViT against transformers (random tiny weights, both directions).

Oracle: ``transformers.ViTForImageClassification`` / ``ViTModel`` (eager attention). Tolerances:
max abs ≤ 1e-4 on logits, hidden states, pooler output and attention weights (float32, eval mode).
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnlab.models.hub import from_pretrained  # noqa: E402
from attnlab.models.vit import ViTConfig, ViTForImageClassification, ViTModel  # noqa: E402

transformers.logging.set_verbosity_error()
TINY = dict(image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=37, num_labels=5)
ATOL = 1e-4
CLASSES = ["ViTForImageClassification", "ViTModel"]


def _pixels(seed=0, batch=3):
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def _hf_model(name, path=None, **overrides):
    cls = getattr(transformers, name)
    if path is not None:
        return cls.from_pretrained(path, attn_implementation="eager").eval()
    torch.manual_seed(0)
    model = cls(transformers.ViTConfig(**{**TINY, **overrides}, attn_implementation="eager")).eval()
    with torch.no_grad():  # non-trivial biases and norms, so a misplaced tensor shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _assert_same(ours, theirs, name):
    pairs = [("last_hidden_state", ours.last_hidden_state, getattr(theirs, "last_hidden_state", None))]
    if name == "ViTModel":
        pairs.append(("pooler_output", ours.pooler_output, theirs.pooler_output))
    else:
        assert ours.logits.shape == (3, 5)
        pairs.append(("logits", ours.logits, theirs.logits))
    for i, (a, b) in enumerate(zip(ours.hidden_states, theirs.hidden_states, strict=True)):
        pairs.append((f"hidden_states[{i}]", a, b))
    for i, (a, b) in enumerate(zip(ours.attentions, theirs.attentions, strict=True)):
        pairs.append((f"attentions[{i}]", a, b))
    for label, a, b in pairs:
        if b is None:
            continue
        assert a.shape == b.shape, label
        assert (a - b).abs().max().item() <= ATOL, label


def _run_both(ours, theirs):
    x = _pixels()
    with torch.no_grad():
        a = ours(x, output_attentions=True, output_hidden_states=True)
        b = theirs(pixel_values=x, output_attentions=True, output_hidden_states=True)
    return a, b


@pytest.mark.parametrize("name", CLASSES)
def test_load_transformers_checkpoint(tmp_path, name):
    theirs = _hf_model(name)
    theirs.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path)
    assert type(ours).__name__ == name and not ours.training
    _assert_same(*_run_both(ours, theirs), name)


@pytest.mark.parametrize("name", CLASSES)
def test_transformers_loads_our_checkpoint(tmp_path, name):
    theirs = _hf_model(name)
    theirs.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf")
    ours.save_pretrained(tmp_path / "ours")
    _assert_same(*_run_both(ours, _hf_model(name, tmp_path / "ours")), name)


def test_without_qkv_bias_round_trips(tmp_path):
    theirs = _hf_model("ViTForImageClassification", qkv_bias=False)
    theirs.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf")
    assert ours.vit.layers[0].self_attn.in_proj.bias is None
    _assert_same(*_run_both(ours, theirs), "ViTForImageClassification")
    ours.save_pretrained(tmp_path / "ours")
    _assert_same(*_run_both(ours, _hf_model("ViTForImageClassification", tmp_path / "ours")),
                 "ViTForImageClassification")


def test_fresh_model_round_trips_through_transformers(tmp_path):
    torch.manual_seed(1)
    cfg = ViTConfig(**TINY, id2label={i: f"class {i}" for i in range(5)})
    ours = ViTForImageClassification(cfg).eval()
    ours.save_pretrained(tmp_path)
    theirs = _hf_model("ViTForImageClassification", tmp_path)
    assert theirs.config.id2label[3] == "class 3"
    _assert_same(*_run_both(ours, theirs), "ViTForImageClassification")
    assert ViTForImageClassification.from_pretrained(tmp_path).config == ours.config


def test_attentions_are_softmax_rows_and_do_not_change_outputs():
    model = ViTForImageClassification(ViTConfig(**TINY)).eval()
    x = _pixels()
    with torch.no_grad():
        plain = model(x)
        full = model(x, output_attentions=True, output_hidden_states=True)
    assert plain.attentions is None and plain.hidden_states is None
    torch.testing.assert_close(plain.logits, full.logits, atol=0, rtol=0)
    for w in full.attentions:
        assert w.shape == (3, 4, 17, 17)  # 1 + (32 / 8)² tokens
        torch.testing.assert_close(w.sum(-1), torch.ones(3, 4, 17), atol=1e-5, rtol=0)


def test_config_round_trip():
    cfg = ViTConfig(**TINY)
    assert ViTConfig.from_hf(cfg.to_hf()) == ViTConfig(**TINY, id2label={i: f"LABEL_{i}" for i in range(5)})
    hf = transformers.ViTConfig(**cfg.to_hf())
    assert hf.num_labels == 5
    assert ViTConfig.from_hf(hf.to_dict()).num_labels == 5


@pytest.mark.parametrize("bad, field", [
    (dict(hidden_size=30), "hidden_size"), (dict(hidden_act="swish"), "hidden_act"),
    (dict(patch_size=5), "patch_size"), (dict(num_labels=0), "num_labels"),
    (dict(hidden_dropout_prob=1.0), "hidden_dropout_prob"), (dict(id2label={0: "a"}), "id2label"),
])
def test_config_rejects_bad_values(bad, field):
    with pytest.raises(ValueError, match=field):
        ViTConfig(**{**TINY, **bad})


def test_config_rejects_unsupported_pooler():
    with pytest.raises(ValueError, match="pooler_act"):
        ViTConfig.from_hf({**TINY, "pooler_act": "relu"})


@pytest.mark.parametrize("pixels, match", [
    (torch.randn(2, 1, 32, 32), "num_channels"),
    (torch.randn(2, 3, 24, 32), "image_size"),
    (torch.randn(3, 32, 32), "pixel_values"),
    (torch.ones(2, 3, 32, 32, dtype=torch.long), "pixel_values"),
])
def test_bad_inputs_raise(pixels, match):
    model = ViTModel(ViTConfig(**TINY))
    with pytest.raises(ValueError, match=match):
        model(pixels)
