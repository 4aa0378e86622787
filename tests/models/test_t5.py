"""T5 against Hugging Face ``transformers.T5ForConditionalGeneration`` on the same (random) weights.

Tolerances: logits and loss max abs difference <= 1e-4 (float32, eval); our cached decoding
against our full forward at 1e-5; greedy tokens exactly equal to transformers' greedy ``generate``.
"""
import pytest
import torch
import transformers

from attnlab.models import hub
from attnlab.models.t5 import (  # importing registers "t5"
    T5Config,
    T5ForConditionalGeneration,
)

transformers.logging.set_verbosity_error()
V = 99
TOL = 1e-4
VARIANTS = [("relu", True), ("gated-gelu", True), ("relu", False), ("gated-gelu", False)]


def _hf_model(ff, tie):
    cfg = transformers.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=20,
                                feed_forward_proj=ff, tie_word_embeddings=tie, decoder_start_token_id=0,
                                pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    if not tie:  # T5 v1.1: an LM head of its own (transformers 5 builds it tied to `shared`)
        model.lm_head.weight = torch.nn.Parameter(torch.empty(V, 32))
    with torch.no_grad():  # wider than HF's init, so greedy decoding does not collapse to one token
        for p in model.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return model


def _pair(tmp_path, ff="relu", tie=True):
    """A tiny transformers T5 and ours loaded from its ``save_pretrained`` directory."""
    theirs = _hf_model(ff, tie)
    theirs.save_pretrained(tmp_path / "hf")
    ours = hub.from_pretrained(tmp_path / "hf")
    return theirs, ours


def _batch():
    """Encoder padding on the right (row 0) and on the left (row 2); decoder padding on the right (row 1).

    The lengths (18 source, 14 target) span several log-spaced buckets of the 8-bucket, distance-20 bias."""
    g = torch.Generator().manual_seed(0)
    src = torch.randint(2, V, (3, 18), generator=g)
    src_mask = torch.ones_like(src)
    src_mask[0, 12:] = 0
    src_mask[2, :5] = 0
    tgt = torch.randint(2, V, (3, 14), generator=g)
    tgt_mask = torch.ones_like(tgt)
    tgt_mask[1, 9:] = 0
    return src.masked_fill(src_mask == 0, 0), src_mask, tgt.masked_fill(tgt_mask == 0, 0), tgt_mask


@pytest.mark.parametrize("ff, tie", VARIANTS)
@torch.no_grad()
def test_padded_logits_match_transformers_both_directions(tmp_path, ff, tie):
    theirs, ours = _pair(tmp_path, ff, tie)
    assert isinstance(ours, T5ForConditionalGeneration) and not ours.training
    assert (ours.lm_head is None) == tie
    src, src_mask, tgt, tgt_mask = _batch()
    kw = dict(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)
    ref, got = theirs(**kw), ours(**kw)
    keep = tgt_mask.bool()
    assert (got.logits - ref.logits)[keep].abs().max() <= TOL
    enc_keep = src_mask.bool()
    assert (got.encoder_last_hidden_state - ref.encoder_last_hidden_state)[enc_keep].abs().max() <= TOL
    # the reverse direction: our save_pretrained, loaded by transformers, gives the same logits
    ours.save_pretrained(tmp_path / "ours")
    again = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "ours").eval()
    assert (again(**kw).logits - ref.logits)[keep].abs().max() <= TOL
    assert T5Config.from_hf(ours.config.to_hf()) == ours.config


@torch.no_grad()
def test_labels_shift_right_and_loss_match_transformers(tmp_path):
    theirs, ours = _pair(tmp_path, "gated-gelu", False)
    src, src_mask, labels, tgt_mask = _batch()
    labels = labels.masked_fill(tgt_mask == 0, -100)
    ref = theirs(input_ids=src, attention_mask=src_mask, labels=labels)
    got = ours(input_ids=src, attention_mask=src_mask, labels=labels)
    assert torch.equal(ours.shift_right(labels), theirs._shift_right(labels))
    assert (got.logits - ref.logits).abs().max() <= TOL
    assert abs(float(got.loss) - float(ref.loss)) <= TOL


@pytest.mark.parametrize("ff, tie", [("relu", True), ("gated-gelu", False)])
@torch.no_grad()
def test_greedy_equals_transformers_generate(tmp_path, ff, tie):
    theirs, ours = _pair(tmp_path, ff, tie)
    src, src_mask, _, _ = _batch()
    first = theirs.generate(input_ids=src, attention_mask=src_mask, max_new_tokens=12, do_sample=False, num_beams=1)
    assert torch.equal(ours.greedy(src, src_mask, max_new_tokens=12), first)
    eos = int(first[0, 3])  # now row 0 ends at its third token: padding follows while the others run on
    ref = theirs.generate(input_ids=src, attention_mask=src_mask, max_new_tokens=12, do_sample=False, num_beams=1,
                          eos_token_id=eos)
    got = ours.greedy(src, src_mask, max_new_tokens=12, eos_token_id=eos)
    assert torch.equal(got, ref) and got[0, 3] == eos


@torch.no_grad()
def test_cached_decoding_equals_full_forward(tmp_path):
    _, ours = _pair(tmp_path, "gated-gelu", True)
    src, src_mask, tgt, _ = _batch()
    full = ours(src, src_mask, tgt).logits
    memory = ours.encode(src, src_mask)
    cache = ours.new_cache()
    steps = [ours(attention_mask=src_mask, decoder_input_ids=tgt[:, :5], encoder_last_hidden_state=memory,
                  past_key_values=cache, use_cache=True).logits]
    for t in range(5, tgt.shape[1]):
        steps.append(ours(attention_mask=src_mask, decoder_input_ids=tgt[:, t:t + 1], encoder_last_hidden_state=memory,
                          past_key_values=cache, use_cache=True).logits)
    assert (torch.cat(steps, dim=1) - full).abs().max() <= 1e-5
    assert cache[0].self_attn.length == tgt.shape[1]


def test_hf_names_and_inner_dim_different_from_d_model():
    model = T5ForConditionalGeneration(T5Config(vocab_size=V, d_model=32, d_kv=12, d_ff=64, num_layers=1,
                                                num_decoder_layers=2, num_heads=4, feed_forward_proj="gated-gelu"))
    hf = model.to_hf_state_dict()
    assert hf["encoder.block.0.layer.0.SelfAttention.q.weight"].shape == (48, 32)
    assert hf["decoder.block.1.layer.1.EncDecAttention.o.weight"].shape == (32, 48)
    assert hf["decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"].shape == (32, 4)
    assert {"shared.weight", "encoder.final_layer_norm.weight", "decoder.block.1.layer.2.DenseReluDense.wi_1.weight",
            "encoder.block.0.layer.1.DenseReluDense.wo.weight"} <= hf.keys()
    assert "lm_head.weight" not in hf and "encoder.block.1.layer.0.SelfAttention.q.weight" not in hf
    back = model.from_hf_state_dict(hf)
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("kw, field", [
    (dict(vocab_size=0), "vocab_size"), (dict(d_kv=True), "d_kv"), (dict(num_heads=0), "num_heads"),
    (dict(num_decoder_layers=-1), "num_decoder_layers"), (dict(feed_forward_proj="gated-silu"), "feed_forward_proj"),
    (dict(relative_attention_num_buckets=2), "relative_attention_num_buckets"),
    (dict(relative_attention_num_buckets=32, relative_attention_max_distance=16), "relative_attention_max_distance"),
    (dict(dropout_rate=1.0), "dropout_rate"), (dict(layer_norm_epsilon=0.0), "layer_norm_epsilon"),
    (dict(tie_word_embeddings="yes"), "tie_word_embeddings"), (dict(eos_token_id=-1), "eos_token_id"),
])
def test_bad_config_raises_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        T5Config(**kw)


def test_from_hf_reads_both_spellings_of_an_untied_head():
    base = dict(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
    assert not T5Config.from_hf({**base, "tie_word_embeddings": False}).tie_word_embeddings  # transformers 4
    assert not T5Config.from_hf({**base, "tie_word_embeddings": True, "scale_decoder_outputs": False}).tie_word_embeddings
    assert T5Config.from_hf(base).tie_word_embeddings and T5Config.from_hf(base).num_decoder_layers == 1


@pytest.mark.parametrize("call, match", [
    (lambda m: m(torch.tensor([[1, V]]), decoder_input_ids=torch.tensor([[0]])), "input_ids"),
    (lambda m: m(torch.tensor([[1, 2]]), decoder_input_ids=torch.tensor([[-1]])), "decoder_input_ids"),
    (lambda m: m(torch.tensor([[1, 2]])), "decoder_input_ids or labels"),
    (lambda m: m(torch.tensor([[1, 2]]), torch.ones(1, 3), torch.tensor([[0]])), "attention_mask"),
    (lambda m: m(torch.tensor([[1, 2]]), decoder_input_ids=torch.tensor([[0]]),
                 decoder_attention_mask=torch.full((1, 1), 2)), "decoder_attention_mask"),
    (lambda m: m.greedy(torch.tensor([[1, 2]]), max_new_tokens=0), "max_new_tokens"),
])
def test_bad_inputs_raise(call, match):
    model = T5ForConditionalGeneration(T5Config(vocab_size=V, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4))
    with pytest.raises(ValueError, match=match):
        call(model)
