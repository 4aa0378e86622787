"""BART and T5 task heads against transformers' classes (random tiny configs, no download), both directions.

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
                                  ClassifierConfig, T5ForQuestionAnswering, T5ForTokenClassification,
                                  classifier_from_pretrained)
from attnlab.models.t5 import T5Config, T5ForConditionalGeneration  # noqa: E402
from tests._heads import check_round_trip, check_sequence_loss, close as _close  # noqa: E402
from tests._tolerance import tolerance  # noqa: E402

BART = dict(vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=64)
T5 = dict(vocab_size=99, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
          relative_attention_max_distance=20)
BOS, PAD, EOS = 0, 1, 2  # BART's defaults
T5_PAD, T5_EOS = 0, 1  # T5's: no bos, "x … </s>"
LABELS = {0: "neg", 1: "neu", 2: "pos"}
AUTO = {"BartForSequenceClassification": "AutoModelForSequenceClassification",
        "BartForQuestionAnswering": "AutoModelForQuestionAnswering",
        "T5ForSequenceClassification": "AutoModelForSequenceClassification",
        "T5ForTokenClassification": "AutoModelForTokenClassification",
        "T5ForQuestionAnswering": "AutoModelForQuestionAnswering"}


def _hf(name, **extra):
    torch.manual_seed(0)
    labels = {0: "start", 1: "end"} if name.endswith("QuestionAnswering") else LABELS
    if name.startswith("Bart"):
        cfg = transformers.BartConfig(**BART, id2label=labels, attn_implementation="eager", **extra)
    else:
        cfg = transformers.T5Config(**T5, id2label=labels, pad_token_id=T5_PAD, eos_token_id=T5_EOS,
                                    decoder_start_token_id=T5_PAD, attn_implementation="eager", **extra)
    model = getattr(transformers, name)(cfg).eval()
    with torch.no_grad():  # non-trivial biases and norms, so a misplaced tensor shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _inputs(lengths=(11, 7, 4), t5=False):
    """``<s> x … </s>`` rows (T5: ``x … </s>``), right-padded: one eos each, as the tokenizers write them."""
    g = torch.Generator().manual_seed(1)
    L = max(lengths)
    pad, eos = (T5_PAD, T5_EOS) if t5 else (PAD, EOS)
    ids = torch.full((len(lengths), L), pad)
    mask = torch.zeros(len(lengths), L, dtype=torch.long)
    for b, n in enumerate(lengths):
        body = torch.randint(3, 99, (n - 1 if t5 else n - 2,), generator=g)
        ids[b, :n] = torch.cat([body if t5 else torch.cat([torch.tensor([BOS]), body]), torch.tensor([eos])])
        mask[b, :n] = 1
    return ids, mask


@pytest.mark.parametrize("name", list(AUTO))
def test_head_loads_transformers_and_saves_back(name, tmp_path):
    hf = _hf(name, classifier_dropout=0.1)
    ours, back = check_round_trip(hf, getattr(transformers, AUTO[name]), *_inputs(t5=name.startswith("T5")), tmp_path)
    assert ours.config.classifier_dropout == 0.1
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
    ids, mask = _inputs()
    check_sequence_loss(_hf("BartForSequenceClassification"), kind, ids, mask, tmp_path, depth=4)


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


@pytest.mark.parametrize("name", ["BartForSequenceClassification", "BartForQuestionAnswering"])
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


def test_t5_eos_pooling_and_losses_equal_transformers(tmp_path):
    ids, mask = _inputs(t5=True)
    hf = _hf("T5ForSequenceClassification")
    hf.save_pretrained(tmp_path / "seq")
    ours = attnlab.from_pretrained(tmp_path / "seq")
    labels = torch.tensor([2, 0, 1])
    with torch.no_grad():
        a, b = ours(ids, attention_mask=mask, labels=labels), hf(ids, attention_mask=mask, labels=labels)
        _close(a.logits, b.logits)
        _close(ours(ids, attention_mask=mask).logits[2:], ours(ids[2:, :4]).logits)  # padding changes nothing
    assert abs(float(a.loss) - float(b.loss)) <= tolerance(b.loss, n=32, depth=4)
    tok = _hf("T5ForTokenClassification")
    tok.save_pretrained(tmp_path / "tok")
    token_labels = torch.randint(0, 3, ids.shape, generator=torch.Generator().manual_seed(2))
    token_labels[mask == 0] = -100
    qa = _hf("T5ForQuestionAnswering")
    qa.save_pretrained(tmp_path / "qa")
    start, end = torch.tensor([1, 3, 20]), torch.tensor([4, 5, 2])
    with torch.no_grad():
        a = attnlab.from_pretrained(tmp_path / "tok")(ids, attention_mask=mask, labels=token_labels).loss
        b = tok(ids, attention_mask=mask, labels=token_labels).loss
        c = attnlab.from_pretrained(tmp_path / "qa")(ids, attention_mask=mask, start_positions=start,
                                                     end_positions=end).loss
        d = qa(ids, attention_mask=mask, start_positions=start, end_positions=end).loss
    assert abs(float(a) - float(b)) <= tolerance(b, n=32, depth=2)
    assert abs(float(c) - float(d)) <= tolerance(d, n=32, depth=4)


@pytest.mark.parametrize("name", ["T5ForSequenceClassification", "T5ForTokenClassification", "T5ForQuestionAnswering"])
@pytest.mark.parametrize("tied", [True, False], ids=["t5", "t5-v1.1"])
def test_t5_lm_checkpoint_gets_a_fresh_head_with_one_warning(name, tied, tmp_path):
    torch.manual_seed(0)
    lm = T5ForConditionalGeneration(T5Config(**T5, tie_word_embeddings=tied)).eval()
    lm.save_pretrained(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = getattr(attnlab.models.heads, name).from_pretrained(tmp_path)
    lines = [str(w.message) for w in caught if "freshly initialised" in str(w.message)]
    assert len(lines) == 1 and model.head_name in lines[0] and "\n" not in lines[0]
    assert torch.equal(model.shared.weight, lm.shared.weight) and model.lm_head is None
    assert torch.equal(model.encoder.layers[1].ffn.w2.weight, lm.encoder.layers[1].ffn.w2.weight)
    assert hasattr(model, "decoder") == (name != "T5ForTokenClassification")  # the token head: encoder only
    ids, mask = _inputs(t5=True)
    with torch.no_grad():  # the body's encoder is the LM's, to the bit
        if name == "T5ForTokenClassification":
            h = lm.encode(ids, mask)
            assert torch.equal(model(ids, mask).logits, model.classifier(h))


def test_t5_bad_configs_are_refused():
    with pytest.raises(TypeError, match="T5ForTokenClassification needs a ClassifierConfig of a T5Config"):
        T5ForTokenClassification(T5Config(**T5))
    with pytest.raises(ValueError, match="T5ForQuestionAnswering needs num_labels=2"):
        T5ForQuestionAnswering(ClassifierConfig(T5Config(**T5), num_labels=3))
