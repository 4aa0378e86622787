"""Optimiser groups and learning-rate schedules, against independent formulas (nanoGPT's get_lr)."""
import copy
import math

import pytest
import torch
from torch import nn

from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel
from attnlab.training.optim import FusedAdamW, build_optimizer, param_groups
from attnlab.training.config import TrainConfig
from attnlab.training.schedules import Schedule


def small_gpt():
    return GPT2LMHeadModel(GPT2Config(vocab_size=11, n_positions=8, n_embd=8, n_layer=1, n_head=2, embd_pdrop=0.0,
                                      resid_pdrop=0.0, attn_pdrop=0.0))


def test_weight_decay_groups_follow_the_dim_rule():
    model = small_gpt()
    decay, no_decay = param_groups(model, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    decayed = {names[id(p)] for p in decay["params"]}
    assert "wte.weight" in decayed and "wpe.weight" in decayed  # embeddings are 2-D: decayed (GPT-2/nanoGPT)
    assert not any("norm" in n or n.endswith("bias") for n in decayed)
    # the tied lm_head is the embedding: counted once
    total = sum(p.numel() for g in (decay, no_decay) for p in g["params"])
    assert total == sum(p.numel() for p in model.parameters())


def test_adamw_groups_match_a_plain_per_group_adamw():
    torch.manual_seed(0)
    a, b = small_gpt(), small_gpt()
    b.load_state_dict(a.state_dict())
    ours = build_optimizer(a, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)  # fused on CPU
    ref = torch.optim.AdamW([{"params": [p for p in b.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in b.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.99), eps=1e-8, foreach=False)
    assert ours.defaults["fused"] is True
    x = torch.randint(0, 11, (2, 8))
    for _ in range(3):
        for m, opt in ((a, ours), (b, ref)):
            opt.zero_grad()
            m(x).logits.square().mean().backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)  # fused vs for-loop kernels: float32 round-off


def _torch_fused(model, lr=1e-2):
    return torch.optim.AdamW([{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.99), eps=1e-8, fused=True)


def _steps(pairs, x, n):
    for _ in range(n):
        for m, opt in pairs:
            opt.zero_grad()
            m(x).logits.square().mean().backward()
            opt.step()


def test_fused_adamw_equals_torchs_fused_adamw_bit_for_bit_and_shares_its_state_format():
    """The same kernel on the same inputs: equal parameters after every step, with a changed lr, a parameter without
    a gradient skipped (no state made for it), and checkpoints crossing between the two in both directions."""
    torch.manual_seed(0)
    a, b = small_gpt(), small_gpt()
    b.load_state_dict(a.state_dict())
    ours, ref = build_optimizer(a, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1), _torch_fused(b)
    assert type(ours) is FusedAdamW and ours.defaults["fused"] is True
    x = torch.randint(0, 11, (2, 8))
    _steps(((a, ours), (b, ref)), x, 3)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    for opt in (ours, ref):  # the schedule's write
        for g in opt.param_groups:
            g["lr"] = 3e-3
    a.wpe.weight.requires_grad_(False)  # no gradient: skipped, as torch skips it
    b.wpe.weight.requires_grad_(False)
    _steps(((a, ours), (b, ref)), x, 2)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    theirs, mine = ref.state_dict(), ours.state_dict()
    assert [{k: v for k, v in g.items()} for g in mine["param_groups"]] == theirs["param_groups"]
    assert mine["state"].keys() == theirs["state"].keys()
    for i, st in theirs["state"].items():
        assert all(torch.equal(st[k], mine["state"][i][k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    # a checkpoint of torch's AdamW continues in ours, and ours in torch's, identically
    c, d = copy.deepcopy(b), copy.deepcopy(a)
    for m in (c, d):  # the groups as the run built them (every parameter trainable)
        m.wpe.weight.requires_grad_(True)
    ours2 = build_optimizer(c, lr=1.0, betas=(0.5, 0.5), eps=1e-8, weight_decay=0.1)
    ours2.load_state_dict(copy.deepcopy(theirs))
    ref2 = _torch_fused(d, lr=1.0)
    ref2.load_state_dict(copy.deepcopy(mine))
    assert ours2.param_groups[0]["lr"] == 3e-3 and ours2.param_groups[0]["betas"] == (0.9, 0.99)
    c.wpe.weight.requires_grad_(False)
    d.wpe.weight.requires_grad_(False)
    _steps(((a, ours), (b, ref), (c, ours2), (d, ref2)), x, 2)
    for p, q, r, t in zip(a.parameters(), b.parameters(), c.parameters(), d.parameters()):
        assert torch.equal(p, q) and torch.equal(p, r) and torch.equal(p, t)
    for m in (a, b):  # its gradient back: its own step count goes on from where it stopped (3), the others' from 7
        m.wpe.weight.requires_grad_(True)
    _steps(((a, ours), (b, ref)), x, 2)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    steps = {i: st["step"] for i, st in ours.state_dict()["state"].items()}
    counts = {i: float(v) for i, v in steps.items()}
    assert counts == {i: float(st["step"]) for i, st in ref.state_dict()["state"].items()}
    assert sorted(set(counts.values())) == [5.0, 9.0]
    assert len({v.untyped_storage().data_ptr() for v in steps.values()}) == len(steps)  # each its own scalar
    with pytest.raises(ValueError, match="does not match the parameter groups"):
        ours.load_state_dict({"state": {}, "param_groups": theirs["param_groups"][:1]})
    with pytest.raises(ValueError, match="not AdamW's for these parameters"):  # e.g. Adafactor's state
        ours.load_state_dict({"state": {0: {"step": torch.tensor(1.0), "row_var": torch.zeros(3)}},
                              "param_groups": theirs["param_groups"]})
    with pytest.raises(ValueError, match="floating-point CPU or CUDA"):
        FusedAdamW([{"params": [torch.zeros(2, dtype=torch.long)]}], lr=1e-3, betas=(0.9, 0.99), eps=1e-8,
                   weight_decay=0.0)


def test_building_and_stepping_adamw_does_not_import_torch_dynamo():
    """torch.optim's Optimizer imports torch._dynamo at its first add_param_group (~1 s of every process)."""
    import subprocess
    import sys
    code = ("import sys, torch\n"
            "from attnlab.training.optim import build_optimizer\n"
            "m = torch.nn.Linear(4, 4)\n"
            "opt = build_optimizer(m, lr=1e-3, weight_decay=0.1)\n"
            "m(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()\n"
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_adafactor_and_errors():
    model = small_gpt()
    assert isinstance(build_optimizer(model, name="adafactor", lr=1e-2, weight_decay=0.0), torch.optim.Adafactor)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        build_optimizer(model, name="sgd", lr=1e-2)
    with pytest.raises(ValueError, match="lr"):
        build_optimizer(model, lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        build_optimizer(model, lr=1e-3, betas=(0.9, 1.5))
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable"):
        build_optimizer(frozen, lr=1e-3)


def nanogpt_get_lr(it, learning_rate, min_lr, warmup_iters, lr_decay_iters):
    """nanoGPT train.py's get_lr, verbatim."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


def test_cosine_is_nanogpt_get_lr():
    s = Schedule("cosine", lr=1e-3, min_lr=1e-4, warmup_steps=100, total_steps=2000)
    for it in list(range(0, 2100, 7)) + [99, 100, 101, 1999, 2000, 2001]:
        assert s.lr_at(it) == pytest.approx(nanogpt_get_lr(it, 1e-3, 1e-4, 100, 2000), rel=1e-12, abs=0)


def test_noam_and_constant():
    s = Schedule("noam", lr=2.0, warmup_steps=4)
    for step in range(12):
        t = step + 1
        assert s.lr_at(step) == pytest.approx(2.0 * min(t / 4, math.sqrt(4 / t)), rel=1e-12)
    assert max(range(50), key=s.lr_at) == 3  # peak at t = w
    c = Schedule("constant", lr=0.5, warmup_steps=3)
    assert [c.lr_at(i) for i in range(5)] == [0.125, 0.25, 0.375, 0.5, 0.5]


def test_wsd_is_warmup_then_flat_then_a_linear_decay():
    """w = 10, S = 110, f = 0.25: the decay starts at d = 10 + 0.75 · 100 = 85 and reaches η_min at 110."""
    s = Schedule("wsd", lr=1.0, min_lr=0.1, warmup_steps=10, total_steps=110, decay_fraction=0.25)
    assert [s.lr_at(i) for i in (0, 9)] == pytest.approx([1 / 11, 10 / 11], rel=1e-12)  # the shared warm-up
    assert {s.lr_at(i) for i in range(10, 86)} == {1.0}
    for i in range(85, 111):
        assert s.lr_at(i) == pytest.approx(0.1 + 0.9 * (110 - i) / 25, rel=1e-12)
    assert s.lr_at(111) == s.lr_at(500) == 0.1
    with pytest.raises(ValueError, match=r"decay_fraction must be in \(0, 1\]"):
        Schedule("wsd", lr=1.0, decay_fraction=0.0)
    for bad in (True, float("nan")):
        with pytest.raises(ValueError, match="decay_fraction"):
            Schedule("wsd", lr=1.0, decay_fraction=bad)
    with pytest.raises(ValueError, match="TrainConfig.decay_fraction must be a number in"):
        TrainConfig(schedule="wsd", decay_fraction=1.5)
    whole = Schedule("wsd", lr=1.0, warmup_steps=0, total_steps=10, decay_fraction=1.0)  # f = 1: linear from step 0
    assert [whole.lr_at(i) for i in range(11)] == pytest.approx([1 - i / 10 for i in range(11)], rel=1e-12)


def test_lambda_lr_view_matches_lr_at():
    model = nn.Linear(2, 2)
    s = Schedule("cosine", lr=0.1, min_lr=0.01, warmup_steps=3, total_steps=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = s.lambda_lr(opt)
    for step in range(12):
        assert opt.param_groups[0]["lr"] == pytest.approx(s.lr_at(step), rel=1e-12)
        opt.step()
        sched.step()


@pytest.mark.parametrize("kwargs, match", [
    (dict(kind="linear", lr=1.0), "schedule must be one of"),
    (dict(kind="cosine", lr=1.0, min_lr=2.0), "min_lr"),
    (dict(kind="noam", lr=1.0, warmup_steps=0), "warmup_steps must be >= 1"),
    (dict(kind="cosine", lr=float("nan")), "lr must be"),
    (dict(kind="cosine", lr=1.0, total_steps=0), "total_steps"),
])
def test_schedule_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Schedule(**kwargs)


# ---- Muon ------------------------------------------------------------------------------------------------------
def newton_schulz_by_svd(u, steps=5):
    """The oracle: NS acts on the singular values alone, ``U diag(φᵏ(σ / ‖σ‖)) Vᵀ`` with ``φ(s) = a s + b s³ + c s⁵``."""
    a, b, c = 3.4445, -4.7750, 2.0315
    U, S, Vh = torch.linalg.svd(u.double(), full_matrices=False)
    s = S / S.norm()
    for _ in range(steps):
        s = a * s + b * s ** 3 + c * s ** 5
    return U @ torch.diag(s) @ Vh


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (16, 16)])
def test_orthogonalize_is_newton_schulz_on_the_singular_values(shape):
    from attnlab.training.optim import orthogonalize
    u = torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    o = orthogonalize(u, dtype=torch.float64, eps=0.0)
    assert o.dtype == torch.float64 and o.shape == shape
    torch.testing.assert_close(o, newton_schulz_by_svd(u), rtol=0, atol=1e-12)
    s = torch.linalg.svdvals(o)
    assert s.min() > 0.6 and s.max() < 1.2  # the quintic's band: all directions at about the same size
    o32 = orthogonalize(u.float())  # float32 products: within float32 round-off of the oracle
    assert o32.dtype == torch.float32
    torch.testing.assert_close(o32.double(), newton_schulz_by_svd(u), rtol=0, atol=1e-5)


@pytest.mark.parametrize("lr_scale, ns_steps", [(1.0, 5), (2.5, 3)])
def test_muon_step_is_the_documented_update(lr_scale, ns_steps):
    """Three steps in float64 against the formula: M ← μM + g, U = g + μM, θ ← θ(1 − lr_M λ) − lr_M · 0.2√max(A,B) ·
    NS(U) with lr_M = lr_scale · lr; a wide, a tall (stacked with it, transposed) and a square matrix."""
    from attnlab.training.optim import Muon
    g = torch.Generator().manual_seed(1)
    shapes = [(12, 20), (20, 12), (12, 12)]
    ws = [nn.Parameter(torch.randn(*s, generator=g, dtype=torch.float64)) for s in shapes]
    thetas, ms = [w.detach().clone() for w in ws], [torch.zeros_like(w) for w in ws]
    lr, wd, mu = 0.03, 0.1, 0.95
    opt = Muon(ws, lr=lr, weight_decay=wd, momentum=mu, ns_dtype=torch.float64, lr_scale=lr_scale, ns_steps=ns_steps)
    lr_m = lr_scale * lr
    for _ in range(3):
        grads = [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]
        for w, grad in zip(ws, grads):
            w.grad = grad.clone()
        opt.step()
        for i, grad in enumerate(grads):
            ms[i] = mu * ms[i] + grad
            thetas[i] = (thetas[i] * (1 - lr_m * wd)
                         - lr_m * 0.2 * math.sqrt(max(shapes[i])) * newton_schulz_by_svd(grad + mu * ms[i], ns_steps))
            # ε = 1e-7 in NS's normalisation (U / (‖U‖ + ε), ‖U‖ ≈ 50) moves the update (≈ 0.03) by ~2e-9 relative
            torch.testing.assert_close(ws[i].detach(), thetas[i], rtol=0, atol=1e-9)


def test_muon_agrees_with_torchs_muon():
    """torch.optim.Muon with Moonshot's lr rule (its Newton–Schulz in bf16): ours in bf16 too, the same update within
    bf16's round-off through five products (relative Frobenius difference of the updates < 5 %)."""
    from attnlab.training.optim import Muon
    g = torch.Generator().manual_seed(2)
    a = nn.Parameter(torch.randn(64, 160, generator=g))
    b = nn.Parameter(a.detach().clone())
    start = a.detach().clone()
    ours = Muon([a], lr=0.02, weight_decay=0.1, ns_dtype=torch.bfloat16)
    ref = torch.optim.Muon([b], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        grad = torch.randn(64, 160, generator=g)
        a.grad, b.grad = grad.clone(), grad.clone()
        ours.step()
        ref.step()
    d_ours, d_ref = a.detach() - start, b.detach() - start
    assert (d_ours - d_ref).norm() / d_ref.norm() < 0.05


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    from attnlab.models.llama import LlamaConfig, LlamaForCausalLM
    from attnlab.training.optim import MuonWithAdamW, muon_parameters
    for tied in (True, False):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=13, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, tie_word_embeddings=tied))
        opt = build_optimizer(model, name="muon", lr=1e-2, weight_decay=0.1)
        assert isinstance(opt, MuonWithAdamW)
        names = {id(p): n for n, p in model.named_parameters()}
        on_muon = {names[id(p)] for p in muon_parameters(model)}
        assert on_muon == {n for n in names.values() if n.startswith("layers.") and n.endswith("proj.weight")
                           or ".ffn.w" in n}  # q/k/v/o and the MLP; not the embedding, the head or the gains
        groups = opt.param_groups
        assert sum(len(g["params"]) for g in groups) == len(names)  # every parameter once
        adamw_names = {names[id(p)] for g in opt.parts["adamw"].param_groups for p in g["params"]}
        assert "embed_tokens.weight" in adamw_names and ("lm_head.weight" in adamw_names) is (not tied)
        for g in groups:  # the trainer's schedule writes every group's lr
            g["lr"] = 5e-3
        assert all(g["lr"] == 5e-3 for part in opt.parts.values() for g in part.param_groups)


def test_muon_errors_and_state_round_trip():
    from attnlab.training.optim import Muon
    with pytest.raises(ValueError, match="matrices only"):
        Muon([nn.Parameter(torch.zeros(3))], lr=1e-2)
    with pytest.raises(ValueError, match="momentum"):
        Muon([nn.Parameter(torch.zeros(3, 3))], lr=1e-2, momentum=1.0)
    with pytest.raises(ValueError, match="lr_scale"):
        Muon([nn.Parameter(torch.zeros(3, 3))], lr=1e-2, lr_scale=0.0)
    with pytest.raises(ValueError, match="ns_steps"):
        build_optimizer(small_gpt(), name="muon", lr=1e-2, muon_ns_steps=0)
    assert build_optimizer(small_gpt(), name="muon", lr=1e-2, muon_lr_scale=4.0).parts["muon"].lr_scale == 4.0
    with pytest.raises(ValueError, match="no nn.Linear weight"):
        build_optimizer(nn.Embedding(4, 3), name="muon", lr=1e-2)
    model = small_gpt()
    adamw = build_optimizer(model, lr=1e-2)
    muon = build_optimizer(model, name="muon", lr=1e-2)
    with pytest.raises(ValueError, match="optimizer the run was started with"):
        muon.load_state_dict(adamw.state_dict())
    x = torch.randint(0, 11, (2, 8))
    model(x).logits.square().mean().backward()
    muon.step()
    other = small_gpt()
    other.load_state_dict(model.state_dict())
    twin = build_optimizer(other, name="muon", lr=1e-2)
    # as from a checkpoint file (torch's load_state_dict keeps same-device tensors: a deep copy, not shared buffers);
    # momentum buffers and AdamW moments carried over: the next steps agree
    twin.load_state_dict(copy.deepcopy(muon.state_dict()))
    for m, opt in ((model, muon), (other, twin)):
        opt.zero_grad()
        m(x).logits.square().mean().backward()
        opt.step()
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q)


def test_fused_adamw_keeps_equal_to_torchs_when_its_state_is_replaced():
    """The kept call lists follow a state replaced whole (a reset): both optimizers start their moments and counts
    over, bit for bit."""
    torch.manual_seed(0)
    p, q = torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3))
    p2, q2 = (torch.nn.Parameter(t.detach().clone()) for t in (p, q))
    ours = FusedAdamW([{"params": [p, q]}], lr=0.1, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    ref = torch.optim.AdamW([p2, q2], lr=0.1, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, fused=True)
    for step in range(6):
        for a, b in ((p, p2), (q, q2)):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        ours.step()
        ref.step()
        if step == 2:
            ours.state = {}
            ref.state.clear()
    assert torch.equal(p, p2) and torch.equal(q, q2)
    assert float(ours.state[p]["step"]) == float(ref.state[p2]["step"]) == 3.0
