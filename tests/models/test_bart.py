"""BART against Hugging Face ``transformers.BartForConditionalGeneration`` on the same (random) weights.

Tolerances: logits max abs difference <= 1e-4 (float32, eval) on non-padded target positions;
incremental (cached) against full decoding: logits within 1e-5 relative to the largest logit;
cached against uncached greedy decoding and transformers' greedy ``generate``: identical tokens.
"""
import pytest
import torch
import transformers

from attnlab.models import hub
from attnlab.models.bart import BartConfig, BartForConditionalGeneration, shift_tokens_right

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


@torch.no_grad()
def test_greedy_cached_equals_uncached_and_transformers_generate(tmp_path):
    theirs, ours = _loaded(tmp_path)
    src, src_mask, _, _ = _batch()
    cached = ours.greedy(src, src_mask, max_new_tokens=12)
    uncached = ours.greedy(src, src_mask, max_new_tokens=12, use_cache=False)
    assert torch.equal(cached, uncached)
    ref = theirs.generate(input_ids=src, attention_mask=src_mask, max_new_tokens=12, num_beams=1,
                          do_sample=False, forced_bos_token_id=None, forced_eos_token_id=None,
                          no_repeat_ngram_size=0, min_length=0)
    assert torch.equal(cached, ref)
    assert cached[:, 0].eq(START).all()


@torch.no_grad()
def test_greedy_stops_at_eos_and_pads(tmp_path):
    theirs, ours = _loaded(tmp_path)
    src, src_mask, _, _ = _batch()
    first = ours.greedy(src, src_mask, max_new_tokens=1, eos_token_id=V - 1)[:, 1]  # each row's first token
    eos = int(first[0])
    out = ours.greedy(src, src_mask, max_new_tokens=6, eos_token_id=eos)
    ref = theirs.generate(input_ids=src, attention_mask=src_mask, max_new_tokens=6, num_beams=1, do_sample=False,
                          eos_token_id=eos, forced_bos_token_id=None, forced_eos_token_id=None,
                          no_repeat_ngram_size=0, min_length=0)
    assert torch.equal(out, ref)
    assert out[0, 1] == eos and (out[0, 2:] == PAD).all()
    assert (out != PAD).all(dim=1).any()  # a row that never met eos runs to the end


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
