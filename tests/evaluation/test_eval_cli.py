"""`attnlab eval`: text files scored with sacreBLEU / rouge-score, JSON output, one-line errors, and the
hand-off of `--checkpoint` to the training package's evaluate_checkpoint."""
import json
import sys
import types

import pytest
import sacrebleu

from attnlab.cli import main

HYPS = ["A man in an orange hat looks at something.", "Two young men are outside near bushes.", "Ein Hund rennt."]
REFS = ["A man in an orange hat starring at something.", "Two young, White males are outside near bushes.",
        "Ein Hund läuft."]


@pytest.fixture
def files(tmp_path):
    hyp, ref = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    hyp.write_text("\n".join(HYPS) + "\n", encoding="utf-8")
    ref.write_text("\n".join(REFS) + "\n", encoding="utf-8")
    return hyp, ref


def test_text_mode_table_and_json(files, tmp_path, capsys):
    hyp, ref = files
    out = tmp_path / "scores.json"
    assert main(["eval", "--hyp", str(hyp), "--ref", str(ref), "--metrics", "bleu,chrf,rouge", "--out", str(out)]) == 0
    scores = json.loads(out.read_text())
    assert scores["segments"] == 3
    assert scores["bleu"] == pytest.approx(sacrebleu.corpus_bleu(HYPS, [REFS]).score, abs=1e-9)
    assert scores["chrf"] == pytest.approx(sacrebleu.corpus_chrf(HYPS, [REFS]).score, abs=1e-9)
    assert scores["bleu_signature"].startswith("nrefs:1|case:mixed") and 0 < scores["rougeL"] <= 1
    printed = capsys.readouterr().out
    assert f"{scores['bleu']:.4f}" in printed and "bleu_signature: nrefs:1" in printed


def test_two_references_and_default_metrics(files, tmp_path, capsys):
    hyp, ref = files
    ref2 = tmp_path / "ref2.txt"
    ref2.write_text("\n".join(HYPS) + "\n", encoding="utf-8")
    assert main(["eval", "--hyp", str(hyp), "--ref", str(ref), "--ref", str(ref2)]) == 0
    printed = capsys.readouterr().out
    assert "100.0000" in printed and "nrefs:2" in printed and "rouge1" not in printed


def test_byte_order_mark_is_not_text(files, tmp_path):
    hyp, ref = files
    marked, out = tmp_path / "marked.txt", tmp_path / "scores.json"
    marked.write_bytes(b"\xef\xbb\xbf" + ref.read_bytes())  # the same text, saved with a byte-order mark
    assert main(["eval", "--hyp", str(marked), "--ref", str(ref), "--out", str(out)]) == 0
    scores = json.loads(out.read_text())
    assert scores["chrf"] == sacrebleu.corpus_chrf(REFS, [REFS]).score == 100.0
    assert scores["bleu"] == sacrebleu.corpus_bleu(REFS, [REFS]).score


def test_segments_split_at_new_lines_only(tmp_path):
    """A form feed, \\x85, U+2028 or a lone carriage return inside a segment keep it whole, as in sacreBLEU."""
    hyps = ["page one\x0cpage two", "a\x85b c", "line\u2028separator", "carriage\rreturn", "plain end"]
    refs = ["page one page two", "a b c", "line separator", "carriage return", "plain end"]
    hyp, ref, out = tmp_path / "hyp.txt", tmp_path / "ref.txt", tmp_path / "scores.json"
    hyp.write_text("\n".join(hyps) + "\r\n", encoding="utf-8", newline="")
    ref.write_text("\n".join(refs) + "\n", encoding="utf-8", newline="")
    assert main(["eval", "--hyp", str(hyp), "--ref", str(ref), "--out", str(out)]) == 0
    scores = json.loads(out.read_text())
    assert scores["segments"] == 5
    assert scores["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score, abs=1e-9)
    assert scores["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score, abs=1e-9)


@pytest.mark.parametrize("argv_tail, message", [
    (["--metrics", "bleu,meteor"], "unknown metric 'meteor'; valid: bleu, chrf, rouge"),
    (["--tokenize", "nope"], "--tokenize must be one of"),
    (["--split", "val"], "--split applies to --checkpoint only"),
])
def test_text_mode_errors_are_one_line(files, capsys, argv_tail, message):
    hyp, ref = files
    assert main(["eval", "--hyp", str(hyp), "--ref", str(ref), *argv_tail]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_missing_and_misaligned_files(files, tmp_path, capsys):
    hyp, ref = files
    assert main(["eval", "--hyp", str(hyp), "--ref", str(tmp_path / "nope.txt")]) == 2
    assert "--ref: no such file" in capsys.readouterr().err
    short = tmp_path / "short.txt"
    short.write_text("one line\n", encoding="utf-8")
    assert main(["eval", "--hyp", str(hyp), "--ref", str(short)]) == 2
    assert "has 3 lines but --ref" in capsys.readouterr().err
    assert main(["eval", "--hyp", str(hyp)]) == 2
    assert "give --hyp FILE and --ref FILE" in capsys.readouterr().err


def test_checkpoint_is_handed_to_the_training_package(tmp_path, monkeypatch, capsys):
    """The dispatch contract only: a stand-in evaluate_checkpoint records what the CLI passes (the real one is
    the training package's, tested with its recipes)."""
    calls = []

    def evaluate_checkpoint(path, *, split=None, metrics=None):
        calls.append((path, split, metrics))
        return {"val_loss": 1.5, "perplexity": 4.4817, "accuracy": 0.42}

    fake = types.ModuleType("attnlab.training.recipes")
    fake.evaluate_checkpoint = evaluate_checkpoint
    monkeypatch.setitem(sys.modules, "attnlab.training.recipes", fake)
    run, out = tmp_path / "run", tmp_path / "m.json"  # the scores beside the run, never inside it
    run.mkdir()
    assert main(["eval", "--checkpoint", str(run), "--split", "val", "--metrics", "ppl,acc",
                 "--out", str(out)]) == 0
    assert calls == [(run, "val", ["ppl", "acc"])]
    assert json.loads(out.read_text())["accuracy"] == 0.42 and "perplexity" in capsys.readouterr().out
    # an option the recipe's evaluation does not take is refused by name
    assert main(["eval", "--checkpoint", str(run), "--max-batches", "3"]) == 2
    assert "--max-batches is not supported" in capsys.readouterr().err


def test_checkpoint_without_training_package(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "attnlab.training.recipes", types.ModuleType("attnlab.training.recipes"))
    assert main(["eval", "--checkpoint", str(tmp_path)]) == 2
    assert "needs attnlab.training.recipes.evaluate_checkpoint" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(tmp_path / "missing"), "--hyp", "x"]) == 2
    assert "either --checkpoint or --hyp/--ref" in capsys.readouterr().err
