"""The ``multi30k-de-en`` recipe: builds, learns, writes BLEU/chrF, resumes exactly, scores checkpoints.

Oracles: decoding against a plain loop of full teacher-forced forwards (no cache, no batching), the
loss against ``F.cross_entropy``, scores against ``sacrebleu`` called directly, checkpoint averaging
against the mean of the state dicts. Runs use the ``tiny`` preset (fp32, 1 thread: resume is exact).
"""
import json
import shutil

import pytest
import sacrebleu
import torch
import torch.nn.functional as F

from attnlab.cli import main
from attnlab.data.datasets import DataUnavailableError, load_parallel
from attnlab.data.tokenizers import TextTokenizer, train_bpe
from attnlab.training.checkpoint import list_checkpoints, load_checkpoint
from attnlab.training.recipes import evaluate_checkpoint, get_recipe, resolve_settings, run_recipe
from attnlab.training.recipes.multi30k import (PairBatches, average_checkpoints, make_model, score_translation,
                                               seq2seq_loss, translate)

RECIPE = "multi30k-de-en"


@pytest.fixture(scope="module")
def pairs():
    try:
        return load_parallel("train")[:300]
    except DataUnavailableError as e:  # offline and no local copy: nothing to translate
        pytest.skip(f"Multi30k unavailable: {e}")


@pytest.fixture(scope="module")
def tiny_run(pairs, tmp_path_factory):
    out = tmp_path_factory.mktemp("m30k") / "run"
    return out, run_recipe(RECIPE, out=out, preset="tiny", overrides={"progress": False})


@pytest.fixture(scope="module")
def small(pairs):
    """A tiny untrained model (fp32, eval mode) and a joint BPE of 300 ids."""
    tok = train_bpe([t for p in pairs for t in p], vocab_size=300)
    settings = resolve_settings(get_recipe(RECIPE), preset="tiny")
    torch.manual_seed(0)
    return make_model(settings, vocab_size=tok.vocab_size, pad_id=tok.pad_id).eval(), tok, settings


def test_build_shares_one_embedding_matrix(small):
    model, tok, _ = small
    assert model.src_embed is model.tgt_embed
    assert model.out_proj.weight.data_ptr() == model.tgt_embed.weight.data_ptr()
    assert model.tgt_embed.weight.shape == (tok.vocab_size, 32)
    assert tok.decode(tok.encode("Zwei Männer, ein Hund.")) == "Zwei Männer, ein Hund."  # lossless detokenisation


def test_loss_is_label_smoothed_cross_entropy_over_non_pad_targets(small):
    model = small[0]
    src = torch.tensor([[1, 50, 60, 2], [1, 70, 2, 0]])
    tgt = torch.tensor([[1, 80, 90, 2], [1, 99, 2, 0]])
    loss, n = seq2seq_loss(model, (src, tgt), pad_id=0, label_smoothing=0.1)
    logits = model(src, tgt[:, :-1])
    keep = tgt[:, 1:] != 0
    want = F.cross_entropy(logits[keep], tgt[:, 1:][keep], label_smoothing=0.1)
    assert n == 5 and loss.item() == pytest.approx(want.item(), rel=1e-6)


def _oracle_greedy(model, tok, sentence, max_new):
    """Greedy decoding by full forwards of the growing prefix: no cache, no padding, no batching."""
    src = torch.tensor([tok.encode(sentence, add_special_tokens=True)])
    ys = [tok.bos_id]
    for _ in range(max_new):
        nxt = int(model(src, torch.tensor([ys]))[0, -1].argmax())
        if nxt == tok.eos_id:
            break
        ys.append(nxt)
    return tok.decode(ys[1:]).strip()


def test_translate_greedy_matches_a_cacheless_loop(small, pairs):
    model, tok, _ = small
    sents = [p[0] for p in pairs[:4]]
    longest = max(len(tok.encode(s, add_special_tokens=True)) for s in sents)
    one_batch = translate(model, tok, sents, batch_size=len(sents))  # padded to the longest source
    assert one_batch == [_oracle_greedy(model, tok, s, int(1.5 * longest) + 10) for s in sents]
    singles = translate(model, tok, sents, batch_size=1)
    assert singles == [_oracle_greedy(model, tok, s, int(1.5 * len(tok.encode(s, add_special_tokens=True))) + 10)
                       for s in sents]


def test_average_checkpoints_is_the_mean_of_the_state_dicts(small, tmp_path):
    model, _, _ = small
    states = []
    for k in range(2):
        other = {name: t + k + 1 if t.is_floating_point() else t for name, t in model.state_dict().items()}
        torch.save({"model": other}, tmp_path / f"ckpt-{k:08d}.pt")
        states.append(other)
    avg = average_checkpoints(model, list_checkpoints(tmp_path))
    for name, t in model.state_dict().items():
        assert torch.allclose(avg.state_dict()[name], (t + states[0][name] + states[1][name]) / 3, atol=1e-6)
    assert avg.src_embed is avg.tgt_embed  # the copy keeps the shared matrix shared


def test_pair_batches_respect_the_budget_and_resume():
    src = [[1] + [5] * n + [2] for n in range(1, 40)]
    tgt = [[1] + [6] * (n % 7 + 1) + [2] for n in range(1, 40)]
    it = PairBatches(src, tgt, pad_id=0, max_tokens=64, seed=3)
    for _ in range(10):
        s, t = next(it)
        assert s.numel() <= 64 and t.numel() <= 64 and s.shape[0] == t.shape[0]
    state = it.state_dict()
    ahead = [next(it) for _ in range(3)]
    again = PairBatches(src, tgt, pad_id=0, max_tokens=64, seed=3)
    again.load_state_dict(state)
    assert again.served == 10
    for (s1, t1), (s2, t2) in zip(ahead, (next(again) for _ in range(3))):
        assert torch.equal(s1, s2) and torch.equal(t1, t2)


def test_tiny_run_learns_and_reports_bleu_chrf(tiny_run):
    out = tiny_run[0]
    written = json.loads((out / "metrics.json").read_text())
    for key in ("val_loss", "bleu", "chrf", "val_bleu", "val_chrf", "train_tokens_per_s", "wall_s", "test_loss"):
        assert isinstance(written[key], float), key
    assert written["bleu_signature"].startswith("nrefs:1|case:mixed") and written["averaged_checkpoints"] == 2
    log = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r["loss"] for r in log if r["kind"] == "train"]
    evals = [r for r in log if r["kind"] == "eval"]
    assert train[-1] < train[0] - 0.5  # the loss falls (about 6.2 -> 5.2 in 30 steps)
    assert "val_greedy_bleu" in evals[0] and evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert TextTokenizer.load(out / "tokenizer.json").vocab_size == 400
    hyps = (out / "test_2016_flickr.hyp.en").read_text(encoding="utf-8").splitlines()
    refs = [p[1] for p in load_parallel("test_2016_flickr")[:len(hyps)]]
    assert len(hyps) == 16 and written["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score, abs=1e-9)


def test_resume_after_a_kill_ends_where_an_uninterrupted_run_ends(tiny_run, tmp_path):
    out, metrics = tiny_run
    killed = tmp_path / "killed"
    shutil.copytree(out, killed)
    last = list_checkpoints(killed)[-1]
    assert load_checkpoint(last)["step"] == 30
    last.unlink()  # as if killed after the step-20 checkpoint
    resumed = run_recipe(RECIPE, out=killed, resume=True, overrides={"progress": False})
    assert resumed["steps"] == 30
    for key in ("val_loss", "test_loss", "bleu", "chrf", "train_loss"):  # fp32, 1 thread: bitwise parameters
        assert resumed[key] == pytest.approx(metrics[key], rel=1e-6, abs=1e-9), key


def test_eval_checkpoint_scores_bleu_with_the_recipe(tiny_run, capsys, tmp_path):
    out, _ = tiny_run
    scores_path = tmp_path / "scores.json"
    assert main(["eval", "--checkpoint", str(out), "--split", "val", "--max-batches", "1",
                 "--out", str(scores_path)]) == 0
    scores = json.loads(scores_path.read_text())
    assert scores["recipe"] == RECIPE and scores["step"] == 30 and scores["sentences"] == 16
    assert scores["num_beams"] == 2 and {"bleu", "chrf", "val_loss", "val_ppl"} <= scores.keys()
    # the same checkpoint decoded greedily here and scored by sacrebleu directly
    direct = evaluate_checkpoint(out, split="val", max_batches=1, num_beams=1, metrics=["bleu"])
    settings = resolve_settings(get_recipe(RECIPE), base=json.loads((out / "config.json").read_text())["settings"])
    model = make_model(settings, vocab_size=400, pad_id=0)
    model.load_state_dict(load_checkpoint(list_checkpoints(out)[-1])["model"])
    val = load_parallel("val")[:16]
    hyps = translate(model.eval(), TextTokenizer.load(out / "tokenizer.json"), [p[0] for p in val], batch_size=16)
    assert direct["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [[p[1] for p in val]]).score, abs=1e-9)
    assert "chrf" not in direct and "val_loss" not in direct


def test_bad_settings_and_options_are_clear_errors(small, tiny_run, tmp_path):
    model, tok, settings = small
    recipe = get_recipe(RECIPE)
    with pytest.raises(ValueError, match="max_tokens .* must be >= max_len"):
        resolve_settings(recipe, overrides={"max_tokens": "50", "max_len": "100"})
    with pytest.raises(ValueError, match="keep_checkpoints >= 4"):
        resolve_settings(recipe, overrides={"average_checkpoints": "5", "keep_checkpoints": "2"})
    with pytest.raises(ValueError, match="split must be one of val, test_2016_flickr"):
        score_translation(model, tokenizer=tok, settings=settings, split="train")
    with pytest.raises(ValueError, match="unknown metric 'rouge'"):
        score_translation(model, tokenizer=tok, settings=settings, metrics=["rouge"])
    with pytest.raises(ValueError, match="does not take evaluation option"):
        evaluate_checkpoint(tiny_run[0], reliability_png="x.png")
    folder = tmp_path / "no_tokenizer"
    shutil.copytree(tiny_run[0], folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        evaluate_checkpoint(folder)


def test_generate_translates_with_a_run_folder(tiny_run, capsys):
    """``attnlab generate --model RUN`` on a multi30k-de-en run prints what :func:`translate` gives."""
    from attnlab.cli import main
    from attnlab.data.tokenizers import TextTokenizer
    from attnlab.training.recipes import load_run

    out, _ = tiny_run
    source = "Ein Hund läuft durch den Schnee."
    assert main(["generate", "--model", str(out), "--prompt", source, "--max-new-tokens", "12",
                 "--dtype", "float32"]) == 0
    captured = capsys.readouterr()
    line = captured.out.splitlines()[1]
    model = load_run(out).model
    tok = TextTokenizer.load(out / "tokenizer.json")
    ids = torch.tensor([tok.encode(source, add_special_tokens=True)])
    new = model.generate(ids, decoder_start_token_id=tok.bos_id, eos_token_id=tok.eos_id, max_new_tokens=12)[0, 1:]
    assert line == tok.decode(new.tolist())
    assert "tokens/s" in captured.err and "bandwidth bound" not in captured.err  # encoder-decoder: no bound
