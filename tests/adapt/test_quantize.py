"""int8 and int4 quantisation: the per-row (per-group) rounding bounds, weight-only int8 and int4 equal to the
dequantised float model, dynamic int8 equal to torch's own dynamic-quantised Linear on the same int8 weight, whole
models close to float32, tied embeddings stored once, state dicts that reload, int4's packing, and the errors.

Tolerances: rounding |W - diag(s)Q| <= s/2 per row (exact); weight-only with float32 compute vs the
dequantised float model <= 1e-5 · max(1, max|ref|); dynamic int8 vs the dequantised float layer: each activation
within one step (2 max|x_row| / 127) of its row's grid, times Σ|W| of the output; one row's outlier, NaN or inf
leaves every other row bit-identical; whole tiny models vs float32: relative logit error <= 5 %, top-1 agreement >= 90 %.
"""
import copy
import warnings

import pytest
import torch

from attnlab.adapt import apply_lora
from attnlab import _native
from attnlab.adapt.quantize import (Int4Embedding, Int4Linear, Int8Embedding, Int8Linear, dequantize_groups, quantize,
                                    quantize_groups, quantize_rows, state_dict_bytes)
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
def test_dynamic_int8_rounds_each_row_on_its_own_scale():
    lin = torch.nn.Linear(64, 24)
    ours = Int8Linear.from_linear(lin, mode="int8")
    x = torch.randn(2, 7, 64) * torch.logspace(-3, 3, 7)[:, None]  # rows six decades apart
    got, ref = ours(x), torch.nn.functional.linear(x, ours.weight, lin.bias)
    # each activation within one step 2 r / 127 of the 7-bit grid of its row's range [-r, r], r = max|x_row|
    bound = (2 * x.abs().amax(-1, keepdim=True) / 127) * ours.weight.abs().sum(1) + 1e-5 * ref.abs()
    assert ((got - ref).abs() <= bound).all()
    assert _rel(ours(x[0, 3]), lin(x[0, 3])) < 2e-2  # activations and weights rounded to 8 bits


@pytest.mark.parametrize("mode", ["int8", "int8-weight", "int4"])
@pytest.mark.parametrize("rows", [3, 16])  # the native few-row kernel where built, the batched kernels
@torch.no_grad()
def test_one_row_never_changes_another(mode, rows):
    lin = torch.nn.Linear(64, 24)
    layer = quantize(torch.nn.Sequential(lin), mode)
    x = torch.randn(rows, 64)
    clean = layer(x)
    for bad in (1e6, float("inf"), float("-inf"), float("nan")):
        x2 = x.clone()
        x2[1, 5] = bad
        y = layer(x2)
        assert torch.equal(torch.cat([y[:1], y[2:]]), torch.cat([clean[:1], clean[2:]])), bad
        assert torch.isfinite(y[1]).all() == torch.isfinite(lin(x2[1])).all(), bad  # NaN/inf reach their own row


@pytest.mark.parametrize("mode", ["int8", "int8-weight", "int4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_weights_are_refused_by_name(mode, bad, make_gpt2):
    model = make_gpt2()
    with torch.no_grad():
        model.layers[1].ffn.w2.weight[3, 4] = bad
    with pytest.raises(ValueError, match=r"'layers.1.ffn.w2.weight' holds NaN or inf"):
        quantize(model, mode)


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


@pytest.mark.skipif(not _native.available(), reason="attnlab's native kernels are not built here")
@pytest.mark.parametrize("family", ["gpt2", "llama"])
@torch.no_grad()
def test_each_int8_linear_candidate_prefills_a_model_within_the_int8_tolerance(family, make_gpt2, make_llama,
                                                                              monkeypatch):
    """A GPT-2 and a Llama quantised to ``"int8"`` prefill a prompt (2 × 32 rows a product: the ``int8_linear``
    family's regime) with each candidate forced (``fbgemm``; ``int_mm`` where its sums are exact here): every
    product within int8's tolerance of the float formula on its own input (``attnlab._choice.tolerance``), the
    logits within 5 % of the float model holding the dequantised weights and of each other's, top-1 ≥ 90 %."""
    from attnlab import _choice
    from attnlab.adapt.quant_formats import int_mm_exact

    model = make_gpt2(n_embd=128, n_layer=2, vocab_size=500, n_positions=64) if family == "gpt2" else make_llama()
    for p in model.parameters():  # the models' own init scale
        if p.dim() > 1:
            p.normal_(0, 0.02)
    ids = torch.randint(0, 97, (2, 32))  # (both vocabularies hold 97 tokens or more)
    outside = []

    def check(m, inputs, out):
        x = inputs[0].reshape(-1, m.in_features)
        want = torch.nn.functional.linear(x.double(), m.weight.double(), None if m.bias is None else m.bias.double())
        tol = _choice.tolerance("int8", x, m.weight)
        if not ((out.reshape(-1, m.out_features).double() - want).abs() <= tol).all():
            outside.append(m)

    logits = {}
    for cand in [c for c in _choice.FAMILIES["int8_linear"] if c == "fbgemm" or int_mm_exact()]:
        monkeypatch.setenv("ATTNLAB_FORCE_INT8_LINEAR", cand)
        q = quantize(model, "int8")
        layers = [m for m in q.modules() if isinstance(m, Int8Linear)]
        for m in layers:
            m.register_forward_hook(check)
        logits[cand] = q(ids).logits
        assert outside == [] and all(m.int8_kernel() == cand for m in layers)
    ref = copy.deepcopy(model)
    for name, m in ref.named_modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            m.weight.copy_(q.get_submodule(name).weight)
    want = ref(ids).logits
    for got in logits.values():
        assert _rel(got, want) < 0.05 and (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    if len(logits) == 2:
        assert _rel(logits["int_mm"], logits["fbgemm"]) < 0.05


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
        quantize(make_gpt2(), "int2")
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


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_groups_round_to_within_half_a_step(group):
    """``W ≈ d Q`` per group: |error| ≤ d/2 where ``W/d`` rounds inside [-8, 7], ≤ d at +8 (clamped to 7); the group's
    extreme is exact (it maps to -8); a group of zeros gets d = 1 and Q = 0."""
    w = torch.randn(9, 256) * torch.logspace(-3, 1, 9)[:, None]
    w[4, :group] = 0.0
    packed, d = quantize_groups(w, group)
    assert packed.dtype == torch.uint8 and packed.shape == (9, 128) and d.shape == (9, 256 // group)
    back = dequantize_groups(packed, d, 256)
    step = d.abs().repeat_interleave(group, dim=1)
    ratio = w / d.repeat_interleave(group, dim=1)
    err = (w - back).abs()
    assert (err <= step / 2 + 1e-6 * w.abs()).where(ratio < 7.5, err <= step + 1e-6 * w.abs()).all()
    extreme = w.reshape(9, -1, group).abs().argmax(-1)
    assert torch.equal(back.reshape(9, -1, group).gather(-1, extreme[..., None]),
                       w.reshape(9, -1, group).gather(-1, extreme[..., None]))
    assert torch.equal(d[4, 0], torch.tensor(1.0)) and torch.equal(back[4, :group], torch.zeros(group))


def test_int4_packing_is_the_documented_layout():
    """Blocks of 128 columns, 64 bytes = 32 little-endian 16-bit lanes: nibble r of lane t holds column 32 r + t, in
    two's complement; a last partial block (here 32 of 128 columns) is padded with zeros."""
    torch.manual_seed(0)
    q = torch.randint(-8, 8, (3, 160))
    q[:, ::32] = -8  # each group's extreme: d = 1, so Q = q exactly
    packed, d = quantize_groups(q.float(), 32)
    assert torch.equal(d, torch.ones(3, 5)) and packed.shape == (3, 128)
    lanes = packed.view(3, 2, 32, 2).long()  # (row, block, lane t, byte)
    lanes = lanes[..., 0] | (lanes[..., 1] << 8)
    for c in range(160):
        block, r, t = c // 128, (c % 128) // 32, c % 32
        assert torch.equal((lanes[:, block, t] >> (4 * r)) & 15, q[:, c] & 15), c
    assert torch.equal(lanes[:, 1, :] >> 4, torch.zeros(3, 32, dtype=torch.long))  # runs 1-3 of block 1: padding


@torch.no_grad()
@pytest.mark.parametrize("native", [True, False], ids=["native", "pytorch"])
def test_int4_linear_equals_the_dequantised_linear(native, monkeypatch):
    """Few rows (a decoding step: x rounded to 16-bit integers per row in the kernel) within that rounding's bound
    ``s_x / 2 · Σ|Ŵ|`` plus float32's ``γ_K``; many rows (panels of Ŵ through at::mm), and every row without the
    kernels, within ``γ_K`` of ``F.linear`` on the dequantised weight ``Ŵ``."""
    if not native:
        monkeypatch.setattr(_native, "available", lambda: False)
    elif not _native.available():
        pytest.skip("attnlab's native kernels are not built here")
    torch.manual_seed(0)
    lin = torch.nn.Linear(160, 40)
    q4 = Int4Linear.from_linear(lin, group_size=32)
    wd = q4.weight.double()
    for rows in (3, 80):
        x = torch.randn(rows, 160)
        ref = x.double() @ wd.T + lin.bias.double()
        bound = 162 * 2.0**-24 * (x.double().abs() @ wd.abs().T + lin.bias.double().abs()) + 1e-12
        if native and rows <= _native.INT4_ROWS:
            bound = bound + x.abs().amax(dim=1, keepdim=True).double() / 32767 / 2 * wd.abs().sum(dim=1)
        assert ((q4(x).double() - ref).abs() <= bound).all()


@torch.no_grad()
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_int4_model_equals_the_dequantised_model(family, make_gpt2, make_llama, ids):
    """A GPT-2 (LayerNorm, tied head) and a Llama (RMSNorm, SwiGLU, GQA: the fused decoding step's gated products):
    the prompt's logits within float32's reordering of the float model holding the dequantised weights (1e-5 ·
    max|logit|, as weight-only int8's), the same greedy tokens; the tied head shares the embedding's nibbles."""
    model = make_gpt2(n_embd=64) if family == "gpt2" else make_llama()
    q = quantize(model, "int4", group_size=32)
    assert any(isinstance(m, Int4Linear) for m in q.modules()) and not any(
        isinstance(m, torch.nn.Linear) for m in q.modules())
    if family == "gpt2":
        assert isinstance(q.wte, Int4Embedding) and q.lm_head.weight_int4 is q.wte.weight_int4
    ref = copy.deepcopy(model)
    for name, m in ref.named_modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            m.weight.copy_(q.get_submodule(name).weight)
    long_ids = torch.cat([ids] * 3, dim=1)  # 2 × 36 positions: more rows than the decoding kernel takes
    got, want = q(long_ids).logits, ref(long_ids).logits
    assert (got - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item())
    assert torch.equal(q.generate(ids[:, :4], max_new_tokens=6), ref.generate(ids[:, :4], max_new_tokens=6))


@torch.no_grad()
def test_int4_is_smaller_close_to_float32_and_reloads(make_gpt2):
    model = make_gpt2(n_embd=128, n_layer=2, vocab_size=500, n_positions=64)
    for p in model.parameters():  # GPT-2's own init scale
        if p.dim() > 1:
            p.normal_(0, 0.02)
    q = quantize(model, "int4")  # groups of 64
    assert state_dict_bytes(q) <= 0.2 * state_dict_bytes(model)
    ids = torch.randint(0, 500, (4, 32))
    ref, got = model(ids).logits, q(ids).logits
    # a group of 64 N(0, σ²) weights has max|w| ≈ 2.5σ: step d ≈ 0.31σ, rounding error d/√12 ≈ 0.09σ per weight, so
    # each matrix is off by ~9 % (int8: ~1 %); the logits carry the tied table's twice (√2 · 9 %) and the layers' in part
    assert _rel(got, ref) < 0.25
    other = quantize(make_gpt2(seed=1, n_embd=128, n_layer=2, vocab_size=500, n_positions=64), "int4")
    other(ids)
    other.load_state_dict(q.state_dict())
    assert torch.equal(other(ids).logits, got)
    half = quantize(model.bfloat16(), "int4", exclude=["lm_head"])
    assert half(ids).logits.dtype == torch.bfloat16


def test_int4_group_sizes_and_errors(make_gpt2):
    narrow = torch.nn.Sequential(torch.nn.Linear(96, 8), torch.nn.Linear(8, 4))
    q = quantize(narrow, "int4", exclude=["1"])
    assert q[0].group_size == 32  # 64 does not divide 96: the largest multiple of 32 that does
    for bad in (48, 0, 16, True, 65536):
        with pytest.raises(ValueError, match="group_size must be a positive multiple of 32"):
            quantize(narrow, "int4", group_size=bad)
    with pytest.raises(ValueError, match=r"'1' has 8 inputs, not a multiple of 32; keep it in floating point with "
                                         r"exclude=\['1'\], or quantise to int8"):
        quantize(narrow, "int4")
    with pytest.raises(ValueError, match="does not divide in_features=96"):
        quantize_groups(torch.randn(4, 96), 64)


def test_int4_tied_table_is_stored_and_read_once():
    """A head tied to its embedding shares the nibbles and scales; a decoding step reads them once: 64 columns take
    one block of 64 bytes (half of it padding) and two float32 scales a row in groups of 32."""
    from attnlab.nn.inference import decode_weight_bytes

    emb, head = torch.nn.Embedding(50, 64), torch.nn.Linear(64, 50, bias=False)
    head.weight = emb.weight
    q = quantize(torch.nn.ModuleDict({"emb": emb, "head": head}), "int4", group_size=32)
    assert q["head"].weight_int4 is q["emb"].weight_int4 and q["head"].weight_scale is q["emb"].weight_scale
    assert decode_weight_bytes(q) == 50 * 64 + 50 * 2 * 4 == state_dict_bytes(q)
    ids = torch.tensor([[3, 49, 0]])
    assert torch.equal(q["emb"](ids), q["emb"].weight[ids])  # rows as the dequantised table holds them


@torch.no_grad()
@pytest.mark.parametrize("mode", ["int8-weight", "int4"])
def test_quantised_tables_follow_the_models_dtype(mode, make_gpt2, ids):
    """``.double()`` / ``.float()`` on a quantised model change the rows its embedding tables return, as a float
    table's would (they used to stay float32 and the next LayerNorm, now float64, refused them)."""
    q = quantize(make_gpt2(n_embd=64), mode, **({"group_size": 32} if mode == "int4" else {}))
    ref = q(ids).logits
    wide = q.double()(ids).logits
    assert wide.dtype == torch.float64 and q.wte.out_dtype == torch.float64
    # the same quantised products; what differs is float32's rounding elsewhere, which can move x across a rounding
    # step of the products' own compute (int8-weight's many rows run in bf16: 2⁻⁸ relative)
    assert (wide - ref.double()).abs().max() <= 0.01 * ref.abs().max()
    assert q.float()(ids).logits.dtype == torch.float32
