"""T5 against Hugging Face ``transformers.T5ForConditionalGeneration`` on the same (random) weights.

Tolerances: logits and loss max abs difference <= 1e-4 (float32, eval); our cached decoding
against our full forward at 1e-5; attention weights against transformers' eager ones at 1e-5;
the dense-bias and score_mod paths: logits at 1e-5, weights at atol 1e-5 + rtol 1e-4; greedy and
beam-search tokens exactly equal to transformers' ``generate``.
"""
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from attnlab.modules import multihead
from attnlab.backends import dispatch
from attnlab.evaluation.analysis import head_mask, self_attention_modules
from attnlab.models import hub
from attnlab.models.t5 import (  # importing registers "t5"
    T5Config,
    T5ForConditionalGeneration,
)
from _tolerance import tolerance  # tests/_tolerance.py: from the dtype and the magnitude

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


def _generate_both(theirs, ours, src, src_mask, **kw):
    ref = theirs.generate(input_ids=src, attention_mask=src_mask, max_new_tokens=12, do_sample=False,
                          length_penalty=1.0, early_stopping=False, **kw)
    return ref, ours.generate(src, attention_mask=src_mask, max_new_tokens=12, **kw)


def _after_eos(ids, eos):
    """True at every position after a row's first ``eos``."""
    after = (ids == eos).long().cumsum(1).roll(1, dims=1).clamp(max=1).bool()
    after[:, 0] = False
    return after


def _fill_after_eos(ids, eos, fill):
    return ids.masked_fill(_after_eos(ids, eos), fill)


@pytest.mark.parametrize("num_beams", [1, 4])
@pytest.mark.parametrize("ff, tie", [("relu", True), ("gated-gelu", False)])
@torch.no_grad()
def test_generate_equals_transformers_with_source_padding(tmp_path, ff, tie, num_beams):
    theirs, ours = _pair(tmp_path, ff, tie)
    src, src_mask, _, _ = _batch()
    ref, got = _generate_both(theirs, ours, src, src_mask, num_beams=num_beams)
    assert torch.equal(got, ref) and got[:, 0].eq(0).all()  # decoder_start_token_id first, as transformers
    for eos in (int(ref[0, 3]), int(ref[2, 6])):  # tokens emitted mid-sequence: rows end early, others run on
        ref, got = _generate_both(theirs, ours, src, src_mask, num_beams=num_beams, eos_token_id=eos,
                                  pad_token_id=V - 1)
        assert torch.equal(got, ref) and (got == eos).any(), eos
        # T5's own pad_token_id = 0: transformers' beam search fills finished rows with eos instead
        # (its `pad_token_id or eos_token_id` treats token 0 as missing); ours fills with the pad token
        ref, got = _generate_both(theirs, ours, src, src_mask, num_beams=num_beams, eos_token_id=eos)
        assert torch.equal(got, _fill_after_eos(ref, eos, 0) if num_beams > 1 else ref), eos


@torch.no_grad()
def test_static_cache_and_inferred_mask_equal_dynamic(tmp_path):
    _, ours = _pair(tmp_path, "gated-gelu", True)
    src, src_mask, _, _ = _batch()
    for beams in (1, 4):
        dynamic = ours.generate(src, attention_mask=src_mask, max_new_tokens=10, num_beams=beams)
        assert torch.equal(ours.generate(src, attention_mask=src_mask, max_new_tokens=10, num_beams=beams,
                                         cache="static"), dynamic)
        # no mask given: inferred from pad_token_id = 0, which marks exactly the padding in _batch()
        assert torch.equal(ours.generate(src, max_new_tokens=10, num_beams=beams), dynamic)


@pytest.mark.parametrize("top_k, top_p", [(3, None), (None, 0.6), (5, 0.8)])
@torch.no_grad()
def test_sampling_is_seeded_and_stays_in_the_filtered_support(tmp_path, top_k, top_p):
    """Every sampled token lies in the support transformers' warpers leave at that step (logits
    recomputed by teacher forcing on the sampled prefix); the same seed gives the same tokens."""
    _, ours = _pair(tmp_path, "relu", True)
    src, src_mask, _, _ = _batch()
    src, src_mask = src.repeat(8, 1), src_mask.repeat(8, 1)  # 24 rows: many draws per step
    kw = dict(attention_mask=src_mask, max_new_tokens=8, do_sample=True, top_k=top_k, top_p=top_p,
              temperature=0.9, eos_token_id=V - 1)
    out = ours.generate(src, generator=torch.Generator().manual_seed(3), **kw)
    assert torch.equal(out, ours.generate(src, generator=torch.Generator().manual_seed(3), **kw))
    assert not torch.equal(out, ours.generate(src, generator=torch.Generator().manual_seed(4), **kw))
    logits = ours(src, src_mask, out[:, :-1]).logits / 0.9  # (B, T, V): step t predicts out[:, t + 1]
    sampled = ~_after_eos(out, V - 1)  # later positions are padding
    for t in range(out.shape[1] - 1):
        z = logits[:, t]
        if top_k is not None:
            z = TopKLogitsWarper(top_k)(None, z)
        if top_p is not None:
            z = TopPLogitsWarper(top_p)(None, z)
        assert torch.isfinite(z.gather(1, out[:, t + 1:t + 2]))[sampled[:, t + 1:t + 2]].all(), t
    assert len(out[:, 1].unique()) > 1  # it does sample


@torch.no_grad()
def test_output_attentions_equal_transformers_eager(tmp_path):
    theirs, ours = _pair(tmp_path, "gated-gelu", False)
    theirs.set_attn_implementation("eager")
    src, src_mask, tgt, tgt_mask = _batch()
    kw = dict(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask,
              output_attentions=True)
    ref, got = theirs(**kw), ours(**kw)
    assert (got.logits - ref.logits)[tgt_mask.bool()].abs().max() <= TOL
    for name, rows in (("encoder_attentions", src_mask), ("decoder_attentions", tgt_mask),
                       ("cross_attentions", tgt_mask)):
        a, b = getattr(got, name), getattr(ref, name)
        assert len(a) == len(b) == 2
        for w, w_ref in zip(a, b):  # (B, H, Lq, Lk); rows of padded queries are not compared
            assert w.shape == w_ref.shape
            assert (w - w_ref).permute(0, 2, 1, 3)[rows.bool()].abs().max() <= tolerance(w_ref, n=32, depth=4), name
    assert ours(**{**kw, "output_attentions": False}).encoder_attentions is None


def _self_attention_requests(monkeypatch, run):
    """``(mask, score_mod)`` of every request the attention modules hand to the pipeline (``dispatch.attend``)
    while ``run()`` runs."""
    calls, original = [], multihead.attend

    def spy(q, k, v, request, **kw):
        calls.append((request["mask"], request["score_mod"]))
        return original(q, k, v, request, **kw)

    with monkeypatch.context() as m:
        m.setattr(multihead, "attend", spy)
        run()
    return calls


@torch.no_grad()
def test_score_mod_bias_path_equals_dense_bias(tmp_path, monkeypatch):
    """Above DENSE_BIAS_LIMIT the relative bias becomes a score_mod (tiled backend, O(L) memory):
    same logits and attentions, in full and cached decoding."""
    _, ours = _pair(tmp_path, "relu", True)
    src, src_mask, tgt, tgt_mask = _batch()
    kw = dict(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)
    dense, dense_w = ours(**kw), ours(**kw, output_attentions=True)
    dense_ids = [ours.generate(src, attention_mask=src_mask, max_new_tokens=8, num_beams=b) for b in (1, 3)]
    (mask, mod), = _self_attention_requests(monkeypatch, lambda: ours.encoder.layers[0](
        torch.zeros(3, 18, 32), key_padding_mask=src_mask == 0))
    assert mod is None and mask.shape == (3, 4, 18, 18) and mask.is_floating_point()  # bias + padding, dense
    monkeypatch.setattr(dispatch, "DENSE_BIAS_LIMIT", 0)
    (mask, mod), = _self_attention_requests(monkeypatch, lambda: ours.encoder.layers[0](
        torch.zeros(3, 18, 32), key_padding_mask=src_mask == 0))
    assert callable(mod) and mask.shape == (3, 1, 1, 18) and mask.dtype == torch.bool  # O(L): padding only
    for modded, reference in ((ours(**kw), dense), (ours(**kw, output_attentions=True), dense_w)):
        diff = (modded.logits - reference.logits)[tgt_mask.bool()].abs().max()
        assert diff <= tolerance(reference.logits, n=32, depth=4)
    modded = ours(**kw, output_attentions=True)
    for name in ("encoder_attentions", "decoder_attentions", "cross_attentions"):
        for a, b in zip(getattr(modded, name), getattr(dense_w, name)):  # round-off grows through the layers
            torch.testing.assert_close(a, b, atol=tolerance(b, n=32, depth=4), rtol=1e-4)
    for b, ids in zip((1, 3), dense_ids):  # every cached step on the score_mod path too
        assert torch.equal(ours.generate(src, attention_mask=src_mask, max_new_tokens=8, num_beams=b), ids)


@torch.no_grad()
def test_long_inputs_take_the_score_mod_path(monkeypatch):
    model = T5ForConditionalGeneration(T5Config(vocab_size=V, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                                num_decoder_layers=1, num_heads=4)).eval()
    L = 1100  # 4 heads · 1100² > DENSE_BIAS_LIMIT = 2²²
    ids = torch.randint(0, V, (2, L))
    requests = _self_attention_requests(monkeypatch, lambda: model.encode(ids))
    assert len(requests) == 1 and requests[0][0] is None and callable(requests[0][1])
    memory, cache = torch.zeros(2, 3, 16), model.new_cache()
    model.decode(ids, memory, cache=cache)
    requests = _self_attention_requests(monkeypatch, lambda: model.decode(
        ids[:, :1], memory, decoder_attention_mask=torch.ones(2, L + 1), cache=cache))  # one cached step
    (mask, mod), cross = requests  # self-attention, then cross-attention (no bias, no mask)
    assert mod is None and mask.shape == (2, 4, 1, L + 1) and cross == (None, None)


@torch.no_grad()
def test_cached_decoding_equals_full_forward(tmp_path):
    _, ours = _pair(tmp_path, "gated-gelu", True)
    src, src_mask, tgt, _ = _batch()
    full = ours(src, src_mask, tgt, output_attentions=True)
    memory = ours.encode(src, src_mask)
    cache = ours.new_cache()
    steps = [ours(attention_mask=src_mask, decoder_input_ids=tgt[:, :5], encoder_outputs=memory,
                  past_key_values=cache, use_cache=True).logits]
    for t in range(5, tgt.shape[1] - 1):
        steps.append(ours.decode(tgt[:, t:t + 1], memory, attention_mask=src_mask, cache=cache))
    last = ours(attention_mask=src_mask, decoder_input_ids=tgt[:, -1:], encoder_outputs=memory, past_key_values=cache,
                use_cache=True, output_attentions=True)  # weights of a cached step: the full forward's last row
    assert (torch.cat(steps + [last.logits], dim=1) - full.logits).abs().max() <= tolerance(full.logits, n=32, depth=4)
    assert cache[0].self_attn.length == tgt.shape[1] and last.encoder_attentions is None
    for name in ("decoder_attentions", "cross_attentions"):
        for a, b in zip(getattr(last, name), getattr(full, name)):
            assert (a - b[:, :, -1:]).abs().max() <= tolerance(b, n=32, depth=4), name


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


@torch.no_grad()
def test_attention_analysis_sees_t5s_self_attentions():
    """T5 is built from the shared MultiheadAttention, so the analysis tools find and mask its heads."""
    model = T5ForConditionalGeneration(T5Config(vocab_size=V, d_model=32, d_kv=12, d_ff=64, num_layers=2,
                                                num_decoder_layers=3, num_heads=4)).eval()
    mods = self_attention_modules(model)
    assert mods == [layer.self_attn for layer in (*model.encoder.layers, *model.decoder.layers)]
    assert all(m.scale == 1.0 and m.head_dim == 12 for m in mods)
    src, tgt = torch.randint(0, V, (2, 7)), torch.randint(0, V, (2, 5))
    logits = model(src, decoder_input_ids=tgt).logits
    with head_mask(model, torch.ones(5, 4)):
        assert torch.equal(model(src, decoder_input_ids=tgt).logits, logits)
    pruned = torch.ones(5, 4)
    pruned[0, 1] = 0  # head 1 of the first encoder layer
    with head_mask(model, pruned):
        assert (model(src, decoder_input_ids=tgt).logits - logits).abs().max() > 1e-3


@pytest.mark.parametrize("kw, field", [
    (dict(vocab_size=0), "vocab_size"), (dict(d_kv=True), "d_kv"), (dict(num_heads=0), "num_heads"),
    (dict(num_decoder_layers=-1), "num_decoder_layers"), (dict(feed_forward_proj="gated-silu"), "feed_forward_proj"),
    (dict(relative_attention_num_buckets=2), "relative_attention_num_buckets"),
    (dict(relative_attention_num_buckets=32, relative_attention_max_distance=16), "relative_attention_max_distance"),
    (dict(dropout_rate=1.0), "dropout_rate"), (dict(layer_norm_epsilon=0.0), "layer_norm_epsilon"),
    (dict(tie_word_embeddings="yes"), "tie_word_embeddings"), (dict(eos_token_id=-1), "eos_token_id"),
    (dict(scale_decoder_outputs=1), "scale_decoder_outputs"),
])
def test_bad_config_raises_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        T5Config(**kw)


def test_from_hf_reads_both_spellings_of_an_untied_head():
    base = dict(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
    v4 = T5Config.from_hf({**base, "tie_word_embeddings": False})  # transformers 4's T5 v1.1
    assert not v4.tie_word_embeddings and not v4.scale_decoder_outputs
    v5 = T5Config.from_hf({**base, "tie_word_embeddings": True, "scale_decoder_outputs": False})
    assert v5.tie_word_embeddings and not v5.scale_decoder_outputs  # the checkpoint decides the tie
    assert T5Config.from_hf(base).tie_word_embeddings and T5Config.from_hf(base).scale_decoder_outputs
    assert T5Config.from_hf(base).num_decoder_layers == 1


@torch.no_grad()
def test_transformers5_unscaled_tied_head_loads_and_saves(tmp_path):
    """transformers 5 ties every T5 head: a T5 v1.1 config (unscaled) built by it saves no lm_head.weight."""
    cfg = transformers.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                relative_attention_num_buckets=8, relative_attention_max_distance=20,
                                feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    theirs = transformers.T5ForConditionalGeneration(cfg).eval()
    theirs.save_pretrained(tmp_path / "hf")
    assert "lm_head.weight" not in load_file(tmp_path / "hf" / "model.safetensors")
    ours = hub.from_pretrained(tmp_path / "hf")
    assert ours.lm_head is None and not ours.config.scale_decoder_outputs
    src, src_mask, tgt, tgt_mask = _batch()
    kw = dict(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)
    keep = tgt_mask.bool()
    assert (ours(**kw).logits - theirs(**kw).logits)[keep].abs().max() <= TOL
    ours.save_pretrained(tmp_path / "ours")
    again = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "ours").eval()
    assert (again(**kw).logits - theirs(**kw).logits)[keep].abs().max() <= TOL


def test_untied_config_without_lm_head_is_an_error_naming_it(tmp_path):
    _, ours = _pair(tmp_path, "relu", False)  # a checkpoint with its own lm_head.weight
    ours.save_pretrained(tmp_path / "v4")
    cfg = json.loads((tmp_path / "v4" / "config.json").read_text())
    cfg.pop("scale_decoder_outputs")
    assert cfg["tie_word_embeddings"] is False  # transformers 4's spelling of an untied head
    (tmp_path / "v4" / "config.json").write_text(json.dumps(cfg))
    assert hub.from_pretrained(tmp_path / "v4").lm_head is not None
    sd = load_file(tmp_path / "v4" / "model.safetensors")
    del sd["lm_head.weight"]
    save_file(sd, tmp_path / "v4" / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors \['lm_head.weight'\]"):
        hub.from_pretrained(tmp_path / "v4")


@pytest.mark.parametrize("call, match", [
    (lambda m: m(torch.tensor([[1, V]]), decoder_input_ids=torch.tensor([[0]])), "input_ids"),
    (lambda m: m(torch.tensor([[1, 2]]), decoder_input_ids=torch.tensor([[-1]])), "decoder_input_ids"),
    (lambda m: m(torch.tensor([[1, 2]])), "decoder_input_ids or labels"),
    (lambda m: m(torch.tensor([[1, 2]]), torch.ones(1, 3), torch.tensor([[0]])), "attention_mask"),
    (lambda m: m(torch.tensor([[1, 2]]), decoder_input_ids=torch.tensor([[0]]),
                 decoder_attention_mask=torch.full((1, 1), 2)), "decoder_attention_mask"),
    (lambda m: m.generate(torch.tensor([[1, 2]]), max_new_tokens=0), "max_new_tokens"),
    (lambda m: m.generate(torch.tensor([[1, V]]), max_new_tokens=2), "input_ids"),
    (lambda m: m(decoder_input_ids=torch.tensor([[0]]), encoder_outputs=torch.zeros(1, 2, 3)), "encoder_outputs"),
])
def test_bad_inputs_raise(call, match):
    model = T5ForConditionalGeneration(T5Config(vocab_size=V, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4))
    with pytest.raises(ValueError, match=match):
        call(model)
