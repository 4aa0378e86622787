"""The int8 training layer (attnlab.adapt.int8_training.Int8TrainingLinear) and the trainer's int8_training setting,
against float64.

The layer: the int32 sums are exact, so its forward equals diag(s_x) (q_x q_wᵀ) diag(s_w) + b computed in
float64 from the same integers within the rescaling's 3 ε (ε = 2⁻²⁴); against the float layer x Wᵀ + b it is off by
at most the roundings' bound Σ_j (s_x/2 |W_oj| + s_wo/2 |x_j| + s_x s_wo / 4) — the same for both gradients.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnlab import _native_train
from attnlab.adapt import int8_training as I
from _native_isas import EPS32, needs_native


def _layer(i, o, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(i, o, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0, 0.5)
        if bias:
            lin.bias.normal_(0, 1)
    return lin


def _emulated(x, w, b):
    """The int8 layer's forward and gradients computed in float64 from the same integers (module docstring)."""
    qx, sx = _native_train.quantize_rows(x, I.LEFT)
    qw, sw = _native_train.quantize_rows(w, I.RIGHT)
    qxc, sxc = _native_train.quantize_rows(x.t().contiguous(), I.RIGHT)
    y = sx.double()[:, None] * (qx.double() @ qw.double().t()) * sw.double() + (b.double() if b is not None else 0)
    return y, (qw, sw, qxc, sxc)


@needs_native
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(2, 40, 64), (70, 33)])
def test_the_layer_equals_its_integer_formula_and_stays_within_the_roundings_of_the_float_layer(bias, shape):
    lin = _layer(shape[-1], 48, bias)
    ref_lin = _layer(shape[-1], 48, bias)
    I.int8_training(lin, skip=())
    assert type(lin) is I.Int8TrainingLinear and lin.training
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(*shape, generator=gen) * 2).requires_grad_()
    y = lin(x)
    x2 = x.detach().reshape(-1, shape[-1])
    y_int, (qw, sw, qxc, sxc) = _emulated(x2, lin.weight.detach(), lin.bias)
    assert y.dtype == torch.float32 and y.shape == (*shape[:-1], 48)
    assert ((y.detach().reshape(-1, 48).double() - y_int).abs() <= 3 * EPS32 * (y_int.abs() + 1)).all()

    xd = x.detach().double().requires_grad_()
    yd = F.linear(xd, ref_lin.weight.double(), None if not bias else ref_lin.bias.double())
    _, sx = _native_train.quantize_rows(x2, I.LEFT)
    W = lin.weight.detach().double()
    bound = (sx.double()[:, None] / 2 * W.abs().sum(1) + sw.double() / 2 * x2.double().abs().sum(1, keepdim=True)
             + sx.double()[:, None] * sw.double() / 4 * shape[-1])
    assert ((y.detach().reshape(-1, 48).double() - yd.detach().reshape(-1, 48)).abs() <= bound * 1.001).all()

    g = torch.randn(*shape[:-1], 48, generator=gen)
    y.backward(g)
    yd.backward(g.double())
    g2 = g.reshape(-1, 48).double()
    # ∂L/∂x = diag(s_z) q(Z) q(W) with Z = G diag(s_w); ∂L/∂W = diag(s_g) q(G)ᵀ q(X) diag(s_c), from the same integers
    qz, sz = _native_train.quantize_rows(g.reshape(-1, 48), I.LEFT, sw)
    dx_int = sz.double()[:, None] * (qz.double() @ qw.double())
    assert ((x.grad.reshape(-1, shape[-1]).double() - dx_int).abs() <= 3 * EPS32 * (dx_int.abs() + 1)).all()
    qg, sg = _native_train.quantize_rows(g.reshape(-1, 48).t().contiguous(), I.LEFT)
    dw_int = sg.double()[:, None] * (qg.double() @ qxc.double().t()) * sxc.double()
    assert ((lin.weight.grad.double() - dw_int).abs() <= 3 * EPS32 * (dw_int.abs() + 1)).all()
    if bias:
        assert ((lin.bias.grad.double() - g2.sum(0)).abs() <= (g2.shape[0] + 2) * EPS32 * g2.abs().sum(0)).all()
    else:
        assert lin.bias is None
    # and each gradient within its roundings of the float layer's (relative to its scale: the bound's form above)
    for got, ref in ((x.grad, xd.grad), (lin.weight.grad, ref_lin.weight.grad)):
        err = (got.double() - ref).abs().max() / ref.abs().max()
        assert err < 0.05, f"relative error {err:.3g}: beyond 8- and 7-bit roundings"


@needs_native
def test_a_frozen_layer_gives_its_input_the_same_gradient_and_its_weight_none():
    lin, frozen = _layer(24, 16), _layer(24, 16)
    I.int8_training(lin, skip=()), I.int8_training(frozen, skip=())
    frozen.requires_grad_(False)
    x = torch.randn(9, 24, generator=torch.Generator().manual_seed(5))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    lin(xa).square().sum().backward()
    frozen(xb).square().sum().backward()
    assert torch.equal(xa.grad, xb.grad) and frozen.weight.grad is None and frozen.bias.grad is None


@needs_native
def test_the_node_computes_only_the_gradients_asked_for_from_any_input_layout():
    """The C++ autograd node: an input without a gradient (data), a strided 3-D input, a bias-free layer; each
    gradient equal to the native backward's on the same roundings, none where none is wanted."""
    gen = torch.Generator().manual_seed(9)
    lin = _layer(24, 16)
    I.int8_training(lin, skip=())
    x = torch.randn(2, 24, 5, generator=gen).transpose(1, 2)  # (2, 5, 24), not contiguous
    g = torch.randn(2, 5, 16, generator=gen)
    y = lin(x)  # x wants no gradient
    assert y.shape == (2, 5, 16) and y.requires_grad
    y.backward(g)
    _, qw, sw, qxt, sxc = _native_train.int8_linear(x.reshape(10, 24).contiguous(), lin.weight.detach(),
                                                    lin.bias.detach(), left=I.LEFT, right=I.RIGHT, cols=True,
                                                    dtype=torch.float32)
    _, dw, db = _native_train.int8_linear_backward(g.reshape(10, 16), qw, sw, qxt, sxc, left=I.LEFT, right=I.RIGHT,
                                                   dx=False, dw=True, db=True, dx_dtype=torch.float32)
    assert torch.equal(lin.weight.grad, dw) and torch.equal(lin.bias.grad, db)
    plain = nn.Linear(24, 16, bias=False)
    I.int8_training(plain, skip=())
    xr = x.detach().clone().requires_grad_()
    plain(xr).backward(g)
    assert xr.grad.shape == x.shape and plain.weight.grad.shape == (16, 24) and plain.bias is None
    with pytest.raises(RuntimeError, match=r"x \(T, in\) and w \(out, in\) must agree, got \[3, 23\]"):
        lin(torch.randn(3, 23))


@needs_native
def test_under_bf16_autocast_the_output_is_bf16_and_the_gradients_keep_the_parameters_float32():
    lin = _layer(64, 32)
    I.int8_training(lin, skip=())
    x = torch.randn(10, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and lin.weight.grad.dtype == torch.float32 and lin.bias.grad is not None
    xb = torch.randn(10, 64).bfloat16().requires_grad_()
    lin(xb).sum().backward()  # bf16 in: bf16 out and its gradient bf16
    assert xb.grad.dtype == torch.bfloat16


def test_evaluation_no_grad_and_other_dtypes_run_the_float_layer_exactly():
    lin, ref = _layer(16, 8), _layer(16, 8)
    I.int8_training(lin, skip=())
    x = torch.randn(5, 16)
    with torch.no_grad():
        assert torch.equal(lin(x), ref(x))
    lin.eval()
    assert torch.equal(lin(x), ref(x))
    lin.train()
    lin.double(), ref.double()
    assert torch.equal(lin(x.double()), ref(x.double()))
    assert lin.state_dict().keys() == ref.state_dict().keys()


def test_int8_training_converts_every_linear_layer_but_the_head():
    from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    names = I.int8_training(model)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    heads = [n for n in linears if n not in names]
    assert len(names) == 8 and heads == ["lm_head"]
    assert all(type(dict(model.named_modules())[n]) is I.Int8TrainingLinear for n in names)


@needs_native
def test_training_with_int8_products_learns_and_the_trainer_records_it(tmp_path):
    from attnlab.training.config import TrainConfig
    from attnlab.training.trainer import Trainer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(16, 16, generator=gen)

    def batches():
        while True:
            x = torch.randn(64, 16, generator=gen)
            yield x, x @ W

    def loss_fn(m, batch):
        return F.mse_loss(m(batch[0]), batch[1]), batch[0].shape[0]

    cfg = TrainConfig(max_steps=300, lr=1e-2, min_lr=1e-3, int8_training=True, progress=False, log_every=50)
    trainer = Trainer(model, cfg, train_batches=batches(), loss_fn=loss_fn, out_dir=tmp_path)
    assert all(type(m) is I.Int8TrainingLinear for m in (model[0], model[2]))
    metrics = trainer.fit()
    losses = [r["loss"] for r in trainer.history if r.get("kind") == "train"]
    assert metrics["int8_layers"] == 2 and losses[-1] < 0.05 * losses[0]


def test_int8_training_asked_for_with_compile_is_refused(tmp_path):
    from attnlab.training.config import TrainConfig
    from attnlab.training.trainer import Trainer

    cfg = TrainConfig(int8_training=True, compile=True, progress=False)
    with pytest.raises(ValueError, match="int8_training runs eagerly: compile=True"):
        Trainer(nn.Linear(4, 4), cfg, train_batches=iter([]), loss_fn=lambda m, b: (m(b).sum(), 1),
                out_dir=tmp_path)


def test_int8_training_must_be_a_bool_or_none():
    from attnlab.training.config import TrainConfig
    with pytest.raises(ValueError, match="int8_training must be True, False or None"):
        TrainConfig(int8_training="yes")


@needs_native
@pytest.mark.parametrize("dtype,compile,converted", [("fp32", False, 2), ("bf16", False, 0), ("fp32", True, 0)])
def test_int8_training_none_takes_int8_where_the_products_would_be_fp32(tmp_path, dtype, compile, converted):
    from attnlab.training.config import TrainConfig
    from attnlab.training.trainer import Trainer

    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    cfg = TrainConfig(max_steps=1, dtype=dtype, int8_training=None, compile=compile, progress=False)
    trainer = Trainer(model, cfg, train_batches=iter([]), loss_fn=lambda m, b: (m(b).sum(), 1), out_dir=tmp_path)
    assert len(trainer.int8_layers) == converted
    assert sum(type(m) is I.Int8TrainingLinear for m in model) == converted


@needs_native
@pytest.mark.parametrize("dtype,want", [("auto", "fp32"), ("bf16", "bf16"), ("fp32", "fp32")])
def test_int8_training_asked_for_makes_auto_fp32_and_keeps_an_explicit_dtype(tmp_path, dtype, want):
    """With int8 products a run's dtype="auto" is fp32 on any CPU (bf16 autocast would only cast around the int8
    products, and the fused layer node is float32); an explicit dtype is what was asked for."""
    from attnlab.training.config import TrainConfig
    from attnlab.training.trainer import Trainer

    cfg = TrainConfig(max_steps=1, dtype=dtype, int8_training=True, progress=False)
    trainer = Trainer(nn.Sequential(nn.Linear(8, 8)), cfg, train_batches=iter([]),
                      loss_fn=lambda m, b: (m(b).sum(), 1), out_dir=tmp_path)
    assert trainer.dtype == want and len(trainer.int8_layers) == 1
    assert ("int8" in trainer.dtype_reason) == (dtype == "auto")
