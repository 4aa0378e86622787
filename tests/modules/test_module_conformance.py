"""Conformance of every module in the attention registry (self-attention on ``x (B, L, E)``):
output shape, finite gradients, padded keys have no influence, batch rows are independent.

Each registry name needs an adapter here (the module APIs differ: torch-style
``key_padding_mask`` vs the classic modules' ``mask``); a registered module without one fails
``test_every_registered_module_has_an_adapter``.
"""
import pytest
import torch

from attnlab.modules.registry import ATTENTION_REGISTRY, get_attention

B, L, E = 2, 6, 16


def _step(m, x, pad):  # one decoder step: query = first position, keys = all positions
    prev = m.initial_alignment(B, L) if hasattr(m, "initial_alignment") else None
    return m(x[:, 0], x, prev, mask=~pad)[0].unsqueeze(1)


ADAPTERS = {
    # name: (constructor kwargs, call(module, x, pad) -> (B, L or 1, E)); pad is True at padding
    "multihead": (dict(embed_dim=E, num_heads=4), lambda m, x, pad: m(x, key_padding_mask=pad, need_weights=False)[0]),
    "additive": (dict(query_dim=E, key_dim=E, hidden_dim=8), lambda m, x, pad: m(x, x, mask=~pad)[0]),
    "luong": (dict(query_dim=E, key_dim=E), lambda m, x, pad: m(x, x, mask=~pad)[0]),
    "location": (dict(query_dim=E, key_dim=E, hidden_dim=8, kernel_size=3), _step),
    "monotonic": (dict(query_dim=E, key_dim=E, hidden_dim=8), _step),
    "performer": (dict(embed_dim=E, num_heads=4, num_features=32), lambda m, x, pad: m(x, key_padding_mask=pad)),
    "linformer": (dict(embed_dim=E, num_heads=4, seq_len=8, k=4), lambda m, x, pad: m(x, key_padding_mask=pad)),
}


def _build(name):
    kwargs, call = ADAPTERS[name]
    return get_attention(name)(**kwargs), call


def test_every_registered_module_has_an_adapter():
    assert set(ADAPTERS) == set(ATTENTION_REGISTRY)


PAD = torch.tensor([[False] * L, [False] * (L - 2) + [True] * 2])


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_shape_and_finite_gradients(name):
    m, call = _build(name)
    m.train()
    x = torch.randn(B, L, E, requires_grad=True)
    out = call(m, x, PAD)
    assert out.shape[0] == B and out.shape[-1] == E and out.shape[1] in (1, L)
    assert torch.isfinite(out).all()
    out.square().sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    grads = [p.grad for p in m.parameters() if p.requires_grad]
    assert grads and all(g is None or torch.isfinite(g).all() for g in grads)
    assert any(g is not None and g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_padded_keys_do_not_influence_real_positions(name):
    m, call = _build(name)
    m.eval()
    x = torch.randn(B, L, E)
    y = x.clone()
    y[1, L - 2:] = 100 * torch.randn(2, E)  # change only the padded positions of row 1
    a, b = call(m, x, PAD), call(m, y, PAD)
    real = a.shape[1] if a.shape[1] == 1 else L - 2
    torch.testing.assert_close(a[1, :real], b[1, :real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_batch_rows_are_independent(name):
    m, call = _build(name)
    m.eval()
    x = torch.randn(B, L, E)
    y = x.clone()
    y[1] = torch.randn(L, E)
    no_pad = torch.zeros(B, L, dtype=torch.bool)
    torch.testing.assert_close(call(m, x, no_pad)[0], call(m, y, no_pad)[0], rtol=1e-5, atol=1e-6)
