"""Transformer stacks against torch.nn.Transformer; Seq2SeqTransformer's KV-cache decoding; config checks.

Tolerances: atol = rtol = 1e-5 in float32 (eval, dropout 0). torch's modules are called with grad
enabled, which keeps them off their fused fast path, so every position is compared.
"""
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
    memory = model.encode(src)
    for max_length in (None, 7):  # growing, then static (preallocated) cache
        cache = model.decoder.new_cache(max_length=max_length)
        kpm = model.padding_mask(src)
        steps = [model.decode_step(tgt[:, t:t + 1], memory, cache=cache, memory_key_padding_mask=kpm) for t in range(7)]
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
def test_greedy_decode_matches_uncached_greedy_and_static_cache(position):
    model = Seq2SeqTransformer(_config(position=position, tgt_vocab_size=6)).eval()
    src = _src()
    ids = model.greedy_decode(src, max_len=9, bos_id=BOS, eos_id=EOS)
    assert ids[:, 0].eq(BOS).all() and ids.shape[1] <= 10
    assert torch.equal(ids, _greedy_without_cache(model, src, 9))
    assert torch.equal(model.greedy_decode(src, max_len=9, bos_id=BOS, eos_id=EOS, static_cache=True), ids)


def test_greedy_cross_attention_weights_match_full_decoder():
    model = Seq2SeqTransformer(_config(tgt_vocab_size=6)).eval()
    src = _src()
    ids, cross = model.greedy_decode(src, max_len=5, bos_id=BOS, eos_id=EOS, return_cross_attention=True)
    T = ids.shape[1] - 1
    assert cross.shape == (3, 2, H, T, 6)
    torch.testing.assert_close(cross.sum(-1), torch.ones(3, 2, H, T), **TOL)
    assert cross[2, ..., 2:].abs().max() == 0  # padded source positions get no weight
    memory, kpm = model.encode(src), model.padding_mask(src)
    x = model.embed_target(ids[:, :-1])
    _, weights = model.decoder(x, memory, memory_key_padding_mask=kpm, need_weights=True)
    expected = torch.stack([w.cross_attn for w in weights], dim=1)  # (B, layers, H, T, S)
    torch.testing.assert_close(cross, expected, **TOL)


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
