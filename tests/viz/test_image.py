"""Attention over an image: rollout equals its formula, the per-head maps are the [CLS] rows of the given weights,
the figure and its HTML page are written, a ViT and CLIP's image tower run end to end (``attnlab viz --image``)."""
import numpy as np
import pytest
import torch

from attnlab.cli import main
from attnlab.models.clip import CLIPConfig, CLIPModel
from attnlab.models.vit import ViTConfig, ViTModel
from attnlab.viz import attention_rollout, image_view
from attnlab.viz.image import image_attention_from_path, patch_grid

PNG = b"\x89PNG\r\n\x1a\n"
VIT = dict(image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
           intermediate_size=37)


def _att(layers=3, heads=2, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple((2 * torch.randn(1, heads, T, T, generator=g)).softmax(-1) for _ in range(layers))


def test_rollout_is_the_product_of_residual_averaged_layers():
    att = _att()
    w = torch.stack([a[0] for a in att])  # (layers, heads, T, T)
    expected = np.eye(5)
    for layer in range(3):  # float64 by hand: ½·mean_h A + ½·I, rows renormalised, applied on the left
        a = 0.5 * w[layer].double().mean(0).numpy() + 0.5 * np.eye(5)
        expected = (a / a.sum(1, keepdims=True)) @ expected
    got = attention_rollout(w)
    assert torch.allclose(got.double(), torch.from_numpy(expected), atol=4 * torch.finfo(torch.float32).eps)
    assert torch.allclose(got.sum(-1), torch.ones(5), atol=4 * torch.finfo(torch.float32).eps)
    identity = torch.eye(4).expand(2, 3, 4, 4)  # each token attends to itself: nothing mixes
    assert torch.equal(attention_rollout(identity), torch.eye(4))


def test_image_view_maps_are_the_cls_rows(tmp_path):
    att = _att(T=1 + 2 * 2)
    picture = np.linspace(0, 255, 16 * 16 * 3).reshape(16, 16, 3)
    view = image_view(att, picture, layer=1)
    assert view.layer == 1 and view.heads.shape == (2, 2, 2)
    for h in range(2):
        assert torch.equal(view.heads[h], att[1][0, h, 0, 1:].reshape(2, 2))
    w = torch.stack([a[0] for a in att])
    assert torch.equal(view.rollout, attention_rollout(w)[0, 1:].reshape(2, 2))
    assert view._repr_png_().startswith(PNG)
    assert view.save(tmp_path / "v.png").read_bytes() == view.png
    page = view.save(tmp_path / "v.html").read_text(encoding="utf-8")
    assert "default-src 'none'; img-src data:" in page and "data:image/png;base64," in page
    only = image_view(att, torch.rand(3, 8, 8), heads=[1])  # (C, H, W) tensors in [0, 1] too
    assert torch.equal(only.heads[0], att[-1][0, 1, 0, 1:].reshape(2, 2))


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="not \\[CLS\\] \\+ a square grid"):
        image_view(_att(T=4), np.zeros((8, 8)))
    assert patch_grid(7, (2, 3)) == (2, 3)
    with pytest.raises(ValueError, match="rows·cols = 6"):
        patch_grid(7, (2, 2))
    with pytest.raises(ValueError, match="layer must be an int in \\[0, 3\\)"):
        image_view(_att(), np.zeros((8, 8)), layer=3)
    with pytest.raises(TypeError, match="image must be"):
        image_view(_att(), "cat.png")
    with pytest.raises(ValueError, match="image must be"):
        image_view(_att(), np.zeros((8, 8, 2)))
    with pytest.raises(TypeError, match=r"attentions\[0\] must be a torch.Tensor"):
        image_view(([[0.5]],), np.zeros((8, 8)))


def _picture(path, size=(40, 30)):
    from PIL import Image

    rgb = (np.arange(size[0] * size[1] * 3).reshape(size[1], size[0], 3) % 256).astype(np.uint8)
    Image.fromarray(rgb).save(path)
    return path


def test_vit_end_to_end_through_the_cli(tmp_path, capsys):
    torch.manual_seed(0)
    ViTModel(ViTConfig(**VIT)).eval().save_pretrained(tmp_path / "vit")
    pic = _picture(tmp_path / "cat.png")
    att, picture, name = image_attention_from_path(tmp_path / "vit", pic)
    assert name == "ViTModel" and picture.shape == (32, 32, 3) and len(att) == 2
    assert att[0].shape == (1, 4, 17, 17)  # [CLS] + (32/8)² patches
    assert main(["viz", "--model", str(tmp_path / "vit"), "--image", str(pic), "--out", str(tmp_path / "v.html"),
                 "--png", str(tmp_path / "png"), "--layer", "0"]) == 0
    assert "maps of layer 0" in capsys.readouterr().out
    assert (tmp_path / "png" / "image_attention.png").read_bytes().startswith(PNG)
    assert "data:image/png;base64," in (tmp_path / "v.html").read_text(encoding="utf-8")
    assert main(["viz", "--model", str(tmp_path / "vit"), "--image", str(pic), "--text", "a",
                 "--out", str(tmp_path / "w.html")]) == 2
    assert "--image reads a picture, not text: drop --text" in capsys.readouterr().err


def test_clip_image_tower(tmp_path):
    torch.manual_seed(0)
    vision = dict(hidden_size=40, intermediate_size=45, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                  patch_size=8)
    text = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4,
                max_position_embeddings=16)
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=24)).eval().save_pretrained(
        tmp_path / "clip")
    att, picture, name = image_attention_from_path(tmp_path / "clip", _picture(tmp_path / "p.png", (50, 32)))
    assert name == "CLIPModel" and picture.shape == (32, 32, 3) and att[1].shape == (1, 4, 17, 17)
    view = image_view(att, picture)
    assert view.layer == 1 and torch.equal(view.heads[3], att[1][0, 3, 0, 1:].reshape(4, 4))


def test_clip_image_classifier_shows_its_tower(tmp_path):
    """A CLIPForImageClassification (a task head ``from_pretrained`` loads) shows its image tower's attention,
    equal to CLIPModel's with the same tower weights."""
    from attnlab.models.classifier import ClassifierConfig
    from attnlab.models.image_heads import CLIPForImageClassification

    torch.manual_seed(0)
    vision = dict(hidden_size=40, intermediate_size=45, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                  patch_size=8)
    text = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4,
                max_position_embeddings=16)
    cfg = CLIPConfig(text_config=text, vision_config=vision, projection_dim=24)
    head = CLIPForImageClassification(ClassifierConfig(cfg, num_labels=3)).eval()
    head.save_pretrained(tmp_path / "head")
    clip = CLIPModel(cfg).eval()
    clip.vision_model.load_state_dict(head.vision_model.state_dict())
    clip.save_pretrained(tmp_path / "clip")
    pic = _picture(tmp_path / "p.png", (50, 32))
    att, picture, name = image_attention_from_path(tmp_path / "head", pic)
    ref, _, _ = image_attention_from_path(tmp_path / "clip", pic)
    assert name == "CLIPForImageClassification" and picture.shape == (32, 32, 3)
    assert all(torch.equal(a, b) for a, b in zip(att, ref))


def test_greyscale_vit_reads_one_channel(tmp_path, capsys):
    """A ViT with ``num_channels=1`` (e.g. ``attnlab train digits-vit``) is given the picture in grey: the luminance
    PIL computes, normalised with the model's one mean and std, and shown in grey."""
    from PIL import Image

    torch.manual_seed(0)
    ViTModel(ViTConfig(**{**VIT, "num_channels": 1})).eval().save_pretrained(tmp_path / "grey")
    pic = _picture(tmp_path / "cat.png")
    att, picture, _ = image_attention_from_path(tmp_path / "grey", pic)
    assert picture.shape == (32, 32, 1) and att[0].shape == (1, 4, 17, 17)
    expected = torch.tensor(list(Image.open(pic).convert("L").resize((32, 32), Image.BILINEAR).getdata()),
                            dtype=torch.float32).view(32, 32, 1) / 255.0
    assert torch.equal(torch.from_numpy(picture), expected)
    assert main(["viz", "--model", str(tmp_path / "grey"), "--image", str(pic), "--out", str(tmp_path / "g.html")]) == 0
