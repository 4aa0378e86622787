"""Encoder / decoder layers against torch.nn.Transformer{Encoder,Decoder}Layer, caches, stochastic depth.

Parity: float32, eval, dropout 0, weights copied with ``from_torch``; tolerance atol = rtol = 1e-5.
torch's layers are called with grad enabled, which keeps them off their fused fast path (that
path needs ``torch.is_grad_enabled()`` False), so every position can be compared;
``test_encoder_matches_torch_fast_path_on_real_tokens`` checks the fast path on the non-padded
positions only (it may return anything, e.g. zeros, at padded ones).
"""
import pytest
import torch
from torch import nn

from attnlab.nn.block import AttentionWeights, DecoderLayer, DropPath, EncoderLayer, LayerCache

TOL = dict(atol=1e-5, rtol=1e-5)
B, L, S, E, H, FF = 3, 7, 5, 16, 4, 32


def _padding(batch, length, lengths):
    return torch.arange(length)[None, :] >= torch.tensor(lengths)[:, None]  # True = padding


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer_matches_torch(norm_first, activation):
    theirs = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, activation=activation, batch_first=True,
                                        norm_first=norm_first).eval()
    ours = EncoderLayer.from_torch(theirs)
    assert ours.ffn.activation == activation and ours.norm_first == norm_first and not ours.training
    x = torch.randn(B, L, E)
    kpm = _padding(B, L, [7, 4, 2])
    expected = theirs(x, src_key_padding_mask=kpm)  # grad enabled: torch's slow, exact path
    torch.testing.assert_close(ours(x, key_padding_mask=kpm), expected, **TOL)
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    torch.testing.assert_close(ours(x, is_causal=True), theirs(x, src_mask=causal), **TOL)


def test_encoder_matches_torch_fast_path_on_real_tokens():
    theirs = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True).eval()
    ours = EncoderLayer.from_torch(theirs)
    x = torch.randn(B, L, E)
    kpm = _padding(B, L, [7, 4, 2])
    with torch.no_grad():
        expected, got = theirs(x, src_key_padding_mask=kpm), ours(x, key_padding_mask=kpm)
    torch.testing.assert_close(got[~kpm], expected[~kpm], **TOL)


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer_matches_torch(norm_first):
    theirs = nn.TransformerDecoderLayer(E, H, FF, dropout=0.0, batch_first=True, norm_first=norm_first).eval()
    ours = DecoderLayer.from_torch(theirs)
    x, memory = torch.randn(B, L, E), torch.randn(B, S, E)
    mem_kpm = _padding(B, S, [5, 3, 1])
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    expected = theirs(x, memory, tgt_mask=causal, memory_key_padding_mask=mem_kpm)
    torch.testing.assert_close(ours(x, memory, memory_key_padding_mask=mem_kpm), expected, **TOL)
    got = ours(x, memory, tgt_mask=causal, is_causal=False, memory_key_padding_mask=mem_kpm)
    torch.testing.assert_close(got, expected, **TOL)


def test_attention_weights_match_torch_multihead_attention():
    theirs = nn.TransformerDecoderLayer(E, H, FF, dropout=0.0, batch_first=True).eval()
    ours = DecoderLayer.from_torch(theirs)
    x, memory = torch.randn(B, L, E), torch.randn(B, S, E)
    mem_kpm = _padding(B, S, [5, 3, 1])
    out, weights = ours(x, memory, memory_key_padding_mask=mem_kpm, need_weights=True)
    assert isinstance(weights, AttentionWeights)
    torch.testing.assert_close(out, ours(x, memory, memory_key_padding_mask=mem_kpm), **TOL)
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    _, expected_self = theirs.self_attn(x, x, x, attn_mask=causal, average_attn_weights=False)
    torch.testing.assert_close(weights.self_attn, expected_self, **TOL)  # post-norm: input is x itself
    h = theirs.norm1(x + theirs.self_attn(x, x, x, attn_mask=causal)[0])
    _, expected_cross = theirs.multihead_attn(h, memory, memory, key_padding_mask=mem_kpm, average_attn_weights=False)
    assert weights.cross_attn.shape == (B, H, L, S)
    torch.testing.assert_close(weights.cross_attn, expected_cross, **TOL)
    assert weights.cross_attn[2, :, :, 1:].abs().max() == 0  # padded memory gets no weight

    enc = EncoderLayer(E, H, ffn_dim=FF, dropout=0.0).eval()
    _, w = enc(x, key_padding_mask=_padding(B, L, [7, 4, 2]), need_weights=True)
    assert w.self_attn.shape == (B, H, L, L) and w.cross_attn is None
    torch.testing.assert_close(w.self_attn.sum(-1), torch.ones(B, H, L), **TOL)


@pytest.mark.parametrize("max_length", [None, L])
def test_decoder_layer_cache_matches_full_forward(max_length):
    layer = DecoderLayer(E, H, ffn_dim=FF, dropout=0.0, norm_first=True, num_kv_heads=2).eval()
    x, memory = torch.randn(B, L, E), torch.randn(B, S, E)
    mem_kpm = _padding(B, S, [5, 3, 1])
    full = layer(x, memory, memory_key_padding_mask=mem_kpm)
    cache = LayerCache.create(max_length=max_length)
    steps = [layer(x[:, :3], memory, memory_key_padding_mask=mem_kpm, cache=cache)]  # a 3-token prompt first
    for t in range(3, L):
        steps.append(layer(x[:, t:t + 1], memory, memory_key_padding_mask=mem_kpm, cache=cache))
    assert cache.self_attn.length == L and cache.cross_attn.length == S
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **TOL)


def test_decoder_only_layer_equals_causal_encoder_layer():
    enc = EncoderLayer(E, H, ffn_dim=FF, dropout=0.0, activation="swiglu", norm="rmsnorm", norm_first=True).eval()
    dec = DecoderLayer(E, H, ffn_dim=FF, dropout=0.0, activation="swiglu", norm="rmsnorm", norm_first=True,
                       cross_attention=False).eval()
    assert dec.cross_attn is None and not hasattr(dec, "norm3")
    dec.load_state_dict(enc.state_dict())
    x = torch.randn(B, L, E)
    torch.testing.assert_close(dec(x), enc(x, is_causal=True), **TOL)
    with pytest.raises(ValueError, match="memory"):
        dec(x, torch.randn(B, S, E))
    with pytest.raises(ValueError, match="memory"):
        DecoderLayer(E, H, ffn_dim=FF)(x)


def test_drop_path_statistics_and_eval_identity():
    torch.manual_seed(1)
    dp = DropPath(0.3).train()
    out = dp(torch.ones(20000, 2, 3))
    per_sample = out[:, 0, 0]
    assert torch.all(out == per_sample[:, None, None])  # whole samples kept or dropped
    assert per_sample.unique().tolist() == pytest.approx([0.0, 1 / 0.7])
    assert abs((per_sample == 0).float().mean().item() - 0.3) < 0.01  # 3-sigma is 0.0097
    assert abs(per_sample.mean().item() - 1.0) < 0.02  # unbiased
    x = torch.randn(4, 5)
    assert torch.equal(dp.eval()(x), x)


def test_layer_drop_path_drops_whole_branches_per_sample():
    torch.manual_seed(2)
    layer = EncoderLayer(E, H, ffn_dim=FF, dropout=0.0, norm_first=True, drop_path=0.5)
    plain = EncoderLayer(E, H, ffn_dim=FF, dropout=0.0, norm_first=True)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(400, 3, E)
    torch.testing.assert_close(layer.eval()(x), plain.eval()(x), **TOL)  # identity in eval
    with torch.no_grad():  # silence the FFN branch: then each sample is x or x + 2·Attn(LN(x))
        layer.ffn.w2.weight.zero_()
        layer.ffn.w2.bias.zero_()
        kept = x + 2 * layer.self_attn(layer.norm1(x), layer.norm1(x), layer.norm1(x))[0]
        out = layer.train()(x)
    dropped_rows = (out - x).abs().amax(dim=(1, 2)) < 1e-6
    kept_rows = (out - kept).abs().amax(dim=(1, 2)) < 1e-5
    assert torch.all(dropped_rows ^ kept_rows)
    assert 0.4 < dropped_rows.float().mean().item() < 0.6  # p = 0.5, n = 400: 4 sigma


@pytest.mark.parametrize("kwargs, name", [
    (dict(dropout=1.5), "dropout"), (dict(attn_dropout=-0.1), "attn_dropout"), (dict(drop_path=1.0), "drop_path"),
    (dict(norm="batchnorm"), "norm"), (dict(activation="tanh"), "activation"), (dict(ffn_dim=0), "dim"),
])
def test_layers_reject_bad_arguments(kwargs, name):
    args = dict(ffn_dim=FF) | kwargs
    with pytest.raises(ValueError, match=name):
        EncoderLayer(E, H, **args)
    with pytest.raises(ValueError, match=name):
        DecoderLayer(E, H, **args)
    with pytest.raises(TypeError, match="norm_first"):
        EncoderLayer(E, H, ffn_dim=FF, norm_first="yes")


def test_ffn_dropout_defaults_to_dropout_and_is_checked():
    from attnlab.nn.block import DecoderLayer, EncoderLayer
    assert EncoderLayer(8, 2, ffn_dim=16, dropout=0.2).ffn.dropout.p == 0.2  # torch.nn.Transformer's placement
    assert EncoderLayer(8, 2, ffn_dim=16, dropout=0.2, ffn_dropout=0.0).ffn.dropout.p == 0.0
    assert DecoderLayer(8, 2, ffn_dim=16, dropout=0.2, ffn_dropout=0.05).ffn.dropout.p == 0.05
    with pytest.raises(ValueError, match="ffn_dropout"):
        EncoderLayer(8, 2, ffn_dim=16, ffn_dropout=1.5)
