"""Optimiser groups and learning-rate schedules, against independent formulas (nanoGPT's get_lr)."""
import math

import pytest
import torch
from torch import nn

from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel
from attnlab.training.optim import build_optimizer, param_groups
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
