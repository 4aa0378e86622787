"""The ``mlm`` recipe: BERT's 80/10/10 masking, next-segment pairs, a loss equal to transformers', and a
tiny run whose masked-token accuracy rises and loss falls.

Oracles: ``transformers.BertForPreTraining`` given our weights computes the same pre-training loss
(MLM + NSP, float32, eval mode, ≤ 1e-5 relative); masking frequencies against their expected values
on 200k draws (±0.01 absolute).
"""
import json

import pytest
import torch

from attnlab.data.datasets import DataUnavailableError, load_sentences
from attnlab.data.tokenizers import train_wordpiece
from attnlab.models.bert import BertConfig, BertForPreTraining
from attnlab.training.recipes import evaluate_checkpoint, get_recipe, resolve_settings, run_recipe
from attnlab.training.recipes.mlm import MLMBatches, evaluate_mlm, mask_tokens, mlm_loss


@pytest.fixture(scope="module")
def captions():
    try:
        return load_sentences("train", lang="en")[:500]
    except DataUnavailableError as e:  # offline and no local copy: nothing to train on
        pytest.skip(f"Multi30k unavailable: {e}")


@pytest.fixture(scope="module")
def tok(captions):
    return train_wordpiece(captions, vocab_size=400, lowercase=True)


def test_masking_is_80_10_10_over_15_percent_and_spares_special_tokens():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 1000, (400, 500))
    special = torch.zeros_like(ids, dtype=torch.bool)
    special[:, :2] = True  # e.g. [CLS] and padding
    inputs, labels = mask_tokens(ids, special=special, mask_id=4, vocab_size=1000, first_normal=5, mask_prob=0.15,
                                 generator=g)
    chosen = labels != -100
    assert not chosen[special].any() and torch.equal(labels[chosen], ids[chosen])
    assert torch.equal(inputs[~chosen], ids[~chosen])
    assert chosen[:, 2:].float().mean().item() == pytest.approx(0.15, abs=0.01)
    masked = (inputs == 4) & chosen
    kept = (inputs == ids) & chosen
    assert masked.sum() / chosen.sum() == pytest.approx(0.8, abs=0.01)
    assert kept.sum() / chosen.sum() == pytest.approx(0.1 + 0.1 / 995, abs=0.01)  # random may redraw the same id
    assert (inputs[chosen] >= 4).all()  # random replacements are ordinary ids, never [PAD]/[CLS]/[SEP]


def test_next_segment_pairs_cut_a_caption_or_join_a_random_tail(tok, captions):
    words = tok.encode_batch(captions)
    it = MLMBatches(words, tok, batch_size=64, max_len=24, mask_prob=1e-9, nsp=True, seed=0)  # (almost) no masks
    batch = next(it)
    assert batch["input_ids"].shape[1] <= 24 and (batch["input_ids"][:, 0] == tok.cls_id).all()
    kept = {tuple(w) for w in it.captions}
    for ids, types, mask, label in zip(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
                                       batch["nsp_labels"]):
        ids = ids[mask.bool()].tolist()
        first_sep = ids.index(tok.sep_id)
        a, b = ids[1:first_sep], ids[first_sep + 1:-1]
        assert ids[-1] == tok.sep_id and types[mask.bool()].tolist() == [0] * (len(a) + 2) + [1] * (len(b) + 1)
        if label == 0 and len(a) + len(b) < 21:  # untruncated continuation: A + B is one caption
            assert tuple(a + b) in kept
    assert 0.25 < batch["nsp_labels"].float().mean().item() < 0.75
    state = it.state_dict()
    ahead = next(it)
    it.load_state_dict(state)
    assert all(torch.equal(ahead[k], v) for k, v in next(it).items())


def test_loss_equals_transformers_pretraining_loss(tok, captions):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=48, max_position_embeddings=32, pad_token_id=tok.pad_id)
    ours = BertForPreTraining(config).eval()
    theirs = transformers.BertForPreTraining(transformers.BertConfig(**config.to_hf())).eval()
    theirs.load_state_dict(ours.to_hf_state_dict(), strict=False)
    theirs.tie_weights()
    batch = next(MLMBatches(tok.encode_batch(captions), tok, batch_size=8, max_len=32, mask_prob=0.15, nsp=True,
                            seed=1))
    with torch.no_grad():
        loss, n = mlm_loss(ours, batch)
        hf = theirs(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    token_type_ids=batch["token_type_ids"], labels=batch["labels"],
                    next_sentence_label=batch["nsp_labels"])
    assert n == int(batch["attention_mask"].sum()) and (batch["labels"] != -100).any()
    assert loss.item() == pytest.approx(hf.loss.item(), rel=1e-5)


def test_tiny_run_accuracy_rises_and_loss_falls(captions, tmp_path):
    out = tmp_path / "mlm"
    metrics = run_recipe("mlm", out=out, preset="tiny", overrides={"progress": False})
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [50, 100, 150]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.1  # about 4.80 -> 4.61
    assert evals[-1]["val_accuracy"] > evals[0]["val_accuracy"] + 0.01  # about 0.089 -> 0.119
    assert metrics["val_ppl"] == pytest.approx(torch.tensor(metrics["val_loss"]).exp().item(), rel=1e-6)
    assert {"val_nsp_accuracy", "val_nsp_loss", "train_tokens_per_s", "wall_s"} <= metrics.keys()
    assert (out / "tokenizer.json").is_file()
    again = evaluate_checkpoint(out, max_batches=2)  # `attnlab eval --checkpoint`: the same fixed val batches
    assert again["step"] == 150 and 0 < again["val_accuracy"] < 1
    with pytest.raises(ValueError, match="split must be 'val'"):
        evaluate_checkpoint(out, split="test_2016_flickr")


def test_evaluation_counts_only_masked_positions(tok, captions):
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, intermediate_size=32, max_position_embeddings=32,
                                          pad_token_id=tok.pad_id)).eval()
    batch = next(MLMBatches(tok.encode_batch(captions), tok, batch_size=8, max_len=32, mask_prob=0.15, nsp=False,
                            seed=2))
    result = evaluate_mlm(model, batches=[batch])
    keep = batch["labels"] != -100
    logits = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]).logits[keep]
    want = torch.nn.functional.cross_entropy(logits, batch["labels"][keep])
    assert result["val_masked_tokens"] == int(keep.sum()) and "val_nsp_loss" not in result
    assert result["val_loss"] == pytest.approx(want.item(), rel=1e-5)
    assert result["val_accuracy"] == pytest.approx((logits.argmax(-1) == batch["labels"][keep]).float().mean().item())


def test_bad_settings_are_clear_errors():
    recipe = get_recipe("mlm")
    with pytest.raises(ValueError, match="mask_prob must be in"):
        resolve_settings(recipe, overrides={"mask_prob": "1.5"})
    with pytest.raises(ValueError, match="max_len must be an int >= 5"):
        resolve_settings(recipe, overrides={"max_len": "3"})
    with pytest.raises(ValueError, match="unknown setting 'mask_rate'"):
        resolve_settings(recipe, overrides={"mask_rate": "0.2"})
