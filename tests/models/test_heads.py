"""Task heads against transformers' classes (random tiny configs, no download), both directions.

Oracle: ``transformers`` (eager attention), eval mode, float32. Tolerance: 1e-4 on logits, as the other
families; losses to the float32 tolerance of ``tests/_tolerance.py``.
"""
import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnlab  # noqa: E402
from attnlab.models.bert import BertConfig, BertModel  # noqa: E402
from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel  # noqa: E402
from attnlab.models.heads import (BertForQuestionAnswering, BertForSequenceClassification,  # noqa: E402
                                  BertForTokenClassification, ClassifierConfig, GPT2ForSequenceClassification)
from tests._heads import check_round_trip, close as _close  # noqa: E402
from tests._tolerance import tolerance  # noqa: E402

BERT = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
            max_position_embeddings=64)
GPT2 = dict(vocab_size=99, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=1)
LABELS = {0: "neg", 1: "neu", 2: "pos"}
BERT_HEADS = ["BertForSequenceClassification", "BertForTokenClassification", "BertForQuestionAnswering"]
AUTO = {"BertForSequenceClassification": "AutoModelForSequenceClassification",
        "BertForTokenClassification": "AutoModelForTokenClassification",
        "BertForQuestionAnswering": "AutoModelForQuestionAnswering",
        "GPT2ForSequenceClassification": "AutoModelForSequenceClassification"}
PAD = 0


def _hf(name):
    torch.manual_seed(0)
    if name.startswith("GPT2"):
        cfg = transformers.GPT2Config(**GPT2, id2label=LABELS, pad_token_id=PAD, attn_implementation="eager")
    else:
        labels = {0: "start", 1: "end"} if name == "BertForQuestionAnswering" else LABELS
        cfg = transformers.BertConfig(**BERT, id2label=labels, attn_implementation="eager")
    model = getattr(transformers, name)(cfg).eval()
    with torch.no_grad():  # non-trivial biases and norms, so a misplaced tensor shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 99, (3, 11), generator=g)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 7:] = 0  # right padding (GPT-2 reads the last non-pad token)
    mask[2, 4:] = 0
    ids[mask == 0] = PAD
    return ids, mask


@pytest.mark.parametrize("name", BERT_HEADS + ["GPT2ForSequenceClassification"])
def test_head_loads_transformers_and_saves_back(name, tmp_path):
    hf = _hf(name)
    ours, back = check_round_trip(hf, getattr(transformers, AUTO[name]), *_inputs(), tmp_path)
    assert back.config.id2label == hf.config.id2label
    assert back.config.label2id == {v: k for k, v in hf.config.id2label.items()}
    again = attnlab.from_pretrained(tmp_path / "ours")
    assert again.config.id2label == ours.config.id2label


@pytest.mark.parametrize("name", ["BertForSequenceClassification", "GPT2ForSequenceClassification"])
@pytest.mark.parametrize("kind", ["single", "regression", "multi"])
def test_sequence_classification_loss_equals_transformers(name, kind, tmp_path):
    hf = _hf(name)
    n = 3
    if kind == "regression":
        hf.config.id2label, hf.config.label2id = {0: "score"}, {"score": 0}
        hf = getattr(transformers, name)(hf.config).eval()
        n = 1
    hf.save_pretrained(tmp_path)
    ours = attnlab.from_pretrained(tmp_path)
    ids, mask = _inputs()
    labels = {"single": torch.tensor([2, 0, 1]), "regression": torch.tensor([0.5, -1.0, 2.0]),
              "multi": torch.tensor([[1.0, 0, 1], [0, 0, 1], [1, 1, 0]])}[kind]
    with torch.no_grad():
        a = ours(ids, attention_mask=mask, labels=labels).loss
        b = hf(ids, attention_mask=mask, labels=labels).loss
    assert ours.config.num_labels == n
    assert abs(float(a) - float(b)) <= tolerance(b, n=32, depth=2)


def test_token_classification_and_qa_losses_equal_transformers(tmp_path):
    ids, mask = _inputs()
    tok = _hf("BertForTokenClassification")
    tok.save_pretrained(tmp_path / "tok")
    labels = torch.randint(0, 3, ids.shape, generator=torch.Generator().manual_seed(2))
    labels[mask == 0] = -100
    with torch.no_grad():
        a = attnlab.from_pretrained(tmp_path / "tok")(ids, attention_mask=mask, labels=labels).loss
        b = tok(ids, attention_mask=mask, labels=labels).loss
    assert abs(float(a) - float(b)) <= tolerance(b, n=32, depth=2)
    qa = _hf("BertForQuestionAnswering")
    qa.save_pretrained(tmp_path / "qa")
    start, end = torch.tensor([1, 3, 20]), torch.tensor([4, 5, 2])  # 20 > L: clamped and ignored, as HF
    with torch.no_grad():
        a = attnlab.from_pretrained(tmp_path / "qa")(ids, attention_mask=mask, start_positions=start,
                                                     end_positions=end).loss
        b = qa(ids, attention_mask=mask, start_positions=start, end_positions=end).loss
    assert abs(float(a) - float(b)) <= tolerance(b, n=32, depth=2)


def test_labels_and_problem_type_round_trip(tmp_path):
    base = BertConfig(**BERT)
    cfg = ClassifierConfig(base, id2label={0: "de", 1: "en"}, problem_type="single_label_classification",
                           classifier_dropout=0.2)
    BertForSequenceClassification(cfg).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["id2label"] == {"0": "de", "1": "en"} and raw["label2id"] == {"de": 0, "en": 1}
    assert raw["architectures"] == ["BertForSequenceClassification"]
    hf_cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    assert hf_cfg.num_labels == 2 and hf_cfg.id2label == {0: "de", 1: "en"}
    assert hf_cfg.problem_type == "single_label_classification" and hf_cfg.classifier_dropout == 0.2
    back = attnlab.from_pretrained(tmp_path)
    assert (back.config.num_labels, back.config.id2label, back.config.label2id) == (2, {0: "de", 1: "en"},
                                                                                   {"de": 0, "en": 1})
    assert back.config.problem_type == "single_label_classification" and back.config.classifier_dropout == 0.2
    assert back.config.hidden_size == 32  # the family's fields read through


def test_base_checkpoint_gets_a_fresh_head_with_one_warning(tmp_path):
    torch.manual_seed(0)
    enc = BertModel(BertConfig(**BERT)).eval()
    enc.save_pretrained(tmp_path / "bert")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        clf = BertForSequenceClassification.from_pretrained(tmp_path / "bert")
    assert [str(w.message) for w in caught if "classifier" in str(w.message)]
    ids, mask = _inputs()
    with torch.no_grad():
        _close(clf.bert(ids, mask).pooler_output, enc(ids, mask).pooler_output)
    torch.manual_seed(0)
    lm = GPT2LMHeadModel(GPT2Config(**GPT2)).eval()
    lm.save_pretrained(tmp_path / "gpt2")
    with pytest.warns(UserWarning, match="score.weight"):
        GPT2ForSequenceClassification.from_pretrained(tmp_path / "gpt2")


@pytest.mark.parametrize("labels, match", [
    (torch.tensor([0, 1]), r"labels must have shape \(3,\)"),
    (torch.tensor([0, 1, 3]), r"labels must lie in \[0, num_labels=3\)"),
    (torch.zeros(3, 2), r"multi-label classification must have shape \(B, num_labels\) = \(3, 3\)"),
    ([0, 1, 2], "labels must be a tensor"),
])
def test_bad_labels_are_refused_by_name(labels, match):
    model = BertForSequenceClassification(ClassifierConfig(BertConfig(**BERT), num_labels=3)).eval()
    ids, mask = _inputs()
    with pytest.raises(ValueError, match=match):
        model(ids, attention_mask=mask, labels=labels)


def test_bad_configs_and_batches_are_refused():
    with pytest.raises(ValueError, match="num_labels=3 but id2label has 2"):
        ClassifierConfig(BertConfig(**BERT), num_labels=3, id2label={0: "a", 1: "b"})
    with pytest.raises(ValueError, match="problem_type"):
        ClassifierConfig(BertConfig(**BERT), problem_type="ranking")
    with pytest.raises(TypeError, match="ClassifierConfig of a BertConfig"):
        BertForTokenClassification(BertConfig(**BERT))
    with pytest.raises(ValueError, match="num_labels=2"):
        BertForQuestionAnswering(ClassifierConfig(BertConfig(**BERT), num_labels=3))
    model = GPT2ForSequenceClassification(ClassifierConfig(GPT2Config(**GPT2))).eval()
    ids, _ = _inputs()
    with pytest.raises(ValueError, match="pad_token_id to classify a batch of 3"):
        model(ids)
    assert model(ids[:1]).logits.shape == (1, 2)  # one sequence: its last token
    tok = BertForTokenClassification(ClassifierConfig(BertConfig(**BERT))).eval()
    with pytest.raises(ValueError, match=r"labels must have shape \(3, 11\)"):
        tok(ids, labels=torch.zeros(3, dtype=torch.long))
    qa = BertForQuestionAnswering(ClassifierConfig(BertConfig(**BERT))).eval()
    with pytest.raises(ValueError, match="both start_positions and end_positions"):
        qa(ids, start_positions=torch.zeros(3, dtype=torch.long))


def test_classifier_from_pretrained_keeps_the_body_and_sizes_the_head(tmp_path):
    from attnlab.models.heads import classifier_from_pretrained

    torch.manual_seed(0)
    lm = GPT2LMHeadModel(GPT2Config(**GPT2)).eval()
    lm.save_pretrained(tmp_path / "gpt2")
    with pytest.warns(UserWarning, match="score.weight"):
        clf = classifier_from_pretrained(tmp_path / "gpt2", {0: "a", 1: "b", 2: "c"}).eval()
    assert clf.config.pad_token_id == GPT2["eos_token_id"] and clf.score.weight.shape == (3, 32)
    assert torch.equal(clf.wte.weight, lm.wte.weight) and torch.equal(clf.layers[1].ffn.w2.weight,
                                                                      lm.layers[1].ffn.w2.weight)
    hf = _hf("BertForSequenceClassification")  # a 3-label head: kept for 3 labels, replaced for 2
    hf.save_pretrained(tmp_path / "bert")
    same = classifier_from_pretrained(tmp_path / "bert", {0: "x", 1: "y", 2: "z"})
    assert torch.equal(same.classifier.weight, hf.classifier.weight) and same.config.id2label[2] == "z"
    with pytest.warns(UserWarning, match="classifier.weight"):
        two = classifier_from_pretrained(tmp_path / "bert", {0: "x", 1: "y"})
    assert two.classifier.weight.shape == (2, 32)
    assert torch.equal(two.bert.pooler.weight, hf.bert.pooler.dense.weight)
    from safetensors.torch import load_file, save_file
    sd = load_file(tmp_path / "bert" / "model.safetensors")
    sd["bert.pooler.dense.weight"] = sd["bert.pooler.dense.weight"].view(torch.int32)  # the same bytes, declared I32
    save_file(sd, tmp_path / "bert" / "model.safetensors")
    with pytest.raises(ValueError, match=r"'bert.pooler.dense.weight' .*stored as torch.int32.*torch.float32"):
        classifier_from_pretrained(tmp_path / "bert", {0: "x", 1: "y", 2: "z"})


def test_gpt2_left_padding_gives_the_unpadded_logits(tmp_path):
    # positions follow the mask (p = cumsum(mask) - 1), so padding on the left changes nothing; transformers'
    # GPT-2 forward agrees for right padding (tested above) and needs position_ids for left padding
    hf = _hf("GPT2ForSequenceClassification")
    hf.save_pretrained(tmp_path)
    ours = attnlab.from_pretrained(tmp_path)
    ids, _ = _inputs()
    row = ids[:1, :7]
    left = torch.cat([torch.full((1, 4), PAD), row], dim=1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 7, dtype=torch.long)], dim=1)
    with torch.no_grad():
        alone = ours(row).logits
        padded = ours(torch.cat([left, ids[:1]]), attention_mask=torch.cat([mask, torch.ones_like(mask)])).logits
        expected = hf(row).logits
    _close(alone, expected)
    assert (padded[:1] - alone).abs().max() <= tolerance(alone, n=32, depth=2)
