"""LayerSpec: the one place the layer options are held and checked; from_spec builds the same layer."""
import dataclasses

import pytest
import torch

from attnlab.nn.block import DecoderLayer, EncoderLayer, LayerSpec
from attnlab.nn.positional import RotaryEmbedding

E, H, FF = 16, 4, 32


@pytest.mark.parametrize("kwargs, error, name", [
    (dict(dim=0), ValueError, "dim"), (dict(num_heads=-1), ValueError, "num_heads"),
    (dict(ffn_dim=0), ValueError, "ffn_dim"), (dict(activation="tanh"), ValueError, "activation"),
    (dict(dropout=1.5), ValueError, "dropout"), (dict(attn_dropout=-0.1), ValueError, "attn_dropout"),
    (dict(ffn_dropout=1.0), ValueError, "ffn_dropout"), (dict(norm_first="yes"), TypeError, "norm_first"),
    (dict(norm="batchnorm"), ValueError, "norm"), (dict(norm_eps=0.0), ValueError, "norm_eps"),
    (dict(drop_path=1.0), ValueError, "drop_path"), (dict(dropout=True), ValueError, "dropout"),
])
def test_spec_rejects_each_bad_option_naming_it(kwargs, error, name):
    args = dict(dim=E, num_heads=H, ffn_dim=FF) | kwargs
    with pytest.raises(error, match=rf"^{name} must be"):
        LayerSpec(**args)
    dim, heads = args.pop("dim"), args.pop("num_heads")
    with pytest.raises(error, match=rf"^{name} must be"):  # the layers check through the spec
        EncoderLayer(dim, heads, **args)
    with pytest.raises(error, match=rf"^{name} must be"):
        DecoderLayer(dim, heads, **args)


def test_spec_defaults_and_resolved_dropouts():
    spec = LayerSpec(E, H, ffn_dim=FF, dropout=0.2)
    assert (spec.activation, spec.norm, spec.norm_eps, spec.norm_first, spec.bias, spec.backend) == \
        ("relu", "layernorm", 1e-5, False, True, "auto")
    assert spec.resolved_attn_dropout == 0.2 and spec.resolved_ffn_dropout == 0.2
    spec = LayerSpec(E, H, ffn_dim=FF, dropout=0.2, attn_dropout=0.0, ffn_dropout=0.05)
    assert spec.resolved_attn_dropout == 0.0 and spec.resolved_ffn_dropout == 0.05
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.dropout = 0.3
    with pytest.raises(ValueError, match="drop_path"):  # replace re-checks
        dataclasses.replace(spec, drop_path=2.0)
    with pytest.raises(TypeError):  # options are keyword-only
        LayerSpec(E, H, FF)


def test_unknown_keyword_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match=r"EncoderLayer\(\) got an unexpected keyword argument 'heads'"):
        EncoderLayer(E, H, ffn_dim=FF, heads=2)
    with pytest.raises(TypeError, match=r"DecoderLayer\(\) got an unexpected keyword argument 'cross'"):
        DecoderLayer(E, H, ffn_dim=FF, cross=False)
    with pytest.raises(TypeError, match="unexpected keyword argument 'heads'"):
        LayerSpec(E, H, ffn_dim=FF, heads=2)
    with pytest.raises(TypeError, match="ffn_dim"):  # still required
        EncoderLayer(E, H)
    with pytest.raises(TypeError, match="spec must be a LayerSpec, got dict"):
        EncoderLayer.from_spec(dict(dim=E, num_heads=H, ffn_dim=FF))
    with pytest.raises(TypeError, match="cross_attention"):
        DecoderLayer.from_spec(LayerSpec(E, H, ffn_dim=FF), cross_attention=1)


def _built_with_seed(build):
    torch.manual_seed(0)
    return build().eval()


@pytest.mark.parametrize("options", [
    dict(ffn_dim=FF, dropout=0.0),
    dict(ffn_dim=FF, dropout=0.0, norm_first=True, norm="rmsnorm", activation="swiglu", num_kv_heads=2, bias=False),
    dict(ffn_dim=FF, dropout=0.0, head_dim=8, scale=1.0, activation="gelu", norm_eps=1e-6),
])
@pytest.mark.parametrize("cross_attention", [None, True, False])  # None: EncoderLayer
def test_from_spec_equals_keyword_construction(options, cross_attention):
    spec = LayerSpec(E, H, **options)
    if cross_attention is None:
        by_kw = _built_with_seed(lambda: EncoderLayer(E, H, **options))
        by_spec = _built_with_seed(lambda: EncoderLayer.from_spec(spec))
    else:
        by_kw = _built_with_seed(lambda: DecoderLayer(E, H, cross_attention=cross_attention, **options))
        by_spec = _built_with_seed(lambda: DecoderLayer.from_spec(spec, cross_attention=cross_attention))
        assert (by_spec.cross_attn is not None) == cross_attention
    assert by_spec.spec == by_kw.spec == spec
    ours, theirs = by_spec.state_dict(), by_kw.state_dict()
    assert list(ours) == list(theirs)
    for name in ours:
        assert ours[name].shape == theirs[name].shape and torch.equal(ours[name], theirs[name]), name
    x, memory = torch.randn(2, 5, E), torch.randn(2, 3, E)
    args = () if not cross_attention else (memory,)
    assert torch.equal(by_spec(x, *args), by_kw(x, *args))  # same weights, same operations: bit-equal


def test_spec_shares_its_modules_and_stacks_share_one_spec():
    rope = RotaryEmbedding(E // H, max_positions=16)
    spec = LayerSpec(E, H, ffn_dim=FF, rotary=rope)
    assert spec.options()["rotary"] is rope and set(spec.options()) | {"dim", "num_heads"} == \
        {f.name for f in dataclasses.fields(LayerSpec)}
    layers = [DecoderLayer.from_spec(spec, cross_attention=False) for _ in range(2)]
    assert all(layer.self_attn.rotary is rope for layer in layers)
    assert layers[0].ffn.w1.weight.data_ptr() != layers[1].ffn.w1.weight.data_ptr()  # weights are not shared


def test_help_points_to_layer_spec():
    assert "LayerSpec" in EncoderLayer.__doc__ and "LayerSpec" in DecoderLayer.__doc__
