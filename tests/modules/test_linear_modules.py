"""PerformerAttention and LinformerAttention against hand-written float64 formulas and
torch.nn.MultiheadAttention (Linformer with E = F = I is exact attention). Tolerance 1e-10 in
float64 unless stated."""
import math

import pytest
import torch
import torch.nn.functional as F

from attnlab.modules.linear import LinformerAttention, PerformerAttention

B, L, E, H = 2, 10, 12, 3
DH = E // H


def x64(length=L):
    return torch.randn(B, length, E, dtype=torch.float64)


def heads(t):  # (B, L, E) -> (B, H, L, Dh)
    return t.view(t.shape[0], t.shape[1], H, DH).transpose(1, 2)


def merge(module, out):  # (B, H, L, Dh) -> out_proj(concat)
    return module.out_proj(out.transpose(1, 2).reshape(out.shape[0], out.shape[2], E))


def kernel_attention(module, x, phi, *, causal, keep=None):
    """``Σ_j φ(q_i)ᵀφ(k_j) v_j / Σ_j φ(q_i)ᵀφ(k_j)`` through the N × N matrix (no stabiliser: eps=0)."""
    q, k, v = heads(module.q_proj(x)), heads(module.k_proj(x)), heads(module.v_proj(x))
    a = phi(q) @ phi(k).transpose(-1, -2)  # (B, H, L, L)
    if causal:
        a = a.tril()
    if keep is not None:
        a = a * keep[:, None, None, :]
    den = a.sum(-1, keepdim=True)  # 0 only for a query that sees no key: zeros, as the module gives
    return merge(module, (a @ v) / torch.where(den == 0, 1, den))


# ---- Performer -----------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_performer_elu_equals_formula(causal):
    m = PerformerAttention(E, H, feature_map="elu", causal=causal).double()
    x = x64()
    ref = kernel_attention(m, x, lambda t: F.elu(t) + 1, causal=causal)
    torch.testing.assert_close(m(x), ref, rtol=0, atol=1e-10)
    assert m.projection is None and [n for n, _ in m.named_parameters()] == [
        "q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias",
        "out_proj.weight", "out_proj.bias"]


@pytest.mark.parametrize("causal", [False, True])
def test_performer_favor_equals_formula_with_its_buffer(causal):
    m = PerformerAttention(E, H, num_features=8, causal=causal).double().eval()
    w = m.projection
    assert w.shape == (8, DH) and "projection" in m.state_dict()

    def phi(t):
        t = t * DH ** -0.25
        return torch.exp(t @ w.T - (t * t).sum(-1, keepdim=True) / 2) / math.sqrt(8)

    x = 0.5 * x64()
    # the module's eps sits on the stabilised denominator; relative effect ~1e-6 at most here
    torch.testing.assert_close(m(x), kernel_attention(m, x, phi, causal=causal), rtol=1e-5, atol=1e-6)


def test_performer_default_num_features():
    m = PerformerAttention(64 * 2, 2)
    assert m.num_features == m.projection.shape[0] == math.ceil(64 * math.log(64))


def test_performer_redraw_schedule():
    m = PerformerAttention(E, H, redraw_interval=3)
    x = torch.randn(B, L, E)
    seen = [m.projection.clone()]
    for _ in range(10):
        m(x)
        seen.append(m.projection.clone())
    changed = [i for i in range(1, 11) if not torch.equal(seen[i], seen[i - 1])]
    assert changed == [4, 7, 10]  # calls 1-3 use the first draw, then a new one every 3 calls
    m.eval()
    before = m.projection.clone()
    for _ in range(7):
        m(x)
    assert torch.equal(m.projection, before)  # eval neither redraws nor counts
    m.train()
    m(x), m(x)
    assert torch.equal(m.projection, before)  # count resumed at 1 (after call 10): calls 11, 12
    m(x)
    assert not torch.equal(m.projection, before)  # call 13


def test_performer_redraw_none_and_forced():
    m = PerformerAttention(E, H, redraw_interval=None)
    before = m.projection.clone()
    buf = m.projection
    for _ in range(5):
        m(torch.randn(B, L, E))
    assert torch.equal(m.projection, before)
    m.redraw_features()
    assert m.projection is buf and not torch.equal(m.projection, before)  # in place, same buffer


@pytest.mark.parametrize("feature_map", ["favor+", "elu"])
@pytest.mark.parametrize("causal", [False, True])
def test_performer_key_padding(feature_map, causal):
    m = PerformerAttention(E, H, feature_map=feature_map, causal=causal).double().eval()
    x = x64()
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[0, -3:] = True
    pad[1, :2] = True
    out = m(x, key_padding_mask=pad)
    x2 = x.clone()
    x2[pad] = 7 * torch.randn(int(pad.sum()), E, dtype=torch.float64)
    out2 = m(x2, key_padding_mask=pad)
    torch.testing.assert_close(out[~pad], out2[~pad], rtol=0, atol=1e-12)  # real positions unchanged
    if feature_map == "elu":
        ref = kernel_attention(m, x, lambda t: F.elu(t) + 1, causal=causal, keep=~pad)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)


def test_performer_bad_arguments():
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="num_features"):
            PerformerAttention(E, H, num_features=bad)
    with pytest.raises(ValueError, match="feature_map"):
        PerformerAttention(E, H, feature_map="softmax")
    with pytest.raises(ValueError, match="redraw_interval"):
        PerformerAttention(E, H, redraw_interval=0)
    with pytest.raises(ValueError, match="num_heads"):
        PerformerAttention(E, 5)
    with pytest.raises(ValueError, match=r"x must be \(B, L, 12\)"):
        PerformerAttention(E, H)(torch.randn(B, L, E + 1))
    with pytest.raises(ValueError, match="key_padding_mask"):
        PerformerAttention(E, H)(torch.randn(B, L, E), key_padding_mask=torch.zeros(B, L + 1, dtype=torch.bool))


# ---- Linformer -----------------------------------------------------------------------------

def test_linformer_identity_projection_is_exact_attention():
    torch_mha = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
    m = LinformerAttention(E, H, seq_len=L, k=L).double()
    with torch.no_grad():
        for i, p in enumerate((m.q_proj, m.k_proj, m.v_proj)):
            p.weight.copy_(torch_mha.in_proj_weight[i * E:(i + 1) * E])
            p.bias.copy_(torch_mha.in_proj_bias[i * E:(i + 1) * E])
        m.out_proj.load_state_dict(torch_mha.out_proj.state_dict())
        m.e_proj.copy_(torch.eye(L))
        m.f_proj.copy_(torch.eye(L))
    x = x64()
    torch.testing.assert_close(m(x), torch_mha(x, x, x, need_weights=False)[0], rtol=0, atol=1e-10)


@pytest.mark.parametrize("share_kv", [False, True])
@pytest.mark.parametrize("length", [L, 6])
def test_linformer_equals_formula(share_kv, length):
    m = LinformerAttention(E, H, seq_len=L, k=4, share_kv=share_kv).double()
    x = x64(length)
    e = m.e_proj[:, :length]  # a shorter sequence uses the first `length` columns
    f = e if share_kv else m.f_proj[:, :length]
    assert (m.f_proj is None) == share_kv
    q, k, v = heads(m.q_proj(x)), heads(m.k_proj(x)), heads(m.v_proj(x))
    w = torch.softmax(q @ (e @ k).transpose(-1, -2) / math.sqrt(DH), dim=-1)  # (B, H, length, k)
    torch.testing.assert_close(m(x), merge(m, w @ (f @ v)), rtol=0, atol=1e-10)


def test_linformer_key_padding():
    m = LinformerAttention(E, H, seq_len=L, k=5).double()
    x = x64()
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[0, -4:] = True
    out = m(x, key_padding_mask=pad)
    x2 = x.clone()
    x2[pad] = torch.randn(int(pad.sum()), E, dtype=torch.float64)
    torch.testing.assert_close(m(x2, key_padding_mask=pad)[~pad], out[~pad], rtol=0, atol=1e-12)
    torch.testing.assert_close(out[1], m(x[1:])[0], rtol=0, atol=1e-12)  # unpadded row unaffected


def test_linformer_errors():
    m = LinformerAttention(E, H, seq_len=L, k=4)
    with pytest.raises(ValueError, match="seq_len"):
        m(torch.randn(B, L + 1, E))
    with pytest.raises(ValueError, match="cannot be causal"):
        m(torch.randn(B, L, E), is_causal=True)
    with pytest.raises(ValueError, match="cannot be causal"):
        LinformerAttention(E, H, seq_len=L, causal=True)
    for name, kwargs in (("seq_len", dict(seq_len=0)), ("k", dict(seq_len=L, k=0)),
                         ("dropout", dict(seq_len=L, dropout=1.0))):
        with pytest.raises(ValueError, match=name):
            LinformerAttention(E, H, **kwargs)


def test_linformer_dropout_only_in_training():
    m = LinformerAttention(E, H, seq_len=L, k=4, dropout=0.5)
    x = torch.randn(B, L, E)
    m.eval()
    torch.testing.assert_close(m(x), m(x), rtol=0, atol=0)
    m.train()
    assert not torch.equal(m(x), m(x))
