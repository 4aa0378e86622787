"""CLIP against transformers (random tiny weights, both directions, a right-padded text batch).

Oracle: ``transformers.CLIPModel`` (eager attention). Tolerances: max abs ≤ 1e-4 on the logits,
embeddings, both towers' hidden states and pooled outputs, and attention weights (float32, eval).
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnlab.models.clip import CLIPConfig, CLIPModel, CLIPTextConfig, CLIPVisionConfig, quick_gelu  # noqa: E402
from attnlab.models.hub import from_pretrained  # noqa: E402

transformers.logging.set_verbosity_error()
EOS, PAD = 98, 1
TEXT = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=16, bos_token_id=0, eos_token_id=EOS, pad_token_id=PAD)
VISION = dict(hidden_size=40, intermediate_size=45, num_hidden_layers=2, num_attention_heads=4, image_size=32,
              patch_size=8)
TINY = dict(text_config=TEXT, vision_config=VISION, projection_dim=24)
ATOL = 1e-4
LENGTHS = (12, 7, 4)  # real tokens per row (EOS included), right-padded to 12


def _text(pad_id=PAD):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 97, (3, 12), generator=g)
    mask = torch.zeros(3, 12, dtype=torch.long)
    for row, n in enumerate(LENGTHS):
        ids[row, n - 1] = EOS
        ids[row, n:] = pad_id
        mask[row, :n] = 1
    return ids, mask


def _pixels():
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def _hf_model(path=None, **text_overrides):
    if path is not None:
        return transformers.CLIPModel.from_pretrained(path, attn_implementation="eager").eval()
    torch.manual_seed(0)
    cfg = transformers.CLIPConfig(**{**TINY, "text_config": {**TEXT, **text_overrides}})
    model = transformers.CLIPModel(cfg).eval()
    model.set_attn_implementation("eager")
    with torch.no_grad():  # non-trivial biases and norms, so a misplaced tensor shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _run_both(ours, theirs, pad_id=PAD):
    ids, mask = _text(pad_id)
    x = _pixels()
    with torch.no_grad():
        a = ours(ids, x, mask, output_attentions=True)
        b = theirs(input_ids=ids, pixel_values=x, attention_mask=mask, output_attentions=True)
    return a, b


def _assert_same(ours, theirs):
    pairs = [(f, getattr(ours, f), getattr(theirs, f))
             for f in ("logits_per_image", "logits_per_text", "text_embeds", "image_embeds")]
    for tower in ("text_model_output", "vision_model_output"):
        a, b = getattr(ours, tower), getattr(theirs, tower)
        pairs += [(f"{tower}.last_hidden_state", a.last_hidden_state, b.last_hidden_state)]
        pairs += [(f"{tower}.attentions[{i}]", x, y) for i, (x, y) in enumerate(zip(a.attentions, b.attentions,
                                                                                     strict=True))]
    assert ours.logits_per_image.shape == (2, 3)
    for label, a, b in pairs:
        assert a.shape == b.shape, label
        assert (a - b).abs().max().item() <= ATOL, label


def test_load_transformers_checkpoint(tmp_path):
    theirs = _hf_model()
    theirs.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path)
    assert isinstance(ours, CLIPModel) and not ours.training
    _assert_same(*_run_both(ours, theirs))


def test_transformers_loads_our_checkpoint(tmp_path):
    theirs = _hf_model()
    theirs.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf")
    ours.save_pretrained(tmp_path / "ours")
    _assert_same(*_run_both(ours, _hf_model(tmp_path / "ours")))


def test_fresh_model_round_trips_through_transformers(tmp_path):
    torch.manual_seed(1)
    ours = CLIPModel(CLIPConfig(**TINY)).eval()
    ours.save_pretrained(tmp_path)
    _assert_same(*_run_both(ours, _hf_model(tmp_path)))
    assert CLIPModel.from_pretrained(tmp_path).config == ours.config


@pytest.mark.parametrize("eos_token_id, pad_id", [(EOS, EOS), (2, PAD)])
def test_eos_pooling_conventions(tmp_path, eos_token_id, pad_id):
    """New convention: the first eos_token_id (padding with EOS too); legacy eos_token_id=2: argmax(ids)."""
    theirs = _hf_model(eos_token_id=eos_token_id)
    theirs.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path)
    ids, _ = _text(pad_id)
    assert ours.text_model.eos_positions(ids).tolist() == [n - 1 for n in LENGTHS]
    _assert_same(*_run_both(ours, theirs, pad_id))


def test_logits_are_scaled_cosines():
    model = CLIPModel(CLIPConfig(**TINY)).eval()
    ids, mask = _text()
    x = _pixels()
    with torch.no_grad():
        out = model(ids, x, mask)
        t = model.get_text_features(ids, mask).double()
        v = model.get_image_features(x).double()
    cos = torch.nn.functional.cosine_similarity(t[:, None], v[None], dim=-1)  # (3, 2)
    expected = cos * torch.tensor(2.6592, dtype=torch.float64).exp()
    torch.testing.assert_close(out.logits_per_text.double(), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.logits_per_image, out.logits_per_text.T, atol=0, rtol=0)
    torch.testing.assert_close(out.text_embeds.norm(dim=-1), torch.ones(3), atol=1e-6, rtol=0)


def test_quick_gelu():
    x = torch.linspace(-4, 4, 9, dtype=torch.float64)
    torch.testing.assert_close(quick_gelu(x), x / (1 + torch.exp(-1.702 * x)), atol=1e-12, rtol=0)


def test_config_round_trip():
    cfg = CLIPConfig(**TINY)
    assert isinstance(cfg.text_config, CLIPTextConfig) and isinstance(cfg.vision_config, CLIPVisionConfig)
    assert CLIPConfig.from_hf(cfg.to_hf()) == cfg
    hf = transformers.CLIPConfig(**cfg.to_hf())
    assert CLIPConfig.from_hf(hf.to_dict()) == cfg


def test_config_reads_legacy_tower_dicts():
    legacy = {"text_config": {"hidden_size": 64}, "text_config_dict": {**TEXT, "eos_token_id": 2},
              "vision_config_dict": VISION, "projection_dim": 24}
    cfg = CLIPConfig.from_hf(legacy)
    assert cfg.text_config == CLIPTextConfig(**{**TEXT, "eos_token_id": 2})
    assert cfg.vision_config == CLIPVisionConfig(**VISION)
    assert CLIPConfig.from_hf({}) == CLIPConfig()


@pytest.mark.parametrize("bad, field", [
    (dict(projection_dim=0), "projection_dim"),
    (dict(text_config={**TEXT, "hidden_act": "swish"}), "hidden_act"),
    (dict(text_config={**TEXT, "eos_token_id": [2, 3]}), "eos_token_id"),
    (dict(vision_config={**VISION, "patch_size": 5}), "patch_size"),
    (dict(vision_config={**VISION, "hidden_size": 42}), "hidden_size"),
])
def test_config_rejects_bad_values(bad, field):
    with pytest.raises(ValueError, match=field):
        CLIPConfig(**{**TINY, **bad})


@pytest.mark.parametrize("kwargs, match", [
    (dict(input_ids=torch.tensor([[1, 99]])), "input_ids"),
    (dict(input_ids=torch.ones(1, 17, dtype=torch.long)), "max_position_embeddings"),
    (dict(input_ids=torch.tensor([[5, 6, 7]])), "eos_token_id"),
    (dict(input_ids=torch.tensor([[5, EOS]]), attention_mask=torch.ones(1, 3)), "attention_mask"),
    (dict(input_ids=torch.tensor([[5, EOS]]), pixel_values=torch.randn(1, 3, 16, 16)), "image_size"),
    (dict(input_ids=torch.tensor([[5, EOS]]), pixel_values=torch.randn(1, 1, 32, 32)), "num_channels"),
])
def test_bad_inputs_raise(kwargs, match):
    model = CLIPModel(CLIPConfig(**TINY))
    kwargs.setdefault("pixel_values", torch.randn(1, 3, 32, 32))
    with pytest.raises(ValueError, match=match):
        model(**kwargs)
