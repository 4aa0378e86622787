"""Image classification heads (ViT on [CLS], CLIP on the mean of the patch tokens) against transformers.

Oracle: ``transformers.ViTForImageClassification`` / ``CLIPForImageClassification`` from random tiny configs
(eager attention, float32, eval), both directions of the checkpoint. Tolerance: max abs ≤ 1e-4 on logits and
losses (the issue's bar; far above float32 round-off at these widths). A checkpoint without the head (bare
``ViTModel``, ``CLIPModel``) loads with a fresh head and one warning line; the encoder's output is unchanged.
"""
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnlab.models.classifier import ClassifierConfig  # noqa: E402
from attnlab.models.clip import CLIPConfig  # noqa: E402
from attnlab.models.hub import from_pretrained  # noqa: E402
from attnlab.models.vit import ViTConfig  # noqa: E402
from attnlab.models.image_heads import CLIPForImageClassification, ViTForImageClassification  # noqa: E402

transformers.logging.set_verbosity_error()
ATOL = 1e-4
HEADS = {"ViTForImageClassification": ViTForImageClassification,
         "CLIPForImageClassification": CLIPForImageClassification}
LABELS = {0: "zero", 1: "one", 2: "two"}
VIT = dict(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
           intermediate_size=37, attn_implementation="eager")
CLIP = dict(text_config=dict(vocab_size=99, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                             num_attention_heads=2, max_position_embeddings=8, bos_token_id=0, eos_token_id=98),
            vision_config=dict(hidden_size=40, intermediate_size=45, num_hidden_layers=2, num_attention_heads=4,
                               image_size=16, patch_size=4),
            projection_dim=24, attn_implementation="eager")


def _pixels():
    return torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def _perturbed(model):
    """Non-trivial biases and norms, so a misplaced tensor shows."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def _hf(name, **labels):
    torch.manual_seed(0)
    if name.startswith("ViT"):
        config = transformers.ViTConfig(**VIT, **labels)
    else:
        config = transformers.CLIPConfig(**CLIP, **labels)
    return _perturbed(getattr(transformers, name)(config))


def _logits_and_loss(model, x, y):
    with torch.no_grad():
        out = model(pixel_values=x, labels=y)
    return out.logits, out.loss


@pytest.mark.parametrize("name", ["ViTForImageClassification", "CLIPForImageClassification"])
def test_both_directions_equal_transformers_and_keep_labels(tmp_path, name):
    theirs = _hf(name, id2label=LABELS)
    theirs.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf")
    assert type(ours).__name__ == name and not ours.training
    assert ours.config.id2label == LABELS and ours.config.num_labels == 3
    x, y = _pixels(), torch.tensor([0, 2, 1, 2])
    (a, la), (b, lb) = _logits_and_loss(ours, x, y), _logits_and_loss(theirs, x, y)
    assert a.shape == (4, 3)
    assert (a - b).abs().max().item() <= ATOL
    assert abs(la.item() - lb.item()) <= ATOL
    ours.save_pretrained(tmp_path / "ours")
    back = getattr(transformers, name).from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    assert back.config.id2label == LABELS and back.config.label2id == {v: k for k, v in LABELS.items()}
    c, lc = _logits_and_loss(back, x, y)
    assert (c - b).abs().max().item() <= ATOL and abs(lc.item() - lb.item()) <= ATOL


def test_clip_head_is_the_mean_of_the_patch_tokens_before_the_post_norm():
    ours = _perturbed(CLIPForImageClassification(ClassifierConfig(CLIPConfig.from_hf(CLIP), num_labels=3)))
    x = _pixels()
    with torch.no_grad():
        h = ours.vision_model(x).last_hidden_state  # (B, 1 + N, E)
        want = h[:, 1:].double().mean(1) @ ours.classifier.weight.double().T + ours.classifier.bias.double()
        got = ours(x).logits
    assert h.shape == (4, 1 + 16, 40)
    assert (got.double() - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("bare, head", [("ViTModel", "ViTForImageClassification"),
                                        ("CLIPModel", "CLIPForImageClassification")])
def test_checkpoint_without_the_head_loads_with_a_fresh_one_and_one_warning(tmp_path, bare, head):
    theirs = _hf(bare)
    theirs.save_pretrained(tmp_path / "bare")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = from_pretrained(tmp_path / "bare", model_cls=HEADS[head])
    lines = [str(w.message) for w in caught if "freshly initialised" in str(w.message)]
    assert len(lines) == 1 and "classifier" in lines[0] and "\n" not in lines[0]
    x = _pixels()
    with torch.no_grad():  # the encoder came through unchanged
        if bare == "ViTModel":
            a, b = ours.vit(x).last_hidden_state, theirs(pixel_values=x).last_hidden_state
        else:
            a, b = ours.vision_model(x).last_hidden_state, theirs.vision_model(pixel_values=x).last_hidden_state
        assert (a - b).abs().max().item() <= ATOL
        assert ours(x).logits.shape == (4, 2) and torch.isfinite(ours(x).logits).all()
    assert ours.classifier.bias.abs().max().item() == 0.0 and ours.classifier.weight.std().item() > 0
    ours.save_pretrained(tmp_path / "head")  # and transformers loads the completed model
    back = getattr(transformers, head).from_pretrained(tmp_path / "head", attn_implementation="eager").eval()
    with torch.no_grad():
        assert (back(pixel_values=x).logits - ours(x).logits).abs().max().item() <= ATOL


def test_bad_input_names_the_argument():
    vit = ViTForImageClassification(ViTConfig(**{k: v for k, v in VIT.items() if k != "attn_implementation"},
                                              num_labels=3))
    with pytest.raises(ValueError, match="pixel_values"):
        vit(torch.randn(2, 3, 8, 8))
    with pytest.raises(ValueError, match="labels must lie in"):
        vit(torch.randn(2, 3, 16, 16), labels=torch.tensor([0, 7]))
    with pytest.raises(TypeError, match="ClassifierConfig of a CLIPConfig"):
        CLIPForImageClassification(CLIPConfig())
    clip = CLIPForImageClassification(ClassifierConfig(CLIPConfig.from_hf(CLIP), num_labels=2))
    with pytest.raises(ValueError, match="num_channels=3"):
        clip(torch.randn(2, 1, 16, 16))

