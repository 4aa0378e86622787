"""Transformer stacks against torch.nn.Transformer; Seq2SeqTransformer's KV-cache decoding,
generation (against uncached greedy decoding and an exhaustive search) and attentions; config checks.

Tolerances: atol = rtol = 1e-5 in float32 (eval, dropout 0). torch's modules are called with grad
enabled, which keeps them off their fused fast path, so every position is compared.
"""
import itertools
import json
import warnings

import pytest
import torch
from torch import nn

from attnlab.models.config import TransformerConfig
from attnlab.models.transformer import Seq2SeqTransformer, Transformer

TOL = dict(atol=1e-5, rtol=1e-5)
E, H, FF = 16, 4, 32
PAD, BOS, EOS = 0, 1, 2


def _config(**overrides):
    base = dict(src_vocab_size=20, tgt_vocab_size=17, dim=E, num_heads=H, ffn_dim=FF, num_encoder_layers=2,
                num_decoder_layers=2, dropout=0.0, max_positions=32)
    return TransformerConfig(**(base | overrides))


def _src():
    src = torch.randint(3, 20, (3, 6))
    src[1, 4:] = PAD
    src[2, 2:] = PAD
    return src


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_matches_torch_end_to_end(norm_first):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that norm_first disables its nested-tensor path
        theirs = nn.Transformer(E, H, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=FF, dropout=0.0,
                                batch_first=True, norm_first=norm_first).eval()
    ours = Transformer.from_torch(theirs)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
    src, tgt = torch.randn(3, 6, E), torch.randn(3, 5, E)
    src_kpm = torch.arange(6)[None] >= torch.tensor([6, 4, 2])[:, None]
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    expected = theirs(src, tgt, tgt_mask=causal, src_key_padding_mask=src_kpm, memory_key_padding_mask=src_kpm)
    got = ours(src, tgt, src_key_padding_mask=src_kpm, memory_key_padding_mask=src_kpm)
    torch.testing.assert_close(got, expected, **TOL)


def test_transformer_defaults_mirror_torch_shapes():
    ours = Transformer(E, H, num_encoder_layers=1, num_decoder_layers=3, ffn_dim=FF)
    assert len(ours.encoder.layers) == 1 and len(ours.decoder.layers) == 3
    assert isinstance(ours.encoder.norm, nn.LayerNorm) and isinstance(ours.decoder.norm, nn.LayerNorm)
    assert ours(torch.randn(2, 4, E), torch.randn(2, 3, E)).shape == (2, 3, E)


@pytest.mark.parametrize("position", ["sinusoidal", "learned", "rope", "alibi", "t5", "none"])
def test_cached_decoding_matches_full_forward(position):
    model = Seq2SeqTransformer(_config(position=position, norm_first=position in ("rope", "t5"))).eval()
    src, tgt = _src(), torch.randint(3, 17, (3, 7))
    full = model(src, tgt)  # (B, T, V)
    src_mask = (src != PAD).long()
    memory = model.encode(src, src_mask)
    torch.testing.assert_close(memory, model.encode(src), **TOL)  # the 1/0 mask = the pad_id default
    for max_length in (None, 7):  # growing, then static (preallocated) cache
        cache = model.new_cache(max_length=max_length)
        steps = [model.decode(tgt[:, t:t + 1], memory, attention_mask=src_mask, cache=cache) for t in range(7)]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, **TOL)


def _greedy_without_cache(model, src, max_len):
    ids = torch.full((src.shape[0], 1), BOS)
    done = torch.zeros(src.shape[0], dtype=torch.bool)
    for _ in range(max_len):
        token = model(src, ids)[:, -1].argmax(-1).masked_fill(done, PAD)
        ids = torch.cat([ids, token[:, None]], dim=1)
        done |= token == EOS
        if done.all():
            break
    return ids


@pytest.mark.parametrize("position", ["sinusoidal", "rope"])
def test_generate_matches_uncached_greedy_and_static_cache(position):
    model = Seq2SeqTransformer(_config(position=position, tgt_vocab_size=6)).eval()
    src = _src()
    ids = model.generate(src, max_new_tokens=9, decoder_start_token_id=BOS, eos_token_id=EOS)
    assert ids[:, 0].eq(BOS).all() and ids.shape[1] <= 10
    assert torch.equal(ids, _greedy_without_cache(model, src, 9))
    assert torch.equal(model.generate(src, max_new_tokens=9, decoder_start_token_id=BOS, eos_token_id=EOS,
                                      cache="static"), ids)
    assert torch.equal(model.generate(src, max_new_tokens=9, decoder_start_token_id=BOS, eos_token_id=EOS,
                                      num_beams=1), ids)


def _sequence_logp(model, src, seqs):
    """Σ_t log p(y_t | y_<t, x) of each target ``seqs[i] = [BOS, y_1, …]`` by teacher forcing."""
    out = []
    for i, seq in enumerate(seqs):
        y = torch.tensor([seq])
        logp = model(src[i:i + 1], y[:, :-1]).log_softmax(-1)  # (1, T, V)
        out.append(float(logp[0].gather(1, y[0, 1:, None]).sum()))
    return out


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
@torch.no_grad()
def test_beam_search_equals_exhaustive_search_on_a_tiny_vocabulary(length_penalty):
    """V = 3 target tokens, 3 new tokens: 16 beams hold every live prefix and every finished hypothesis,
    so beam search is exact: its answer is the argmax over all sequences of Σ log p / len^α."""
    torch.manual_seed(0)
    model = Seq2SeqTransformer(_config(tgt_vocab_size=3, pad_id=None)).eval()
    with torch.no_grad():  # sharper distributions, so the optimum is not the greedy path by accident
        model.tgt_embed.weight.mul_(4)
    src = torch.randint(3, 20, (12, 5))
    got = model.generate(src, max_new_tokens=3, decoder_start_token_id=BOS, eos_token_id=EOS, num_beams=16,
                         length_penalty=length_penalty)
    greedy = model.generate(src, max_new_tokens=3, decoder_start_token_id=BOS, eos_token_id=EOS)
    # every hypothesis: ends at EOS, or runs to max_new_tokens
    hyps = [[BOS, *p, EOS] for n in range(3) for p in itertools.product([0, 1], repeat=n)]
    hyps += [[BOS, *p, last] for p in itertools.product([0, 1], repeat=2) for last in range(3)]
    differs = False
    for i in range(src.shape[0]):
        scores = _sequence_logp(model, src[i:i + 1].expand(len(hyps), -1), hyps)
        best = max(range(len(hyps)), key=lambda j: scores[j] / (len(hyps[j]) - 1) ** length_penalty)
        row = got[i].tolist()
        row = row[:row.index(EOS) + 1] if EOS in row else row
        assert row == hyps[best], i
        g = greedy[i].tolist()
        differs |= row != (g[:g.index(EOS) + 1] if EOS in g else g)
    assert differs  # the search found something greedy decoding did not


@torch.no_grad()
def test_output_attentions_match_the_reference_decoder_weights():
    model = Seq2SeqTransformer(_config(tgt_vocab_size=6, position="alibi")).eval()
    src, tgt = _src(), torch.randint(3, 6, (3, 5))
    out = model(src, tgt, output_attentions=True)
    torch.testing.assert_close(out.logits, model(src, tgt), **TOL)
    assert len(out.encoder_attentions) == len(out.decoder_attentions) == len(out.cross_attentions) == 2
    assert out.cross_attentions[0].shape == (3, H, 5, 6)
    assert out.cross_attentions[1][2, ..., 2:].abs().max() == 0  # padded source positions get no weight
    memory, kpm = model.encode(src), model.padding_mask(src)
    _, weights = model.decoder(model.embed_target(tgt), memory, memory_key_padding_mask=kpm, need_weights=True)
    for i, w in enumerate(weights):  # the materialising reference path
        torch.testing.assert_close(out.decoder_attentions[i], w.self_attn, **TOL)
        torch.testing.assert_close(out.cross_attentions[i], w.cross_attn, **TOL)
    _, enc_weights = model.encoder(model.embed_source(src), key_padding_mask=kpm, need_weights=True)
    for i, w in enumerate(enc_weights):
        torch.testing.assert_close(out.encoder_attentions[i], w.self_attn, **TOL)


def test_generate_arguments_are_checked():
    model = Seq2SeqTransformer(_config()).eval()
    from attnlab.generation import GenerationConfig, generate

    for run in (lambda: model.generate(_src(), max_new_tokens=3), lambda: generate(model, _src(), max_new_tokens=3)):
        with pytest.raises(ValueError, match="decoder_start_token_id is required"):  # the model names no default
            run()
    # a config's start and end tokens are used (a keyword given wins): the same ids as the keywords
    config = GenerationConfig(max_new_tokens=4, decoder_start_token_id=BOS, eos_token_id=3)
    src = _src()
    assert torch.equal(model.generate(src, config=config),
                       model.generate(src, max_new_tokens=4, decoder_start_token_id=BOS, eos_token_id=3))
    assert torch.equal(model.generate(src, config=config, eos_token_id=None),
                       model.generate(src, max_new_tokens=4, decoder_start_token_id=BOS))
    with pytest.raises(ValueError, match="vocab_size=20"):
        model.generate(_src() + 20, max_new_tokens=3, decoder_start_token_id=BOS)
    with pytest.raises(ValueError, match="not both"):
        model.encode(_src(), torch.ones(3, 6), src_key_padding_mask=model.padding_mask(_src()))


def test_embeddings_tied_and_padding_and_positions_limit():
    model = Seq2SeqTransformer(_config())
    assert model.out_proj.weight is model.tgt_embed.weight
    assert model.tgt_embed.weight[PAD].abs().max() == 0
    untied = Seq2SeqTransformer(_config(tie_embeddings=False, pad_id=None))
    assert untied.out_proj.weight is not untied.tgt_embed.weight and untied.padding_mask(_src()) is None
    with pytest.raises(ValueError, match="max_positions"):
        model(_src(), torch.randint(3, 17, (3, 33)))


def test_drop_path_schedule_identity_in_eval_and_random_in_train():
    model = Seq2SeqTransformer(_config(drop_path=0.4, num_encoder_layers=3))
    assert [l.drop_path.p for l in model.encoder.layers] == pytest.approx([0.0, 0.2, 0.4])
    assert [l.drop_path.p for l in model.decoder.layers] == pytest.approx([0.0, 0.4])
    plain = Seq2SeqTransformer(_config(num_encoder_layers=3))
    plain.load_state_dict(model.state_dict())
    src, tgt = _src(), torch.randint(3, 17, (3, 5))
    torch.testing.assert_close(model.eval()(src, tgt), plain.eval()(src, tgt), **TOL)
    model.train()
    assert not torch.allclose(model(src, tgt), model(src, tgt))


@pytest.mark.parametrize("norm_first", [False, True])
def test_copy_task_loss_falls(norm_first):
    torch.manual_seed(0)
    cfg = _config(src_vocab_size=12, tgt_vocab_size=12, dim=32, ffn_dim=64, norm_first=norm_first, dropout=0.1)
    model = Seq2SeqTransformer(cfg).train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        src = torch.randint(3, 12, (32, 6))
        tgt_in = torch.cat([torch.full((32, 1), BOS), src], dim=1)
        tgt_out = torch.cat([src, torch.full((32, 1), EOS)], dim=1)
        loss = nn.functional.cross_entropy(model(src, tgt_in).transpose(1, 2), tgt_out)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5  # observed ratio ≈ 0.65


def test_config_round_trip_and_unknown_keys():
    cfg = _config(position="rope", activation="swiglu", norm="rmsnorm", num_kv_heads=2)
    data = json.loads(json.dumps(cfg.to_dict()))
    assert TransformerConfig.from_dict(data) == cfg
    assert TransformerConfig(src_vocab_size=9).tgt_vocab_size == 9
    with pytest.raises(ValueError, match=r"unknown TransformerConfig keys \['d_model'\].*num_heads"):
        TransformerConfig.from_dict(data | {"d_model": 8})


@pytest.mark.parametrize("field, value", [
    ("dim", 0), ("num_heads", 3), ("num_kv_heads", 3), ("ffn_dim", -1), ("num_encoder_layers", 0),
    ("num_decoder_layers", 1.5), ("tgt_vocab_size", 0), ("max_positions", 0), ("dropout", 1.0),
    ("attn_dropout", -0.1), ("drop_path", 2), ("activation", "tanh"), ("norm", "batchnorm"),
    ("position", "absolute"), ("norm_eps", 0), ("norm_first", "yes"), ("tie_embeddings", 1),
    ("pad_id", 17), ("backend", "nope"),
])
def test_config_rejects_bad_fields(field, value):
    with pytest.raises(ValueError, match=field):
        _config(**{field: value})


def test_seq2seq_runs_with_gqa_rmsnorm_swiglu_and_needs_config():
    model = Seq2SeqTransformer(_config(num_kv_heads=2, norm="rmsnorm", activation="swiglu", norm_first=True))
    assert model(_src(), torch.randint(3, 17, (3, 4))).shape == (3, 4, 17)
    with pytest.raises(TypeError, match="TransformerConfig"):
        Seq2SeqTransformer({"src_vocab_size": 10})
