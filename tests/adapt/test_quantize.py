"""int8 quantisation: the per-row rounding bound, weight-only int8 equal to the dequantised float model,
dynamic int8 equal to torch's own dynamic-quantised Linear on the same int8 weight, whole models close to
float32, tied embeddings stored once, state dicts that reload, and the errors.

Tolerances: rounding |W - diag(s)Q| <= s/2 per row (exact); weight-only with float32 compute vs the
dequantised float model <= 1e-5 · max(1, max|ref|); dynamic int8 vs ``torch.ao`` dynamic Linear on the same
packed weight: bit-identical; whole tiny models vs float32: relative logit error <= 5 %, top-1 agreement >= 90 %.
"""
import copy
import warnings

import pytest
import torch

from attnlab.adapt import apply_lora
from attnlab.adapt.quantize import Int8Embedding, Int8Linear, quantize, quantize_rows, state_dict_bytes
from attnlab.models.transformer import Transformer


def _rel(got, ref):
    return ((got - ref).norm() / ref.norm()).item()


def test_rows_round_to_within_half_a_step():
    w = torch.randn(33, 70) * torch.logspace(-3, 1, 33)[:, None]
    w[5] = 0.0
    q, s = quantize_rows(w)
    assert q.dtype == torch.int8 and s.shape == (33,) and int(q.abs().max()) == 127
    err = (w - q.float() * s[:, None]).abs()
    assert (err <= s[:, None] / 2 + 1e-7 * w.abs()).all()
    assert torch.equal(q[5], torch.zeros(70, dtype=torch.int8))


@torch.no_grad()
def test_weight_only_float32_equals_the_dequantised_linear():
    lin = torch.nn.Linear(48, 40)
    q8 = Int8Linear.from_linear(lin, mode="int8-weight", compute_dtype=torch.float32)
    x = torch.randn(3, 5, 48)
    ref = torch.nn.functional.linear(x, q8.weight, lin.bias)
    assert (q8(x) - ref).abs().max() <= 1e-5 * ref.abs().max()
    bf = Int8Linear.from_linear(lin, mode="int8-weight")  # bfloat16 compute: ~3 significant digits
    assert _rel(bf(x), ref) < 1e-2


@torch.no_grad()
def test_dynamic_int8_equals_torch_dynamic_linear_on_the_same_weight():
    from torch.ao.nn.quantized.dynamic import Linear as TorchDynamicLinear

    lin = torch.nn.Linear(64, 24)
    ours = Int8Linear.from_linear(lin, mode="int8")
    with warnings.catch_warnings():  # torch marks its quantized tensors deprecated
        warnings.simplefilter("ignore")
        peer = TorchDynamicLinear(64, 24, dtype=torch.qint8)
        qw = torch._make_per_channel_quantized_tensor(ours.weight_int8, ours.weight_scale.double(),
                                                      torch.zeros(24, dtype=torch.long), 0)
        peer.set_weight_bias(qw, lin.bias.detach())
    x = torch.randn(2, 7, 64)
    assert torch.equal(ours(x), peer(x))
    assert _rel(ours(x), lin(x)) < 2e-2  # activations and weights rounded to 8 bits


@torch.no_grad()
def test_weight_only_float32_gpt2_equals_the_dequantised_model(make_gpt2, ids):
    model = make_gpt2()
    q = quantize(model, "int8-weight", compute_dtype=torch.float32)
    ref = copy.deepcopy(model)
    for name, m in ref.named_modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            m.weight.copy_(q.get_submodule(name).weight)
    got, want = q(ids).logits, ref(ids).logits
    assert (got - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item())
    assert torch.equal(q.generate(ids[:, :4], max_new_tokens=5), ref.generate(ids[:, :4], max_new_tokens=5))


@pytest.mark.parametrize("mode", ["int8", "int8-weight"])
@torch.no_grad()
def test_gpt2_close_to_float32_smaller_and_tied_once(mode, make_gpt2):
    model = make_gpt2(n_embd=128, n_layer=2, vocab_size=500, n_positions=64)
    for p in model.parameters():  # GPT-2's own init scale
        if p.dim() > 1:
            p.normal_(0, 0.02)
    q = quantize(model, mode)
    assert isinstance(q.wte, Int8Embedding) and isinstance(q.lm_head, Int8Linear)
    assert q.lm_head.weight_int8 is q.wte.weight_int8  # the tied head shares the int8 table
    assert isinstance(model.lm_head, torch.nn.Linear)  # the original is untouched
    assert state_dict_bytes(q) <= 0.35 * state_dict_bytes(model)
    ids = torch.randint(0, 500, (4, 32))
    ref, got = model(ids).logits, q(ids).logits
    assert _rel(got, ref) < 0.05
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    out = q.generate(ids[:, :8], max_new_tokens=4)
    assert out.shape == (4, 12)


@torch.no_grad()
def test_bert_and_cross_attention_models(make_bert, ids):
    bert = make_bert()
    qb = quantize(bert, "int8")
    assert _rel(qb(ids).last_hidden_state, bert(ids).last_hidden_state) < 0.05
    tr = Transformer(32, 4, num_encoder_layers=1, num_decoder_layers=1, ffn_dim=64, dropout=0.0).eval()
    src, tgt = torch.randn(2, 6, 32), torch.randn(2, 5, 32)
    for mode in ("int8", "int8-weight"):  # cross-attention reads row slices of in_proj.weight
        assert _rel(quantize(tr, mode)(src, tgt), tr(src, tgt)) < 0.05


@torch.no_grad()
def test_state_dict_round_trip(make_gpt2, ids):
    a = quantize(make_gpt2(seed=0), "int8")
    b = quantize(make_gpt2(seed=1), "int8")
    a(ids)
    b(ids)  # both have packed their weights
    b.load_state_dict(a.state_dict())
    assert torch.equal(a(ids).logits, b(ids).logits)


def test_errors(make_gpt2):
    with pytest.raises(ValueError, match="mode"):
        quantize(make_gpt2(), "int4")
    with pytest.raises(ValueError, match=r"cannot quantise 'wte' of dtype torch.float64"):
        quantize(make_gpt2().double(), "int8")
    with pytest.raises(ValueError, match="float16"):
        quantize(make_gpt2().half(), "int8")
    with pytest.raises(ValueError, match="LoRA"):
        quantize(apply_lora(make_gpt2(), r=2, alpha=2), "int8")
    with pytest.raises(ValueError, match="compute_dtype"):
        quantize(make_gpt2(), "int8-weight", compute_dtype=torch.int8)
    with pytest.raises(ValueError, match=r"holds a packed inference layout \(optimize_for_inference\): quantise the"):
        quantize(make_gpt2().optimize_for_inference(dtype=torch.float32), "int8")  # was a silent no-op
    q = quantize(make_gpt2().bfloat16(), "int8-weight", exclude=["lm_head"])  # bf16 weight-only is supported
    assert isinstance(q.lm_head, torch.nn.Linear)
