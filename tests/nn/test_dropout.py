"""attnlab's CPU dropout: the drop rate, unbiasedness, the gradient, reproducibility, the errors.

Statistical bounds are 6 standard deviations of a binomial proportion over 2²⁰ draws (≈ 0.0018 at p = 0.1).
"""
import pytest
import torch

from attnlab.nn.dropout import Dropout, dropout, keep_mask

N = 1 << 20


@pytest.mark.parametrize("p", [0.05, 0.1, 0.5, 0.9])
def test_keep_rate_and_unbiased_scale(p):
    torch.manual_seed(0)
    x = torch.ones(N)
    y = dropout(x, p)
    kept = (y != 0).float().mean().item()
    sd = (p * (1 - p) / N) ** 0.5
    assert abs(kept - (1 - p)) < 6 * sd
    scale = y[y != 0].unique()
    assert scale.numel() == 1 and abs(scale.item() * (1 - p) - 1) <= 2 ** -16 / (1 - p) + 1e-6  # |p' - p| <= 2^-16
    assert abs(y.mean().item() - 1.0) < 6 * sd / (1 - p)  # E[y] = x


def test_every_bit_of_the_mask_is_used_uniformly():
    """Four draws come from each int64 word: every one of the four positions keeps at the same rate."""
    torch.manual_seed(1)
    m = keep_mask((N,), 0.25).view(-1, 4).float().mean(0)
    assert torch.all((m - 0.75).abs() < 6 * (0.25 * 0.75 / (N / 4)) ** 0.5), m


def test_gradient_is_the_scaled_mask_and_eval_is_identity():
    torch.manual_seed(2)
    x = torch.randn(64, 33, requires_grad=True)
    y = dropout(x, 0.3)
    y.sum().backward()
    mask = y.detach() != 0
    torch.testing.assert_close(x.grad, mask.float() * (y.detach()[mask] / x.detach()[mask]).mean())
    torch.testing.assert_close(y.detach()[mask], x.detach()[mask] / (1 - 0.3), rtol=1e-4, atol=0)
    assert dropout(x, 0.3, training=False) is x and dropout(x, 0.0) is x
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))


def test_reproducible_under_manual_seed_and_module_matches_function():
    x = torch.randn(5, 7, 9, dtype=torch.bfloat16)
    torch.manual_seed(3)
    a = dropout(x, 0.2)
    torch.manual_seed(3)
    layer = Dropout(0.2)
    assert isinstance(layer, torch.nn.Dropout) and a.dtype == torch.bfloat16
    assert torch.equal(layer(x), a)
    assert torch.equal(layer.eval()(x), x)


@pytest.mark.parametrize("p", [-0.1, 1.5])
def test_bad_probability_raises(p):
    with pytest.raises(ValueError, match="dropout probability"):
        dropout(torch.ones(3), p)
