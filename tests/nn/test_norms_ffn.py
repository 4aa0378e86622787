"""Norms and feed-forward networks against hand-written float64 formulas (tolerance 1e-12 in float64)."""
import math

import pytest
import torch
import torch.nn.functional as F

from attnlab.nn.feedforward import FFN_ACTIVATIONS, FeedForward
from attnlab.nn.norms import RMSNorm, _RMSNormFunction, make_norm


def test_rmsnorm_matches_loop_formula():
    norm = RMSNorm(5, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, -2.0, 0.5, 3.0, 1.5]))
    x = torch.randn(2, 3, 5, dtype=torch.float64)
    out = norm(x)
    for b in range(2):
        for i in range(3):
            row = x[b, i].tolist()
            rms = math.sqrt(sum(v * v for v in row) / 5 + 1e-6)
            for j in range(5):
                assert out[b, i, j].item() == pytest.approx(row[j] / rms * norm.weight[j].item(), abs=1e-12)


def test_rmsnorm_matches_torch_builtin_and_keeps_half_dtype():
    x = torch.randn(4, 8)
    ours = RMSNorm(8, eps=1e-5)
    torch.testing.assert_close(ours(x), F.rms_norm(x, (8,), ours.weight, eps=1e-5), atol=1e-6, rtol=1e-6)
    assert ours.to(torch.bfloat16)(x.bfloat16()).dtype == torch.bfloat16


def test_rmsnorm_hand_written_backward():
    # float64: gradcheck (finite differences) on x and the gain
    norm = RMSNorm(6, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-1.5, 2.0, 6))
    x = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: _RMSNormFunction.apply(x, w, 1e-5), (x, norm.weight),
                                    eps=1e-6, atol=1e-8)
    # float32: values and gradients = autograd through the plain formula (torch's rms_norm)
    x32 = torch.randn(5, 7, 32, requires_grad=True)
    w32 = torch.randn(32, requires_grad=True)
    ours = RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(w32)
    g = torch.randn(5, 7, 32)
    ref = F.rms_norm(x32, (32,), w32, eps=1e-6)
    gx, gw = torch.autograd.grad(ref, (x32, w32), g)
    out = ours(x32)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    ox, ow = torch.autograd.grad(out, (x32, ours.weight), g)
    torch.testing.assert_close(ox, gx, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ow, gw, atol=1e-4, rtol=1e-5)
    # a second derivative is refused, not silently wrong
    x2 = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
    (gx2,) = torch.autograd.grad(norm(x2).pow(2).sum(), x2, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|double backward|twice"):
        gx2.sum().backward()


def test_make_norm_kinds_and_errors():
    ln = make_norm("layernorm", 6, eps=1e-3)
    assert isinstance(ln, torch.nn.LayerNorm) and ln.eps == 1e-3
    assert isinstance(make_norm("rmsnorm", 6, eps=1e-6), RMSNorm)
    assert ln.bias is not None and make_norm("layernorm", 6, bias=False).bias is None
    with pytest.raises(ValueError, match=r"norm must be one of 'layernorm', 'rmsnorm', got 'batchnorm'"):
        make_norm("batchnorm", 6, eps=1e-5)
    with pytest.raises(ValueError, match="dim"):
        RMSNorm(0)
    with pytest.raises(ValueError, match="eps"):
        RMSNorm(4, eps=0.0)


def _act64(name, x):
    if name == "relu":
        return max(x, 0.0)
    if name in ("gelu", "geglu"):
        return 0.5 * x * (1 + math.erf(x / math.sqrt(2)))
    if name in ("gelu_tanh", "geglu_tanh"):
        return 0.5 * x * (1 + math.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    if name == "quick_gelu":
        return x / (1 + math.exp(-1.702 * x))
    if name == "glu":
        return 1 / (1 + math.exp(-x))
    if name == "swiglu":
        return x / (1 + math.exp(-x))
    if name in ("relu2", "relu2_glu"):
        return max(x, 0.0) ** 2
    raise AssertionError(name)


@pytest.mark.parametrize("activation", FFN_ACTIVATIONS)
def test_feedforward_matches_loop_formula(activation):
    dim, hidden = 3, 4
    ffn = FeedForward(dim, hidden, activation=activation).double()
    assert (ffn.w3 is not None) == (activation in ("glu", "geglu", "geglu_tanh", "swiglu", "relu2_glu"))
    x = torch.randn(2, dim, dtype=torch.float64)
    out = ffn(x)

    def linear(layer, v):
        W, b = layer.weight.tolist(), layer.bias.tolist()
        return [sum(W[r][c] * v[c] for c in range(len(v))) + b[r] for r in range(len(W))]

    for n in range(2):
        v = x[n].tolist()
        h = [_act64(activation, a) for a in linear(ffn.w1, v)]
        if ffn.w3 is not None:
            h = [a * g for a, g in zip(h, linear(ffn.w3, v))]
        expected = linear(ffn.w2, h)
        torch.testing.assert_close(out[n], torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=0)


def test_feedforward_parameters_bias_and_dropout():
    ffn = FeedForward(8, 16, activation="swiglu", bias=False)
    assert sorted(n for n, _ in ffn.named_parameters()) == ["w1.weight", "w2.weight", "w3.weight"]
    ffn = FeedForward(8, 16, dropout=0.5).train()
    x = torch.randn(64, 8)
    assert not torch.equal(ffn(x), ffn(x))  # dropout active in training
    ffn.eval()
    torch.testing.assert_close(ffn(x), ffn.w2(F.relu(ffn.w1(x))))


@pytest.mark.parametrize("kwargs, name", [
    (dict(dim=0, hidden_dim=4), "dim"), (dict(dim=4, hidden_dim=-1), "hidden_dim"),
    (dict(dim=4, hidden_dim=4, activation="tanh"), "activation"),
    (dict(dim=4, hidden_dim=4, dropout=1.0), "dropout"),
])
def test_feedforward_rejects_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        FeedForward(**kwargs)
