"""GPT-2 and Llama task heads against transformers' classes (random tiny configs, no download), both directions.

Oracle: ``transformers`` (eager attention), eval mode, float32. Tolerance: 1e-4 on logits, as the other
families; losses to the float32 tolerance of ``tests/_tolerance.py``.
"""
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnlab  # noqa: E402
from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel  # noqa: E402
from attnlab.models.heads import (ClassifierConfig, LlamaForSequenceClassification,  # noqa: E402
                                  LlamaForTokenClassification, classifier_from_pretrained)
from attnlab.models.llama import LlamaConfig, LlamaForCausalLM  # noqa: E402
from tests._heads import check_round_trip, check_sequence_loss, close as _close  # noqa: E402
from tests._tolerance import tolerance  # noqa: E402

GPT2 = dict(vocab_size=99, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=1)
LLAMA = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
LABELS = {0: "neg", 1: "neu", 2: "pos"}
PAD = 0
HEADS = ["GPT2ForTokenClassification", "GPT2ForQuestionAnswering", "LlamaForSequenceClassification",
         "LlamaForTokenClassification", "LlamaForQuestionAnswering"]
AUTO = {"SequenceClassification": "AutoModelForSequenceClassification",
        "TokenClassification": "AutoModelForTokenClassification",
        "QuestionAnswering": "AutoModelForQuestionAnswering"}


def _auto(name):
    return getattr(transformers, AUTO[name.split("For")[1]])


def _hf(name, **extra):
    torch.manual_seed(0)
    if name.startswith("GPT2"):
        cfg = transformers.GPT2Config(**GPT2, id2label=LABELS, pad_token_id=PAD, attn_implementation="eager", **extra)
    else:
        cfg = transformers.LlamaConfig(**LLAMA, id2label=LABELS, pad_token_id=PAD, attn_implementation="eager",
                                       **extra)
    model = getattr(transformers, name)(cfg).eval()
    with torch.no_grad():  # non-trivial biases and norms, so a misplaced tensor shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _inputs(left=False):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 99, (3, 11), generator=g)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 7:] = 0  # right padding: the sequence heads read the last non-pad token
    mask[2, 4:] = 0
    if left:
        mask = mask.flip(-1)
    ids[mask == 0] = PAD
    return ids, mask


def _call(model, ids, mask, **kw):
    """``model(ids, attention_mask=mask, **kw)``; transformers' GPT-2 gets our positions, ``cumsum(mask) - 1``
    (its plain forward counts padding too: real tokens agree for right padding, padded positions do not)."""
    if isinstance(model, transformers.PreTrainedModel) and model.config.model_type == "gpt2" and mask is not None:
        kw["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    return model(ids, attention_mask=mask, **kw)


@pytest.mark.parametrize("name", HEADS)
def test_head_loads_transformers_and_saves_back(name, tmp_path):
    hf = _hf(name)
    ours, back = check_round_trip(hf, _auto(name), *_inputs(), tmp_path, call=_call)
    assert back.config.id2label == hf.config.id2label and back.config.pad_token_id == PAD
    again = attnlab.from_pretrained(tmp_path / "ours")
    assert again.config.id2label == ours.config.id2label and again.config.pad_token_id == PAD


@pytest.mark.parametrize("left", [False, True], ids=["right-padded", "left-padded"])
def test_llama_sequence_classification_reads_the_last_non_pad_token(left, tmp_path):
    hf = _hf("LlamaForSequenceClassification")
    hf.save_pretrained(tmp_path)
    ours = attnlab.from_pretrained(tmp_path)
    ids, mask = _inputs(left=left)
    with torch.no_grad():
        _close(ours(ids, attention_mask=mask).logits, hf(ids, attention_mask=mask).logits)
        alone = ours(ids[2:, :4] if not left else ids[2:, -4:]).logits  # the third row without its padding
        _close(ours(ids, attention_mask=mask).logits[2:], alone)


@pytest.mark.parametrize("kind", ["single", "regression", "multi"])
def test_llama_sequence_classification_loss_equals_transformers(kind, tmp_path):
    ids, mask = _inputs()
    check_sequence_loss(_hf("LlamaForSequenceClassification"), kind, ids, mask, tmp_path, depth=2)


@pytest.mark.parametrize("name", [h for h in HEADS if not h.endswith("SequenceClassification")])
def test_token_and_span_losses_equal_transformers(name, tmp_path):
    hf = _hf(name)
    hf.save_pretrained(tmp_path)
    ours = attnlab.from_pretrained(tmp_path)
    ids, mask = _inputs()
    if name.endswith("TokenClassification"):
        labels = torch.randint(0, 3, ids.shape, generator=torch.Generator().manual_seed(2))
        labels[mask == 0] = -100
        kw = dict(labels=labels)
    else:
        kw = dict(start_positions=torch.tensor([1, 3, 20]), end_positions=torch.tensor([4, 5, 2]))  # 20: ignored
    with torch.no_grad():
        a = ours(ids, attention_mask=mask, **kw).loss
        b = _call(hf, ids, mask, **kw).loss
    assert abs(float(a) - float(b)) <= tolerance(b, n=32, depth=2)


@pytest.mark.parametrize("name", HEADS)
def test_lm_checkpoint_gets_a_fresh_head_with_one_warning(name, tmp_path):
    torch.manual_seed(0)
    lm = GPT2LMHeadModel(GPT2Config(**GPT2)) if name.startswith("GPT2") else LlamaForCausalLM(LlamaConfig(**LLAMA))
    lm.eval().save_pretrained(tmp_path)
    cls = getattr(attnlab.models.heads, name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = cls.from_pretrained(tmp_path)
    lines = [str(w.message) for w in caught if "freshly initialised" in str(w.message)]
    assert len(lines) == 1 and model.head_name + ".weight" in lines[0] and "\n" not in lines[0]
    emb = "wte" if name.startswith("GPT2") else "embed_tokens"
    assert torch.equal(getattr(model, emb).weight, getattr(lm, emb).weight)
    assert torch.equal(model.layers[1].ffn.w2.weight, lm.layers[1].ffn.w2.weight)
    head = getattr(model, model.head_name)
    assert head.weight.shape == (2, 32)  # QA: start, end; classifiers: the default num_labels, 2
    assert head.bias is None or not head.bias.any()  # a fresh head: zero bias
    assert 0.01 < float(head.weight.std()) < 0.04  # N(0, 0.02), transformers' initializer_range


def test_llama_qa_checkpoint_loads_into_a_sequence_classifier(tmp_path):
    # LlamaForQuestionAnswering keeps its body under "transformer.": another head's body must still load
    qa = _hf("LlamaForQuestionAnswering")
    qa.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="score.weight"):
        clf = classifier_from_pretrained(tmp_path, {0: "a", 1: "b"})
    assert isinstance(clf, LlamaForSequenceClassification) and clf.score.weight.shape == (2, 32)
    assert torch.equal(clf.embed_tokens.weight, qa.transformer.embed_tokens.weight)
    assert clf.lm_head is None and not any(k.startswith("lm_head") for k in clf.state_dict())


def test_bad_configs_and_batches_are_refused():
    with pytest.raises(TypeError, match="LlamaForTokenClassification needs a ClassifierConfig of a LlamaConfig"):
        LlamaForTokenClassification(LlamaConfig(**LLAMA))
    with pytest.raises(TypeError, match="needs a ClassifierConfig of a LlamaConfig, got ClassifierConfig of a GPT2"):
        LlamaForSequenceClassification(ClassifierConfig(GPT2Config(**GPT2)))
    model = LlamaForSequenceClassification(ClassifierConfig(LlamaConfig(**LLAMA))).eval()  # no pad_token_id
    ids, _ = _inputs()
    with pytest.raises(ValueError, match="pad_token_id to classify a batch of 3"):
        model(ids)
    assert model(ids[:1]).logits.shape == (1, 2)
    tok = LlamaForTokenClassification(ClassifierConfig(LlamaConfig(**LLAMA, pad_token_id=PAD))).eval()
    assert tok.config.pad_token_id == PAD  # the family config's padding id is the head's
    with pytest.raises(ValueError, match=r"labels must have shape \(3, 11\)"):
        tok(ids, labels=torch.zeros(3, dtype=torch.long))
