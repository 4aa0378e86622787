"""``generate`` against ``transformers.generate`` on the same tiny random GPT-2: exact token equality.

The weights are widened to N(0, 0.3) so that greedy continuations vary and the chosen EOS tokens
occur mid-sequence (exercising finished beams, padding after EOS and early stopping). Sampling is
checked through its filters (against transformers' logits warpers, exact) and reproducibility.
"""
import pytest
import torch
import transformers
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

import attnlab
from attnlab.generation import EncoderDecoderCache, GenerationConfig, filter_logits, generate, reorder_cache
from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel, state_dict_from_hf

transformers.logging.set_verbosity_error()
V, PAD, NEW = 101, 3, 12


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                     bos_token_id=0, eos_token_id=0)
    theirs = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    ours = GPT2LMHeadModel(GPT2Config.from_hf(config.to_dict())).eval()
    ours.load_state_dict(state_dict_from_hf(theirs.state_dict()))
    return theirs, ours


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return torch.randint(1, V, (3, 7), generator=g)


def _theirs(model, ids, mask=None, **kw):
    mask = torch.ones_like(ids) if mask is None else mask
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, **kw)


def _eos_tokens(pair, prompts):
    """None, plus two tokens that greedy decoding emits mid-sequence (so EOS really triggers)."""
    ref = _theirs(pair[0], prompts)[:, prompts.shape[1]:]
    return [None, int(ref[0, 2]), int(ref[1, 5])]


def _left_padded(ids):
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    return ids.masked_fill(mask == 0, PAD), mask


@pytest.mark.parametrize("num_beams", [1, 4])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_tokens_equal_transformers(pair, prompts, num_beams, cache):
    theirs, ours = pair
    for eos in _eos_tokens(pair, prompts):
        pad = None if eos is None else PAD
        ref = _theirs(theirs, prompts, num_beams=num_beams, eos_token_id=eos, pad_token_id=pad)
        got = generate(ours, prompts, max_new_tokens=NEW, num_beams=num_beams, eos_token_id=eos,
                       pad_token_id=pad, cache=cache)
        assert got.shape == ref.shape and torch.equal(got, ref), (eos, num_beams, cache)


@pytest.mark.parametrize("num_beams", [1, 4])
def test_left_padded_batch_equals_transformers(pair, prompts, num_beams):
    theirs, ours = pair
    ids, mask = _left_padded(prompts)
    for eos in _eos_tokens(pair, prompts):
        ref = _theirs(theirs, ids, mask, num_beams=num_beams, eos_token_id=eos, pad_token_id=PAD)
        got = ours.generate(ids, attention_mask=mask, max_new_tokens=NEW, num_beams=num_beams, eos_token_id=eos,
                            pad_token_id=PAD)
        assert torch.equal(got, ref), (eos, num_beams)


def test_padding_after_eos_and_early_stop(pair, prompts):
    _, ours = pair
    eos = _eos_tokens(pair, prompts)[1]
    got = generate(ours, prompts, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=PAD)
    assert torch.equal(got[:, :prompts.shape[1]], prompts)
    new = got[:, prompts.shape[1]:]
    for row in new.tolist():
        if eos in row:
            assert all(t == PAD for t in row[row.index(eos) + 1:])
    # one prompt: generation stops right at EOS
    one = generate(ours, prompts[:1], max_new_tokens=NEW, eos_token_id=eos)
    assert one.shape[1] == prompts.shape[1] + 3 and int(one[0, -1]) == eos


def test_static_cache_equals_dynamic_with_padding(pair, prompts):
    _, ours = pair
    ids, mask = _left_padded(prompts)
    for beams in (1, 4):
        a = generate(ours, ids, attention_mask=mask, max_new_tokens=NEW, num_beams=beams, cache="dynamic")
        b = generate(ours, ids, attention_mask=mask, max_new_tokens=NEW, num_beams=beams, cache="static")
        assert torch.equal(a, b)


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(pair, prompts):
    _, ours = pair
    kw = dict(max_new_tokens=NEW, do_sample=True, temperature=0.8, top_k=20, top_p=0.9)
    a = generate(ours, prompts, generator=torch.Generator().manual_seed(5), **kw)
    b = generate(ours, prompts, generator=torch.Generator().manual_seed(5), **kw)
    c = generate(ours, prompts, generator=torch.Generator().manual_seed(6), **kw)
    assert torch.equal(a, b) and not torch.equal(a, c)
    greedy = generate(ours, prompts, max_new_tokens=NEW)
    for filt in (dict(top_k=1), dict(top_p=1e-6), dict(temperature=1e-4)):
        s = generate(ours, prompts, max_new_tokens=NEW, do_sample=True, generator=torch.Generator().manual_seed(0),
                     **filt)
        assert torch.equal(s, greedy), filt


@pytest.mark.parametrize("top_k, top_p", [(5, None), (None, 0.7), (10, 0.5), (None, 1.0), (200, None)])
def test_filter_logits_equals_transformers_warpers(top_k, top_p):
    logits = torch.randn(4, V) * 3
    ref = logits / 0.7
    if top_k is not None:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p is not None and top_p < 1.0:
        ref = TopPLogitsWarper(top_p)(None, ref)
    got = filter_logits(logits, temperature=0.7, top_k=top_k, top_p=top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    assert torch.equal(got[torch.isfinite(got)], ref[torch.isfinite(ref)])


def test_sampling_frequencies_follow_the_filtered_distribution():
    """One-token model with fixed logits: top-k=2 draws only the two best, in proportion e^z1 : e^z2."""

    class Fixed:
        def new_cache(self, *, max_length=None):
            return []

        def __call__(self, ids, *, attention_mask=None, past_key_values=None, use_cache=True):
            logits = torch.tensor([0.0, 1.0, 2.0, -1.0]).expand(ids.shape[0], ids.shape[1], 4)
            return type("Out", (), {"logits": logits})()

    ids = torch.zeros(4000, 1, dtype=torch.long)
    out = generate(Fixed(), ids, max_new_tokens=1, do_sample=True, top_k=2, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(out[:, 1], minlength=4).double() / 4000
    p2 = 1 / (1 + torch.exp(torch.tensor(-1.0, dtype=torch.float64)))  # e^2 / (e^1 + e^2)
    assert counts[0] == 0 and counts[3] == 0
    assert abs(counts[2] - p2) < 0.03  # ~4 standard errors at n = 4000


@pytest.mark.parametrize("kw, match", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=-2), "max_new_tokens"),
    (dict(max_new_tokens=2, top_p=0.0), "top_p"), (dict(max_new_tokens=2, top_p=1.5), "top_p"),
    (dict(max_new_tokens=2, num_beams=0), "num_beams"), (dict(max_new_tokens=2, temperature=0.0), "temperature"),
    (dict(max_new_tokens=2, temperature=-1.0), "temperature"), (dict(max_new_tokens=2, top_k=0), "top_k"),
    (dict(max_new_tokens=2, cache="paged"), "cache"), (dict(max_new_tokens=2, do_sample=True, num_beams=2), "num_beams"),
    (dict(max_new_tokens=2, eos_token_id=-1), "eos_token_id"),
    (dict(max_new_tokens=2, attention_mask=torch.ones(3, 2)), "attention_mask"),
])
def test_bad_arguments_raise(pair, prompts, kw, match):
    with pytest.raises(ValueError, match=match):
        generate(pair[1], prompts, **kw)


def test_bad_ids_and_too_long_raise(pair, prompts):
    _, ours = pair
    with pytest.raises(ValueError, match="input_ids"):
        generate(ours, prompts.float(), max_new_tokens=2)
    with pytest.raises(ValueError, match="input_ids"):
        generate(ours, prompts + V, max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens=60 with a 7-token prompt exceeds the model's n_positions=64"):
        generate(ours, prompts, max_new_tokens=60)
    with pytest.raises(TypeError, match="cache"):
        reorder_cache({"k": 1}, torch.tensor([0]))


def test_decoder_start_token_is_for_encoder_decoders_only(pair, prompts):
    with pytest.raises(ValueError, match="decoder_start_token_id"):
        generate(pair[1], prompts, max_new_tokens=2, decoder_start_token_id=0)
    with pytest.raises(ValueError, match="decoder_start_token_id"):
        generate(pair[1], prompts, max_new_tokens=2, decoder_start_token_id=-3)


def test_encoder_decoder_encodes_once_and_beams_carry_the_memory(monkeypatch):
    """The source is encoded once (B rows); the beams get copies of each row's memory and mask."""
    from attnlab.models.config import TransformerConfig
    from attnlab.models.transformer import Seq2SeqTransformer

    torch.manual_seed(0)
    model = Seq2SeqTransformer(TransformerConfig(src_vocab_size=11, tgt_vocab_size=9, dim=16, num_heads=2,
                                                 ffn_dim=32, num_encoder_layers=1, num_decoder_layers=1,
                                                 dropout=0.0, pad_id=0)).eval()
    calls = []
    encode = model.encode
    monkeypatch.setattr(model, "encode", lambda ids, mask: calls.append(ids.shape) or encode(ids, mask))
    src = torch.tensor([[3, 4, 5, 0], [6, 7, 8, 9]])
    out = model.generate(src, max_new_tokens=5, decoder_start_token_id=1, eos_token_id=2, num_beams=3)
    assert calls == [(2, 4)] and out[:, 0].eq(1).all()
    memory, mask = torch.arange(2.0).view(2, 1, 1).expand(2, 4, 16), (src != 0).long()
    state = EncoderDecoderCache(model.new_cache(), memory, mask)
    reorder_cache(state, torch.tensor([1, 1, 0]))
    assert state.memory[:, 0, 0].tolist() == [1.0, 1.0, 0.0] and torch.equal(state.memory_mask, mask[[1, 1, 0]])


def test_right_padding_and_models_that_cannot_generate_are_refused(pair, prompts):
    _, ours = pair
    mask = torch.ones_like(prompts)
    mask[0, -2:] = 0  # right padding: row 0 would continue from a pad token
    with pytest.raises(ValueError, match="attention_mask row 0 ends with padding"):
        generate(ours, prompts, attention_mask=mask, max_new_tokens=2)
    mask[0] = 0
    with pytest.raises(ValueError, match="a row with no token"):
        generate(ours, prompts, attention_mask=mask, max_new_tokens=2)
    from attnlab.models.bert import BertConfig, BertModel

    bert = BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=32))
    with pytest.raises(ValueError, match="BertModel cannot generate"):
        generate(bert, torch.tensor([[1, 2]]), max_new_tokens=2)


# ------------------------------------------------------------------ GenerationConfig: one record of the settings

@pytest.mark.parametrize("kw, error, match", [
    (dict(max_new_tokens=0), ValueError, "max_new_tokens must be a positive int, got 0"),
    (dict(max_new_tokens=True), ValueError, "max_new_tokens must be a positive int, got True"),
    (dict(max_new_tokens=2, temperature=0.0), ValueError, "temperature must be a positive finite number, got 0.0"),
    (dict(max_new_tokens=2, top_k=0), ValueError, "top_k must be a positive int or None, got 0"),
    (dict(max_new_tokens=2, top_p=1.5), ValueError, r"top_p must be in \(0, 1\], got 1.5"),
    (dict(max_new_tokens=2, num_beams=0), ValueError, "num_beams must be an int >= 1, got 0"),
    (dict(max_new_tokens=2, do_sample="yes"), TypeError, "do_sample must be a bool, got str"),
    (dict(max_new_tokens=2, do_sample=True, num_beams=3), ValueError, "num_beams must be 1 with do_sample=True"),
    (dict(max_new_tokens=2, length_penalty="1"), TypeError, "length_penalty must be a real number, got str"),
    (dict(max_new_tokens=2, eos_token_id=-1), ValueError, "eos_token_id must be a non-negative int or None, got -1"),
    (dict(max_new_tokens=2, pad_token_id=1.5), ValueError, "pad_token_id must be a non-negative int or None"),
    (dict(max_new_tokens=2, decoder_start_token_id=-3), ValueError, "decoder_start_token_id must be a non-negative"),
    (dict(max_new_tokens=2, cache="paged"), ValueError, "cache must be one of 'dynamic', 'static', 'window', 'crop', got 'paged'"),
])
def test_generation_config_refuses_each_bad_field_by_name(kw, error, match):
    with pytest.raises(error, match=match):
        GenerationConfig(**kw)


def test_generation_config_is_frozen_keyword_only_and_requires_max_new_tokens():
    import dataclasses

    c = GenerationConfig(max_new_tokens=4, top_k=3)
    assert (c.max_new_tokens, c.top_k, c.temperature, c.num_beams, c.cache) == (4, 3, 1.0, 1, "dynamic")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.top_k = 5
    with pytest.raises(TypeError):
        GenerationConfig(4)
    with pytest.raises(TypeError, match="max_new_tokens"):
        GenerationConfig()
    assert attnlab.GenerationConfig is GenerationConfig


def test_generate_keywords_are_the_config_fields_with_its_defaults():
    """generate's settings keep their names and defaults, which now live in GenerationConfig alone."""
    import dataclasses
    import inspect

    params = inspect.signature(generate).parameters
    fields = dataclasses.fields(GenerationConfig)
    names = [n for n in params if n not in ("model", "input_ids", "attention_mask", "generator", "config", "streamer")]
    assert names == [f.name for f in fields]
    for f in fields[1:]:
        assert repr(params[f.name].default) == repr(f.default), f.name
    assert params["generator"].default is None and params["config"].default is None


def test_for_model_fills_encoder_decoder_defaults_and_pad_from_eos():
    class EncDec:
        is_encoder_decoder = True
        generation_defaults = dict(decoder_start_token_id=0, eos_token_id=1, pad_token_id=None)

    class Decoder:
        pass

    got = GenerationConfig(max_new_tokens=2).for_model(EncDec())
    assert (got.decoder_start_token_id, got.eos_token_id, got.pad_token_id) == (0, 1, 1)
    got = GenerationConfig(max_new_tokens=2, eos_token_id=5, decoder_start_token_id=7).for_model(EncDec())
    assert (got.decoder_start_token_id, got.eos_token_id, got.pad_token_id) == (7, 5, 5)
    got = GenerationConfig(max_new_tokens=2, eos_token_id=4).for_model(Decoder())
    assert (got.decoder_start_token_id, got.eos_token_id, got.pad_token_id) == (None, 4, 4)
    assert GenerationConfig(max_new_tokens=2, eos_token_id=4, pad_token_id=6).for_model(Decoder()).pad_token_id == 6
    with pytest.raises(ValueError, match="decoder_start_token_id is only for encoder–decoder models"):
        GenerationConfig(max_new_tokens=2, decoder_start_token_id=0).for_model(Decoder())
    EncDec.generation_defaults = dict(decoder_start_token_id=None, eos_token_id=None, pad_token_id=None)
    with pytest.raises(ValueError, match="decoder_start_token_id is required: EncDec has no default"):
        GenerationConfig(max_new_tokens=2).for_model(EncDec())


@pytest.mark.parametrize("settings", [
    dict(max_new_tokens=NEW),  # greedy
    dict(max_new_tokens=NEW, do_sample=True, temperature=0.8, top_k=20, top_p=0.9),  # seeded sampling
    dict(max_new_tokens=NEW, num_beams=4, length_penalty=0.7, pad_token_id=PAD),  # beam search
    dict(max_new_tokens=NEW, cache="static", pad_token_id=PAD),
])
def test_config_and_keywords_give_identical_tokens(pair, prompts, settings):
    _, ours = pair
    ids, mask = _left_padded(prompts)
    for eos in _eos_tokens(pair, prompts):
        kw = dict(settings, eos_token_id=eos)
        a = generate(ours, ids, attention_mask=mask, generator=torch.Generator().manual_seed(3), **kw)
        b = generate(ours, ids, attention_mask=mask, generator=torch.Generator().manual_seed(3),
                     config=GenerationConfig(**kw))
        c = ours.generate(ids, attention_mask=mask, generator=torch.Generator().manual_seed(3),
                          config=GenerationConfig(**kw))
        assert a.shape[1] > ids.shape[1] and torch.equal(a, b) and torch.equal(a, c), (settings, eos)


def test_config_drives_an_encoder_decoder():
    from attnlab.models.config import TransformerConfig
    from attnlab.models.transformer import Seq2SeqTransformer

    torch.manual_seed(0)
    model = Seq2SeqTransformer(TransformerConfig(src_vocab_size=11, tgt_vocab_size=9, dim=16, num_heads=2,
                                                 ffn_dim=32, num_encoder_layers=1, num_decoder_layers=1,
                                                 dropout=0.0, pad_id=0)).eval()
    src = torch.tensor([[3, 4, 5, 0], [6, 7, 8, 9]])
    for beams in (1, 3):
        kw = dict(max_new_tokens=5, decoder_start_token_id=1, eos_token_id=2, num_beams=beams)
        a = generate(model, src, **kw)
        b = generate(model, src, config=GenerationConfig(**kw))
        assert a[:, 0].eq(1).all() and torch.equal(a, b), beams


def test_keywords_override_the_config_fields(pair, prompts):
    _, ours = pair
    eos = _eos_tokens(pair, prompts)[1]
    beam = GenerationConfig(max_new_tokens=NEW, num_beams=4, eos_token_id=eos, pad_token_id=PAD)
    assert torch.equal(generate(ours, prompts, config=beam, num_beams=1),
                       generate(ours, prompts, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=PAD))
    assert torch.equal(generate(ours, prompts, config=beam, max_new_tokens=3),
                       generate(ours, prompts, max_new_tokens=3, num_beams=4, eos_token_id=eos, pad_token_id=PAD))
    # an explicit None overrides too: no EOS, so every row runs for max_new_tokens
    assert generate(ours, prompts, config=beam, eos_token_id=None).shape == (3, prompts.shape[1] + NEW)
    assert beam.num_beams == 4 and beam.max_new_tokens == NEW  # the config itself is untouched
    with pytest.raises(ValueError, match="top_k must be a positive int or None, got 0"):
        generate(ours, prompts, config=beam, top_k=0)  # the merged settings are checked too
    with pytest.raises(ValueError, match="num_beams must be 1 with do_sample=True"):
        generate(ours, prompts, config=beam, do_sample=True)


def test_generate_needs_max_new_tokens_and_a_real_config(pair, prompts):
    _, ours = pair
    with pytest.raises(TypeError, match="generate\\(\\) missing 1 required keyword-only argument: 'max_new_tokens'"):
        generate(ours, prompts)
    with pytest.raises(TypeError, match="config must be a GenerationConfig or None, got dict"):
        generate(ours, prompts, config=dict(max_new_tokens=2))
    with pytest.raises(ValueError, match="input_ids"):  # the prompt is checked first, as before
        generate(ours, prompts.float(), config=GenerationConfig(max_new_tokens=2))


def test_streamer_sees_every_new_token_in_order(pair, prompts):
    _, ours = pair
    ids = prompts
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    seen = []
    out = generate(ours, ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None,
                   streamer=lambda t: seen.append(t.clone()))
    assert torch.equal(torch.stack(seen, 1), out[:, ids.shape[1]:])
    with pytest.raises(ValueError, match="streamer is for greedy decoding and sampling"):
        generate(ours, ids, attention_mask=mask, max_new_tokens=2, num_beams=2, streamer=print)
    with pytest.raises(TypeError, match="streamer must be callable"):
        generate(ours, ids, max_new_tokens=2, streamer=3)
