"""Inference layouts of ``nn.Linear`` (attnlab.nn.inference).

Oracles: ``F.linear`` on the same weights (float32: ≤ 1e-5, summation order only), and for bfloat16
a float64 product of the bf16-rounded input, weight and bias, rounded to bf16: ≤ 2⁻⁷ relative (one
bf16 rounding of the output after fp32 accumulation).
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnlab.nn import inference
from attnlab.nn.inference import PackedLinear, optimize_linears_

HAS_ONEDNN = {dt: inference._packable(torch.zeros(1, dtype=dt)) for dt in (torch.float32, torch.bfloat16)}


def _linear(i=48, o=80, bias=True):
    torch.manual_seed(0)
    lin = nn.Linear(i, o, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0, 0.5)
        if bias:
            lin.bias.uniform_(-1, 1)
    return lin


def _expected(x, lin, dtype):
    if dtype == torch.float32:
        return F.linear(x, lin.weight, lin.bias)
    def r(t):
        return None if t is None else t.bfloat16().double()

    return F.linear(r(x), r(lin.weight), r(lin.bias)).bfloat16().float()


def _close(y, ref, dtype):
    if dtype == torch.float32:
        return (y - ref).abs().max() <= 1e-5
    return ((y - ref).abs() <= 2**-7 * ref.abs() + 1e-6).all()


NATIVE = inference._native.available()


def _native_off(monkeypatch):
    monkeypatch.setattr(inference, "_native_rows", lambda w, rows: False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("packed", [True, False], ids=["onednn", "plain"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 7])
def test_packed_linear_equals_the_product(dtype, packed, bias, rows, monkeypatch):
    _native_off(monkeypatch)
    if packed and not HAS_ONEDNN[dtype]:
        pytest.skip(f"this torch build or CPU has no oneDNN {dtype} inner product")
    if not packed:
        monkeypatch.setattr(inference, "_packable", lambda w: False)
    lin = _linear(bias=bias)
    p = PackedLinear(lin, dtype=dtype)
    assert p.packed is packed and not p.native
    x = torch.randn(2, rows, 48)
    y = p(x)
    assert y.dtype == torch.float32 and y.shape == (2, rows, 80)
    assert _close(y, _expected(x, lin, dtype), dtype)
    assert torch.equal(p.weight, lin.weight.detach().to(dtype))
    if not packed:  # the fallback keeps out >= in weights column-major, MKL's faster GEMV layout
        assert p.weight_.t().is_contiguous()


@pytest.mark.skipif(not NATIVE, reason="attnlab's native kernels are not built here (attnlab env says why)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 4, 8])
def test_native_rows_equal_the_product_of_the_rounded_weight(dtype, bias, rows):
    """A layer packed for few rows keeps ``W`` plain for attnlab's matvec: ≤ max_rows rows run it (x stays
    float32, only ``W`` and ``b`` are rounded to ``dtype``), more rows ``F.linear``. Oracle: float64 product of
    x and the rounded weight and bias; float32 summation over 48 terms of size ≤ 4: ≤ 1e-5."""
    lin = _linear(bias=bias)
    p = PackedLinear(lin, dtype=dtype, rows=1)
    assert p.native and not p.packed and p.weight_.is_contiguous() and p.weight_.dtype == dtype
    x = torch.randn(rows, 48)
    r = (lambda t: None if t is None else t.to(dtype).double())
    ref = F.linear(x.double(), r(lin.weight), r(lin.bias))
    calls = []
    real = inference._native.matvec
    inference._native.matvec = lambda *a: calls.append(1) or real(*a)
    try:
        y = p(x)
    finally:
        inference._native.matvec = real
    native = rows <= inference._native.max_rows(dtype)  # fp32: up to 8 rows, bf16: 4
    assert calls == ([1] if native else [])
    assert y.dtype == torch.float32
    if native:
        assert (y.double() - ref).abs().max() <= 1e-5
    else:  # oneDNN's bf16 product: x rounded too
        assert _close(y, _expected(x, lin, dtype), dtype)
    many = torch.randn(2, 9, 48)  # 18 rows > max_rows: oneDNN (or F.linear) on the same plain weight
    assert _close(p(many), _expected(many, lin, dtype), dtype)


def test_packed_linear_state_dict_round_trip():
    lin = _linear()
    p = PackedLinear(lin)
    sd = p.state_dict()
    assert set(sd) == {"weight", "bias"} and torch.equal(sd["weight"], lin.weight.detach())
    with torch.no_grad():
        lin.weight.mul_(-1)
    q = PackedLinear(lin)
    p.load_state_dict(q.state_dict())
    x = torch.randn(4, 48)
    assert torch.equal(p(x), q(x))
    with pytest.raises(RuntimeError, match="weight"):
        p.load_state_dict({"weight": torch.zeros(3, 3), "bias": torch.zeros(80)})
    with pytest.raises(RuntimeError, match="bias"):
        p.load_state_dict({"weight": sd["weight"]})


def test_packed_linear_deepcopies():
    import copy

    p = PackedLinear(_linear(), rows=1)
    q = copy.deepcopy(p)  # oneDNN's packed tensor has no storage: copied through the dense weight
    x = torch.randn(3, 48)
    assert q.packed == p.packed and q.weight_ is not p.weight_ and torch.equal(q(x), p(x))


def test_packed_linear_errors():
    with pytest.raises(TypeError, match="linear"):
        PackedLinear(nn.Conv1d(2, 2, 1))
    with pytest.raises(ValueError, match="dtype"):
        PackedLinear(_linear(), dtype=torch.float16)
    with pytest.raises(ValueError, match="last dim 48"):
        PackedLinear(_linear())(torch.randn(2, 47))


def test_optimize_linears_walks_the_module_tree():
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 8), nn.Linear(8, 8)))
    x = torch.randn(5, 8)
    ref = model(x)
    sd = model.state_dict()
    optimize_linears_(model)
    assert all(isinstance(m, PackedLinear) for m in (model[0], model[2][0], model[2][1]))
    assert (model(x) - ref).abs().max() <= 1e-5
    assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="dtype"):
        optimize_linears_(model, dtype=torch.float16)
    bf16 = optimize_linears_(nn.Sequential(nn.Linear(8, 32)), dtype=torch.bfloat16)
    assert bf16[0].dtype == torch.bfloat16 and bf16(x).dtype == torch.float32


@pytest.mark.parametrize("rows", [1, 32, None])
def test_packed_linear_rows_is_a_tuning_hint_only(rows):
    lin = _linear()
    p = PackedLinear(lin, rows=rows)
    for n in (1, 5, 40):
        x = torch.randn(n, 48)
        assert (p(x) - lin(x)).abs().max() <= 1e-5
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="rows"):
            PackedLinear(lin, rows=bad)


def test_inference_layout_mixin_packs_for_its_rows():
    class Model(inference.InferenceLayoutMixin, nn.Module):
        packed_rows = 1

        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 16)

    m = Model().train()
    assert m.optimize_for_inference(dtype=torch.bfloat16) is m and not m.training
    assert m.proj.rows == 1 and m.proj.dtype == torch.bfloat16


@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_follows_module_to(bias):
    """``.to(float64)`` casts the dense weight and keeps it plain (float64 products, the float64 oracle to
    rounding); ``.to("cpu")`` on a CPU layer repacks the same weight (the same outputs)."""
    lin = _linear(bias=bias)
    p = PackedLinear(lin, rows=1)
    x = torch.randn(3, 48)
    before = p(x)
    layout = (p.native, p.packed)
    assert layout == (True, False) if NATIVE else layout == (False, HAS_ONEDNN[torch.float32])
    assert p.to("cpu") is p and (p.native, p.packed) == layout and torch.equal(p(x), before)
    p.to(torch.float64)
    assert p.dtype == torch.float64 and not p.packed and not p.native and p.weight.dtype == torch.float64
    y = p(x.double())
    ref = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
    assert y.dtype == torch.float64 and (y - ref).abs().max() <= 1e3 * torch.finfo(torch.float64).eps
    p.float()
    assert p.dtype == torch.float32 and (p.native, p.packed) == layout
    assert (p(x) - before).abs().max() <= 1e-5


@pytest.mark.parametrize("native", [True, False], ids=["native", "mkl"])
def test_a_tied_linear_shares_the_embedding_table(native, monkeypatch):
    """``share_tied`` (float32): the tied layer reads the embedding's table in place — row-major for attnlab's
    matvec, else stored column-major for MKL's GEMV — so the weights are held once; lookups and products keep
    their values."""
    if native and not NATIVE:
        pytest.skip("attnlab's native kernels are not built here (attnlab env says why)")
    if not native:
        _native_off(monkeypatch)
    torch.manual_seed(0)
    emb = nn.Embedding(50, 16)
    head = nn.Linear(16, 50, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    ids, x = torch.tensor([[3, 7, 49]]), torch.randn(2, 16)
    ref_rows, ref_logits = emb(ids), F.linear(x, emb.weight)
    optimize_linears_(model, rows=1)
    p = model["head"]
    assert not p.packed and p.native == native and p.weight_.data_ptr() == emb.weight.data_ptr()
    assert emb.weight.is_contiguous() if native else emb.weight.t().is_contiguous()
    assert torch.equal(emb(ids), ref_rows) and (p(x) - ref_logits).abs().max() <= 1e-5
    assert inference.decode_weight_bytes(model) == 50 * 16 * 4  # one table: the head reads it whole
    other = nn.ModuleDict({"emb": nn.Embedding(50, 16), "head": nn.Linear(16, 50, bias=False)})
    other["head"].weight = other["emb"].weight
    optimize_linears_(other, rows=1, share_tied=False)
    head = other["head"]
    assert head.native == native and head.packed == (HAS_ONEDNN[torch.float32] and not native)
    assert other["emb"].weight.is_contiguous() and head.weight.data_ptr() != other["emb"].weight.data_ptr()
