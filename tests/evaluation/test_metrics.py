"""Metrics against their libraries (sacreBLEU, rouge-score), hand-computed values and direct formulas."""
import math

import pytest
import sacrebleu
import torch
from rouge_score import rouge_scorer

from attnlab.evaluation.metrics import (accuracy, bleu, calibration_bins, chrf, expected_calibration_error,
                                        perplexity, reliability_diagram, rouge)

HYPS = ["A man in an orange hat looks at something.", "Two young men are outside near bushes.",
        "A girl climbs into a wooden playhouse!", "Ein Hund rennt."]
REFS = ["A man in an orange hat starring at something.", "Two young, White males are outside near many bushes.",
        "A little girl climbing into a wooden playhouse.", "Ein Hund läuft."]
REFS2 = ["A man wearing an orange hat stares at something.", "Two young men are outdoors near many bushes.",
         "A little girl climbs into a playhouse made of wood.", "Ein Hund rennt schnell."]


def test_bleu_equals_sacrebleu_directly():
    score, sig = bleu(HYPS, REFS)
    assert score == pytest.approx(sacrebleu.corpus_bleu(HYPS, [REFS]).score, abs=1e-12)
    assert sig.startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp")
    multi, sig2 = bleu(HYPS, [[a, b] for a, b in zip(REFS, REFS2)])  # two references per hypothesis
    assert multi == pytest.approx(sacrebleu.corpus_bleu(HYPS, [REFS, REFS2]).score, abs=1e-12)
    assert "nrefs:2" in sig2 and multi > score
    assert bleu(HYPS, REFS, lowercase=True).signature.find("case:lc") >= 0


def test_bleu_by_hand():
    # hyp "the cat sat on the mat", ref "the cat sat on a mat": clipped n-gram matches 5/6, 3/5, 2/4, 1/3
    # and equal lengths (BP = 1): BLEU = 100 · (5/6 · 3/5 · 2/4 · 1/3)^(1/4)
    assert bleu(["the cat sat on the mat"], ["the cat sat on a mat"]).score == pytest.approx(
        100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25, abs=1e-9)
    # a correct but short hypothesis (c = 5, r = 6): all precisions 1, BP = exp(1 - 6/5)
    assert bleu(["the cat sat on the"], ["the cat sat on the mat"]).score == pytest.approx(
        100 * math.exp(1 - 6 / 5), abs=1e-9)
    assert bleu(["identical sentence here ."], ["identical sentence here ."]).score == pytest.approx(100.0)


def test_chrf_equals_sacrebleu():
    score, sig = chrf(HYPS, REFS)
    assert score == pytest.approx(sacrebleu.corpus_chrf(HYPS, [REFS]).score, abs=1e-12)
    assert sig.startswith("nrefs:1|case:mixed") and "nw:0" in sig
    plus = chrf(HYPS, REFS, word_order=2)
    assert plus.score == pytest.approx(sacrebleu.corpus_chrf(HYPS, [REFS], word_order=2).score, abs=1e-12)


def test_rouge_equals_rouge_score_and_by_hand():
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"])
    got = rouge(HYPS, REFS)
    for name in ("rouge1", "rouge2", "rougeL"):
        want = sum(scorer.score(r, h)[name].fmeasure for h, r in zip(HYPS, REFS)) / len(HYPS)
        assert got[name] == pytest.approx(want, abs=1e-12)
    # "the cat sat" vs "the cat sat on a mat": unigram P = 1, R = 1/2 -> F1 = 2/3; bigrams P = 1, R = 2/5 -> 4/7
    tiny = rouge(["the cat sat"], ["the cat sat on a mat"])
    assert tiny["rouge1"] == pytest.approx(2 / 3) and tiny["rouge2"] == pytest.approx(4 / 7)
    assert tiny["rougeL"] == pytest.approx(2 / 3)


def test_text_metric_errors():
    with pytest.raises(ValueError, match="one entry per hypothesis"):
        bleu(HYPS, REFS[:2])
    with pytest.raises(ValueError, match="empty"):
        chrf([], [])
    with pytest.raises(TypeError, match="hyps"):
        bleu("a string", ["a string"])
    with pytest.raises(ValueError, match="same number of references"):
        rouge(HYPS[:2], [["a"], ["b", "c"]])


def test_perplexity_and_accuracy():
    assert perplexity(0.0) == 1.0 and perplexity(torch.tensor(math.log(65))) == pytest.approx(65)
    assert perplexity(1e4) == math.inf
    with pytest.raises(ValueError, match="non-negative"):
        perplexity(float("nan"))
    logits = torch.tensor([[[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]], [[0.0, 0.0, 5.0], [1.0, 0.0, 0.0]]])  # (2, 2, 3)
    targets = torch.tensor([[0, 2], [2, -100]])
    assert accuracy(logits, targets) == pytest.approx(2 / 3)  # the ignored position is not scored
    assert accuracy(logits, targets.clamp(min=0), ignore_index=None) == pytest.approx(3 / 4)
    with pytest.raises(ValueError, match="disagree"):
        accuracy(logits, targets[0])
    with pytest.raises(ValueError, match="no target"):
        accuracy(logits, torch.full((2, 2), -100))


def _ece_loop(probs, targets, n_bins):
    """The definition, one bin at a time, in plain Python."""
    n, total = len(targets), 0.0
    for b in range(n_bins):
        lo, hi = b / n_bins, (b + 1) / n_bins
        rows = [i for i in range(n) if lo < max(probs[i]) <= hi or (b == 0 and max(probs[i]) == 0)]
        if rows:
            acc = sum(probs[i].index(max(probs[i])) == targets[i] for i in rows) / len(rows)
            conf = sum(max(probs[i]) for i in rows) / len(rows)
            total += len(rows) / n * abs(acc - conf)
    return total


def test_ece_by_hand():
    # 5 bins. conf 0.9 ✓, 0.85 ✗ -> bin (0.8, 1]: acc 0.5, conf 0.875; conf 0.7 ✗, 0.65 ✓ -> (0.6, 0.8]:
    # acc 0.5, conf 0.675; conf 0.55 ✓ -> (0.4, 0.6]: acc 1, conf 0.55.
    # ECE = 2/5 · 0.375 + 2/5 · 0.175 + 1/5 · 0.45 = 0.31
    probs = torch.tensor([[0.9, 0.1], [0.85, 0.15], [0.7, 0.3], [0.35, 0.65], [0.55, 0.45]], dtype=torch.float64)
    targets = torch.tensor([0, 1, 1, 1, 0])
    assert expected_calibration_error(probs, targets, n_bins=5) == pytest.approx(0.31, abs=1e-12)
    bins = calibration_bins(probs, targets, n_bins=5)
    assert bins["count"] == [0, 0, 1, 2, 2] and bins["accuracy"][2:] == pytest.approx([1.0, 0.5, 0.5])
    # logits give the same answer as their softmax
    assert expected_calibration_error(probs.log() + 3.0, targets, n_bins=5) == pytest.approx(0.31, abs=1e-12)


def test_ece_matches_the_definition_on_random_data():
    logits = torch.randn(300, 7) * 2
    targets = torch.randint(0, 7, (300,))
    probs = torch.softmax(logits.double(), -1)
    want = _ece_loop(probs.tolist(), targets.tolist(), 15)
    assert expected_calibration_error(logits, targets) == pytest.approx(want, abs=1e-12)


def test_perfect_calibration_is_zero():
    # 10 predictions at confidence 0.7 of which exactly 7 are right; 4 at confidence 1.0, all right
    probs = torch.tensor([[0.7, 0.3]] * 10 + [[1.0, 0.0]] * 4, dtype=torch.float64)
    targets = torch.tensor([0] * 7 + [1] * 3 + [0] * 4)
    assert expected_calibration_error(probs, targets) == pytest.approx(0.0, abs=1e-12)
    # binary (N,) P(class 1): 0.2 -> predicts 0 with confidence 0.8; 4 of 5 right
    p1 = torch.full((5,), 0.2, dtype=torch.float64)
    assert expected_calibration_error(p1, torch.tensor([0, 0, 0, 0, 1])) == pytest.approx(0.0, abs=1e-12)


def test_ece_ignore_index_and_errors():
    probs = torch.tensor([[0.9, 0.1], [float("nan"), 0.5]])
    assert expected_calibration_error(probs, torch.tensor([0, -100]), ignore_index=-100) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="NaN"):
        expected_calibration_error(probs, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="n_bins"):
        expected_calibration_error(probs[:1], torch.tensor([0]), n_bins=0)
    with pytest.raises(ValueError, match="integer targets"):
        expected_calibration_error(probs[:1], torch.tensor([0.0]))


def test_reliability_diagram_png(tmp_path):
    logits, targets = torch.randn(200, 5) * 3, torch.randint(0, 5, (200,))
    path = tmp_path / "calib.png"
    ece = reliability_diagram(logits, targets, path, n_bins=10)
    assert ece == pytest.approx(expected_calibration_error(logits, targets, n_bins=10))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert [p.name for p in tmp_path.iterdir()] == ["calib.png"]  # no temp file left
