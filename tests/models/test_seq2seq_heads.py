"""BART task heads against transformers' classes (random tiny configs, no download), both directions.

Oracle: ``transformers`` (eager attention), eval mode, float32. Tolerance: 1e-4 on logits, as the other
families; losses to the float32 tolerance of ``tests/_tolerance.py``.
"""
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnlab  # noqa: E402
from attnlab.models.bart import BartConfig, BartForConditionalGeneration  # noqa: E402
from attnlab.models.heads import (BartForQuestionAnswering, BartForSequenceClassification,  # noqa: E402
                                  ClassifierConfig, classifier_from_pretrained)
from tests._tolerance import tolerance  # noqa: E402

BART = dict(vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=64)
BOS, PAD, EOS = 0, 1, 2  # BART's defaults
ATOL = 1e-4
LABELS = {0: "neg", 1: "neu", 2: "pos"}
AUTO = {"BartForSequenceClassification": "AutoModelForSequenceClassification",
        "BartForQuestionAnswering": "AutoModelForQuestionAnswering"}


def _hf(name, **extra):
    torch.manual_seed(0)
    labels = {0: "start", 1: "end"} if name == "BartForQuestionAnswering" else LABELS
    cfg = transformers.BartConfig(**BART, id2label=labels, attn_implementation="eager", **extra)
    model = getattr(transformers, name)(cfg).eval()
    with torch.no_grad():  # non-trivial biases and norms, so a misplaced tensor shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _inputs(lengths=(11, 7, 4)):
    """``<s> x … </s>`` rows, right-padded: one eos each, as BART's tokenizer writes them."""
    g = torch.Generator().manual_seed(1)
    L = max(lengths)
    ids = torch.full((len(lengths), L), PAD)
    mask = torch.zeros(len(lengths), L, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.cat([torch.tensor([BOS]), torch.randint(3, 99, (n - 2,), generator=g), torch.tensor([EOS])])
        mask[b, :n] = 1
    return ids, mask


def _outputs(model, name, ids, mask):
    out = model(ids, attention_mask=mask)
    if name == "BartForQuestionAnswering":
        return torch.stack([out.start_logits, out.end_logits])
    return out.logits


def _close(a, b):
    assert a.shape == b.shape
    assert (a - b).abs().max() <= ATOL


@pytest.mark.parametrize("name", list(AUTO))
def test_head_loads_transformers_and_saves_back(name, tmp_path):
    hf = _hf(name, classifier_dropout=0.1)
    hf.save_pretrained(tmp_path / "hf")
    ours = attnlab.from_pretrained(tmp_path / "hf")
    assert type(ours).__name__ == name and ours.config.classifier_dropout == 0.1
    ids, mask = _inputs()
    with torch.no_grad():
        expected = _outputs(hf, name, ids, mask)
        _close(_outputs(ours, name, ids, mask), expected)
        ours.save_pretrained(tmp_path / "ours")
        back = getattr(transformers, AUTO[name]).from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
        assert type(back).__name__ == name
        _close(_outputs(back, name, ids, mask), expected)
    assert back.config.id2label == hf.config.id2label and back.config.classifier_dropout == 0.1
    assert attnlab.from_pretrained(tmp_path / "ours").config.id2label == ours.config.id2label


def test_eos_pooling_reads_each_rows_last_eos(tmp_path):
    hf = _hf("BartForSequenceClassification")
    hf.save_pretrained(tmp_path)
    ours = attnlab.from_pretrained(tmp_path)
    ids, mask = _inputs()
    ids[:, 2] = EOS  # a second eos in every row (a pair: "<s> a </s></s> b </s>"); the last one is read
    with torch.no_grad():
        _close(ours(ids, attention_mask=mask).logits, hf(ids, attention_mask=mask).logits)
        alone = ours(ids[2:, :4]).logits  # the last row without its padding
        _close(ours(ids, attention_mask=mask).logits[2:], alone)
    bad = ids.clone()
    bad[0, 5] = EOS
    with pytest.raises(ValueError, match=r"same number \(>= 1\) of eos tokens \(eos_token_id=2\).*\[3, 2, 2\]"):
        ours(bad, attention_mask=mask)


@pytest.mark.parametrize("kind", ["single", "regression", "multi"])
def test_sequence_classification_loss_equals_transformers(kind, tmp_path):
    hf = _hf("BartForSequenceClassification")
    if kind == "regression":
        hf.config.id2label, hf.config.label2id = {0: "score"}, {"score": 0}
        hf = transformers.BartForSequenceClassification(hf.config).eval()
    hf.save_pretrained(tmp_path)
    ours = attnlab.from_pretrained(tmp_path)
    ids, mask = _inputs()
    labels = {"single": torch.tensor([2, 0, 1]), "regression": torch.tensor([0.5, -1.0, 2.0]),
              "multi": torch.tensor([[1.0, 0, 1], [0, 0, 1], [1, 1, 0]])}[kind]
    with torch.no_grad():
        a = ours(ids, attention_mask=mask, labels=labels).loss
        b = hf(ids, attention_mask=mask, labels=labels).loss
    assert abs(float(a) - float(b)) <= tolerance(b, n=32, depth=4)


def test_qa_loss_equals_transformers(tmp_path):
    hf = _hf("BartForQuestionAnswering")
    hf.save_pretrained(tmp_path)
    ours = attnlab.from_pretrained(tmp_path)
    ids, mask = _inputs()
    start, end = torch.tensor([1, 3, 20]), torch.tensor([4, 5, 2])  # 20 > L: clamped and ignored, as HF
    with torch.no_grad():
        a = ours(ids, attention_mask=mask, start_positions=start, end_positions=end).loss
        b = hf(ids, attention_mask=mask, start_positions=start, end_positions=end).loss
    assert abs(float(a) - float(b)) <= tolerance(b, n=32, depth=4)


@pytest.mark.parametrize("name", list(AUTO))
def test_lm_checkpoint_gets_a_fresh_head_with_one_warning(name, tmp_path):
    torch.manual_seed(0)
    lm = BartForConditionalGeneration(BartConfig(**BART)).eval()
    lm.save_pretrained(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = getattr(attnlab.models.heads, name).from_pretrained(tmp_path)
    lines = [str(w.message) for w in caught if "freshly initialised" in str(w.message)]
    head = "classification_head.out_proj.weight" if name.endswith("Classification") else "qa_outputs.weight"
    assert len(lines) == 1 and head in lines[0] and "\n" not in lines[0]
    assert torch.equal(model.shared.weight, lm.shared.weight)
    assert torch.equal(model.decoder.layers[1].ffn.w2.weight, lm.decoder.layers[1].ffn.w2.weight)
    assert not any(k.startswith(("lm_head", "final_logits_bias")) for k in model.state_dict())


def test_classifier_from_pretrained_resizes_only_the_output_layer(tmp_path):
    hf = _hf("BartForSequenceClassification")
    hf.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="classification_head.out_proj.weight, classification_head.out_proj.bias"):
        two = classifier_from_pretrained(tmp_path, {0: "x", 1: "y"})
    assert two.classification_head.out_proj.weight.shape == (2, 32)
    assert torch.equal(two.classification_head.dense.weight, hf.classification_head.dense.weight)


def test_bad_configs_are_refused():
    with pytest.raises(TypeError, match="BartForSequenceClassification needs a ClassifierConfig of a BartConfig"):
        BartForSequenceClassification(BartConfig(**BART))
    with pytest.raises(ValueError, match="num_labels=2"):
        BartForQuestionAnswering(ClassifierConfig(BartConfig(**BART), num_labels=3))
