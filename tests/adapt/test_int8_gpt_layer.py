"""A GPT decoder layer with int8 products trains as one C++ node (attnlab._native_train.gpt_block_train) with the
bits of its modules' pipeline, and steps aside to that pipeline wherever the modules would not make its calls."""
import pytest
import torch
from torch import nn

from attnlab import _native_train
from attnlab.adapt import int8_training as I
from _native_isas import ISA_IDS, ISAS, isa, needs_native  # noqa: F401 (isa: a fixture)


def _gpt_layer(C: int, heads: int, *, bias: bool = True, activation: str = "gelu", seed: int = 0) -> nn.Module:
    """A pre-norm decoder-only layer with int8 products, in training mode."""
    from attnlab.nn.block import DecoderLayer
    torch.manual_seed(seed)
    layer = DecoderLayer(C, heads, ffn_dim=4 * C, cross_attention=False, norm_first=True, dropout=0.0, bias=bias,
                         activation=activation)
    with torch.no_grad():  # LayerNorm's parameters away from 1 and 0, so their gradients are tested
        for p in layer.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape) * 0.1)
    I.int8_training(layer, skip=())
    return layer.train()


def _fused_calls(monkeypatch) -> list:
    calls = []
    fn = _native_train.gpt_block_train
    monkeypatch.setattr(_native_train, "gpt_block_train", lambda *a, **k: calls.append(1) or fn(*a, **k))
    return calls


def _layer_grads(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> tuple:
    xr = x.clone().requires_grad_()
    y = layer(xr)
    grads = torch.autograd.grad(y, (xr, *layer.parameters()), dy)
    return y.detach(), grads


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True, ids=ISA_IDS.get)
@pytest.mark.parametrize("B,L,C,heads,bias,activation", [(3, 17, 32, 2, True, "gelu"), (2, 64, 64, 4, True, "gelu"),
                                                         (2, 9, 48, 3, False, "relu"), (1, 5, 32, 4, True, "gelu_tanh"),
                                                         (2, 7, 40, 2, False, "gelu"), (3, 6, 36, 3, True, "gelu"),
                                                         (2, 5, 35, 5, True, "gelu"), (1, 6, 34, 2, False, "relu")])
def test_a_gpt_layer_trains_as_one_node_with_the_bits_of_its_modules(isa, B, L, C, heads, bias, activation,
                                                                    monkeypatch):
    """``DecoderLayer._train_native``: LN, int8 qkv, causal short attention, int8 out, residual, LN, int8 FFN with the
    kept activation, residual — the modules' own calls in one C++ node (the residuals added in the products'
    rescaling, widths 40 and 36: a last panel of 8 and of 4 columns; widths 35 and 34: panels of 3 and 2 columns, the
    scalar tails, and FFN widths 140 and 136, a last panel of 12 and of 8); output and every gradient the same bits."""
    from attnlab.nn.block import DecoderLayer
    layer = _gpt_layer(C, heads, bias=bias, activation=activation)
    gen = torch.Generator().manual_seed(3)
    x, dy = torch.randn(B, L, C, generator=gen), torch.randn(B, L, C, generator=gen)
    calls = _fused_calls(monkeypatch)
    y, grads = _layer_grads(layer, x, dy)
    assert calls == [1]
    monkeypatch.setattr(DecoderLayer, "_train_native", lambda self, x: None)
    y_ref, grads_ref = _layer_grads(layer, x, dy)
    assert calls == [1] and torch.equal(y, y_ref)
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    for name, got, want in zip(names, grads, grads_ref):
        assert got is not None and torch.equal(got, want), name


@needs_native
def test_the_one_node_layer_keeps_its_graph_for_a_second_backward_and_refuses_a_second_order(monkeypatch):
    layer = _gpt_layer(32, 2)
    calls = _fused_calls(monkeypatch)
    x = torch.randn(2, 8, 32, requires_grad=True)
    y = layer(x)
    first = torch.autograd.grad(y.square().sum(), x, retain_graph=True)[0]
    again = torch.autograd.grad(y.square().sum(), x)[0]
    assert calls == [1] and torch.equal(first, again)
    with pytest.raises(RuntimeError, match="the GPT block's one-node training pass .* has no second derivative"):
        torch.autograd.grad(layer(x).sum(), x, create_graph=True)


@needs_native
@pytest.mark.parametrize("case", ["eval", "no_grad", "dropout", "hook", "dropout_hook", "frozen", "autocast",
                                  "float_linear", "subclass", "eval_linear", "not_causal", "rotary", "long",
                                  "dropout_rate", "backend", "float64"])
def test_the_one_node_layer_steps_aside_where_the_modules_would_not_make_its_calls(case, monkeypatch):
    """Each case a layer built so, or (all but rotary and dropout) changed so after a first call took the node: the
    layer's cached plan (nn.layer_native.plan) is made again, or the call's own checks step aside."""
    from attnlab.nn.block import DecoderLayer
    from attnlab.nn.positional import RotaryEmbedding
    L, kw = 8, {}
    if case in ("rotary", "dropout"):
        torch.manual_seed(0)
        layer = DecoderLayer(32, 2, ffn_dim=128, cross_attention=False, norm_first=True,
                             **({"rotary": RotaryEmbedding(16, max_positions=16)} if case == "rotary"
                                else {"dropout": 0.1}))
        I.int8_training(layer, skip=())
    else:
        layer = _gpt_layer(32, 2)
        calls = _fused_calls(monkeypatch)
        layer(torch.randn(2, L, 32, requires_grad=True))
        assert calls == [1]
        monkeypatch.undo()
    if case == "eval":
        layer.eval()
    elif case == "hook":
        layer.ffn.w1.register_forward_hook(lambda m, i, o: None)
    elif case == "frozen":
        layer.norm2.weight.requires_grad_(False)
    elif case == "dropout_hook":
        layer.ffn.dropout.register_forward_hook(lambda m, i, o: None)
    elif case == "float_linear":
        layer.self_attn.out_proj.__class__ = nn.Linear
    elif case == "subclass":  # a subclass may compute otherwise: only the class registered with its levels
        layer.ffn.w1.__class__ = type("Sub", (I.Int8TrainingLinear,), {})
    elif case == "eval_linear":
        layer.ffn.w2.eval()
    elif case == "not_causal":
        kw = {"is_causal": False}
    elif case == "long":
        from attnlab.backends import short
        L = short.FUSED_KEYS + 1
    elif case == "dropout_rate":
        layer.dropout2.p = 0.1
    elif case == "backend":
        layer.self_attn.backend = "sdpa"
    elif case == "float64":
        layer.double()
    calls = _fused_calls(monkeypatch)
    x = torch.randn(2, L, 32, requires_grad=True)
    if case == "no_grad":
        with torch.no_grad():
            y = layer(x)
    elif case == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
    else:
        y = layer(x.double() if case == "float64" else x, **kw)
    assert calls == [] and y.shape == x.shape


@needs_native
def test_a_non_finite_projection_leaves_the_one_node_path_for_the_modules_pipeline(monkeypatch):
    """A NaN in the input makes the qkv projection non-finite: the node raises before recording anything and the
    layer runs its modules, whose attention pipeline handles it — the same result as without the node."""
    from attnlab.nn.block import DecoderLayer
    layer = _gpt_layer(32, 2)
    x = torch.randn(2, 8, 32)
    x[1, 3, 5] = float("nan")
    calls = _fused_calls(monkeypatch)
    y = layer(x.clone().requires_grad_())
    assert calls == [1]
    monkeypatch.setattr(DecoderLayer, "_train_native", lambda self, x: None)
    y_ref = layer(x.clone().requires_grad_())
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0, equal_nan=True)
    assert torch.isfinite(y[0]).all()  # the other sequence untouched


@needs_native
@pytest.mark.parametrize("weight_scale", [1e9, 1e15, 1e19])
def test_large_projections_are_scanned_and_an_overflowing_attention_leaves_the_node(weight_scale, monkeypatch):
    """Within |qkv| ≤ 1e15 (the node's bound from the roundings' scales: 1e9 × the weights) no scan is needed; past it
    (1e15 ×) the node scans qkv and the attention's output, finite: the node's result, the modules' bits; at 1e19 ×
    the scores overflow and the layer behaves exactly as its modules do."""
    from attnlab.nn.block import DecoderLayer
    layer = _gpt_layer(32, 2)
    with torch.no_grad():
        layer.self_attn.in_proj.weight.mul_(weight_scale)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2))
    calls = _fused_calls(monkeypatch)

    def run():
        try:
            return layer(x.clone().requires_grad_()).detach()
        except Exception as e:  # the pipeline may explain an overflow: both paths must say the same
            return type(e), str(e)

    got = run()
    monkeypatch.setattr(DecoderLayer, "_train_native", lambda self, x: None)
    want = run()
    assert calls == [1]
    if isinstance(want, tuple):
        assert got == want
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        assert weight_scale > 1e16 or torch.isfinite(got).all()
