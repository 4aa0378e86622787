"""BART against Hugging Face ``transformers.BartForConditionalGeneration`` on the same (random) weights.

Tolerances: logits max abs difference <= 1e-4 (float32, eval) on non-padded target positions;
incremental (cached) against full decoding: logits within 1e-5 relative to the largest logit;
attention weights against transformers' eager ones: 1e-5; greedy and beam-search ``generate``
against transformers' (and cached against uncached greedy decoding): identical tokens.
"""
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from attnlab.models import hub
from attnlab.models.bart import BartConfig, BartForConditionalGeneration, shift_tokens_right
from _tolerance import tolerance  # tests/_tolerance.py: from the dtype and the magnitude

transformers.logging.set_verbosity_error()
V, N_POS, PAD, START, EOS = 99, 64, 1, 2, 2
TOL = 1e-4


def _hf_config(**kw):
    return transformers.BartConfig(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
                                   encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                   decoder_ffn_dim=64, max_position_embeddings=N_POS, pad_token_id=PAD,
                                   bos_token_id=0, eos_token_id=EOS, decoder_start_token_id=START,
                                   forced_bos_token_id=None, forced_eos_token_id=None, **kw)


def _randomize(model):
    """Widen the init so greedy outputs vary with the source: embeddings N(0, 1), matrices N(0, 0.2),
    layer-norm gains U(0.5, 1.5), biases (and BART's logit bias) U(±0.1). Works for HF's and our names."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "shared" in name or "positions" in name:
                p.normal_(0, 1.0)
            elif p.dim() > 1:
                p.normal_(0, 0.2)
            elif "norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.uniform_(-0.1, 0.1)
        model.final_logits_bias.uniform_(-0.1, 0.1)
    return model.eval()


def _theirs(**kw):
    """A tiny transformers BART with random weights (see :func:`_randomize`)."""
    torch.manual_seed(0)
    return _randomize(transformers.BartForConditionalGeneration(_hf_config(**kw)))


def _batch():
    """Sources padded on the right (row 0) and on the left (row 2); targets padded on the right (row 1)."""
    g = torch.Generator().manual_seed(1)
    src = torch.randint(3, V, (3, 11), generator=g)
    src_mask = torch.ones_like(src)
    src_mask[0, 7:] = 0
    src_mask[2, :3] = 0
    tgt = torch.randint(3, V, (3, 9), generator=g)
    tgt[:, 0] = START
    tgt_mask = torch.ones_like(tgt)
    tgt_mask[1, 6:] = 0
    return src.masked_fill(src_mask == 0, PAD), src_mask, tgt.masked_fill(tgt_mask == 0, PAD), tgt_mask


def _assert_close(ours, theirs, tgt_mask):
    src, src_mask, tgt, _ = _batch()
    got = ours(src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)
    ref = theirs(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)
    keep = tgt_mask.bool()
    assert (got.logits - ref.logits)[keep].abs().max() <= TOL
    enc_keep = src_mask.bool()
    assert (got.encoder_last_hidden_state - ref.encoder_last_hidden_state)[enc_keep].abs().max() <= TOL
    assert torch.isfinite(got.logits).all()


@pytest.mark.parametrize("scale_embedding", [False, True])
@torch.no_grad()
def test_from_pretrained_reads_transformers_save_with_padding(tmp_path, scale_embedding):
    theirs = _theirs(scale_embedding=scale_embedding)
    theirs.save_pretrained(tmp_path)
    ours = hub.from_pretrained(tmp_path)
    assert isinstance(ours, BartForConditionalGeneration) and not ours.training
    assert ours.config.scale_embedding is scale_embedding
    _assert_close(ours, theirs, _batch()[3])


@torch.no_grad()
def test_save_pretrained_loads_into_transformers_with_padding(tmp_path):
    config = BartConfig.from_hf(_hf_config().to_dict())
    ours = _randomize(BartForConditionalGeneration(config))
    ours.save_pretrained(tmp_path)
    theirs = transformers.BartForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert torch.equal(theirs.lm_head.weight, ours.shared.weight)  # tied on their side too
    _assert_close(ours, theirs, _batch()[3])
    assert BartConfig.from_hf(config.to_hf()) == config
    back = ours.from_hf_state_dict(ours.to_hf_state_dict())
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())


@torch.no_grad()
def test_default_decoder_input_is_shifted_source():
    theirs = _theirs()
    ours = BartForConditionalGeneration(BartConfig.from_hf(theirs.config.to_dict())).eval()
    ours.load_state_dict(ours.from_hf_state_dict(theirs.state_dict()))
    src = torch.randint(3, V, (2, 7))
    assert torch.equal(shift_tokens_right(src, START)[:, 1:], src[:, :-1])
    assert (ours(src).logits - theirs(input_ids=src).logits).abs().max() <= TOL


def _loaded(tmp_path):
    theirs = _theirs()
    theirs.save_pretrained(tmp_path)
    return theirs, hub.from_pretrained(tmp_path)


@torch.no_grad()
def test_incremental_decoding_equals_full_forward(tmp_path):
    _, ours = _loaded(tmp_path)
    src, src_mask, tgt, _ = _batch()
    memory = ours.encode(src, src_mask)
    full = ours.decode(tgt, memory, attention_mask=src_mask)
    cache = ours.new_cache(max_length=tgt.shape[1])
    steps = [ours.decode(tgt[:, :3], memory, attention_mask=src_mask, cache=cache)]
    steps += [ours.decode(tgt[:, t:t + 1], memory, attention_mask=src_mask, cache=cache) for t in range(3, 9)]
    assert (torch.cat(steps, dim=1) - full).abs().max() <= 1e-5 * full.abs().max()
    assert cache[0].self_attn.length == 9


def _uncached_greedy(model, src, src_mask, steps):
    """Greedy decoding re-running the whole prefix each step (no cache, no EOS): the reference."""
    memory = model.encode(src, src_mask)
    ids = torch.full((src.shape[0], 1), START)
    for _ in range(steps):
        ids = torch.cat([ids, model.decode(ids, memory, attention_mask=src_mask)[:, -1:].argmax(-1)], dim=1)
    return ids


def _theirs_generate(model, src, src_mask, **kw):
    return model.generate(input_ids=src, attention_mask=src_mask, max_new_tokens=12, do_sample=False,
                          forced_bos_token_id=None, forced_eos_token_id=None, no_repeat_ngram_size=0, min_length=0,
                          length_penalty=1.0, early_stopping=False, **kw)


@torch.no_grad()
def test_greedy_generate_equals_uncached_decoding(tmp_path):
    _, ours = _loaded(tmp_path)
    src, src_mask, _, _ = _batch()
    got = ours.generate(src, attention_mask=src_mask, max_new_tokens=12, eos_token_id=V - 1)  # EOS never emitted
    assert torch.equal(got, _uncached_greedy(ours, src, src_mask, 12)) and got[:, 0].eq(START).all()


@pytest.mark.parametrize("num_beams", [1, 4])
@torch.no_grad()
def test_generate_equals_transformers_with_source_padding(tmp_path, num_beams):
    theirs, ours = _loaded(tmp_path)
    src, src_mask, _, _ = _batch()
    ref = _theirs_generate(theirs, src, src_mask, num_beams=num_beams, eos_token_id=V - 1)
    got = ours.generate(src, attention_mask=src_mask, max_new_tokens=12, num_beams=num_beams, eos_token_id=V - 1)
    assert torch.equal(got, ref)
    for eos in (EOS, int(ref[0, 1]), int(ref[2, 5])):  # the config's and two emitted mid-sequence
        ref = _theirs_generate(theirs, src, src_mask, num_beams=num_beams, eos_token_id=eos)
        got = ours.generate(src, attention_mask=src_mask, max_new_tokens=12, num_beams=num_beams, eos_token_id=eos)
        assert torch.equal(got, ref), eos
    assert (got == PAD).any()  # a row ended and was padded while another ran on


@torch.no_grad()
def test_static_cache_and_default_eos_and_inferred_mask(tmp_path):
    _, ours = _loaded(tmp_path)
    src, src_mask, _, _ = _batch()
    for beams in (1, 4):
        dynamic = ours.generate(src, attention_mask=src_mask, max_new_tokens=10, num_beams=beams)
        assert torch.equal(ours.generate(src, attention_mask=src_mask, max_new_tokens=10, num_beams=beams,
                                         cache="static"), dynamic)
        assert torch.equal(ours.generate(src, attention_mask=src_mask, max_new_tokens=10, num_beams=beams,
                                         eos_token_id=EOS, pad_token_id=PAD), dynamic)  # the config's defaults
        assert torch.equal(ours.generate(src, max_new_tokens=10, num_beams=beams), dynamic)  # mask: src != PAD


@torch.no_grad()
def test_output_attentions_equal_transformers_eager(tmp_path):
    theirs, ours = _loaded(tmp_path)
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
    plain = ours(**{**kw, "output_attentions": False})
    assert plain.encoder_attentions is None and torch.equal(plain.logits, got.logits)
    # a cached step's weights cover the past and the new positions: the full forward's last row (the cache
    # keeps the past keys, which the layers' forward attends over)
    ones = torch.ones_like(tgt)
    full = ours(src, src_mask, tgt, ones, output_attentions=True)
    cache = ours.new_cache()
    ours(src, src_mask, tgt[:, :-1], ones[:, :-1], past_key_values=cache, use_cache=True)
    last = ours(src, src_mask, tgt[:, -1:], ones, past_key_values=cache, use_cache=True, output_attentions=True)
    for name in ("decoder_attentions", "cross_attentions"):
        for a, b in zip(getattr(last, name), getattr(full, name)):
            assert a.shape == b[:, :, -1:].shape and (a - b[:, :, -1:]).abs().max() <= tolerance(b, n=32, depth=4), name


def test_checkpoint_without_final_logits_bias_loads_zeros(tmp_path):
    theirs = _theirs()
    with torch.no_grad():
        theirs.final_logits_bias.zero_()
    theirs.save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    del sd["final_logits_bias"]
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours = hub.from_pretrained(tmp_path)
    assert ours.final_logits_bias.abs().max() == 0
    _assert_close(ours, theirs, _batch()[3])
    del sd["model.shared.weight"]  # a required tensor is still required
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors \['model.shared.weight'\]"):
        hub.from_pretrained(tmp_path)


def test_lm_head_is_tied_and_positions_carry_the_offset():
    model = BartForConditionalGeneration(BartConfig.from_hf(_hf_config().to_dict()))
    sd = model.to_hf_state_dict()
    assert sd["model.encoder.embed_positions.weight"].shape == (N_POS + 2, 32)
    assert "lm_head.weight" not in sd and sd["final_logits_bias"].shape == (1, V)
    assert model.lm_head.weight is model.shared.weight
    pos = torch.arange(3)
    assert torch.equal(model.decoder.embed_positions(pos), model.decoder.embed_positions.weight[2:5])


@pytest.mark.parametrize("kw, match", [
    (dict(input_ids=torch.full((1, N_POS + 1), 5)), "max_position_embeddings"),
    (dict(input_ids=torch.full((1, 4), 5), decoder_input_ids=torch.full((1, N_POS + 1), 5)),
     "max_position_embeddings"),
    (dict(input_ids=torch.tensor([[1, V]])), "input_ids"),
    (dict(input_ids=torch.tensor([[3, 4]]), decoder_input_ids=torch.tensor([[-1]])), "decoder_input_ids"),
    (dict(input_ids=torch.tensor([[3, 4]]), attention_mask=torch.ones(1, 3)), "attention_mask"),
    (dict(input_ids=torch.tensor([[3, 4]]), attention_mask=torch.tensor([[1, 2]])), "attention_mask"),
    (dict(input_ids=torch.tensor([[3, 4]]), decoder_input_ids=torch.tensor([[2, 4]]),
          decoder_attention_mask=torch.ones(1, 3)), "decoder_attention_mask"),
    (dict(), "input_ids"),
])
def test_bad_inputs_raise(kw, match):
    model = BartForConditionalGeneration(BartConfig.from_hf(_hf_config().to_dict())).eval()
    with pytest.raises(ValueError, match=match):
        model(**kw)


def test_cache_overflowing_max_positions_raises():
    model = BartForConditionalGeneration(BartConfig.from_hf(_hf_config().to_dict())).eval()
    memory = model.encode(torch.full((1, 4), 5))
    cache = model.new_cache()
    model.decode(torch.full((1, N_POS), 5), memory, cache=cache)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.decode(torch.full((1, 1), 5), memory, cache=cache)


@pytest.mark.parametrize("kw, match", [
    (dict(vocab_size=0), "vocab_size"), (dict(d_model=30, encoder_attention_heads=4), "encoder_attention_heads"),
    (dict(activation_function="swish"), "activation_function"), (dict(dropout=1.0), "dropout"),
    (dict(pad_token_id=50265), "pad_token_id"),
])
def test_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        BartConfig(**kw)


def test_scale_embedding_must_be_a_bool():
    with pytest.raises(TypeError, match="scale_embedding"):
        BartConfig(scale_embedding=1)


@pytest.mark.parametrize("kw, match", [
    (dict(encoder_layerdrop=0.1), "encoder_layerdrop"), (dict(normalize_before=True), "normalize_before"),
    (dict(add_final_layer_norm=True), "add_final_layer_norm"),
])
def test_from_hf_rejects_what_it_cannot_run(kw, match):
    with pytest.raises(ValueError, match=match):
        BartConfig.from_hf({**_hf_config().to_dict(), **kw})
