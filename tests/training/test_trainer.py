"""The training loop: exact resume, accumulation, clipping, mixed precision, NaN stop, outputs."""
import copy
import json
import math
import types

import pytest
import torch

from attnlab.training.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from attnlab.training.losses import causal_lm_loss, token_cross_entropy
from attnlab.training.trainer import TrainConfig, Trainer, TrainingDivergedError, enable_gradient_checkpointing

VOCAB, BLOCK = 17, 16  # as the tiny_gpt fixture (tests/training/conftest.py)


def params(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def assert_bitwise_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


class CrashAfter:
    """A loss_fn that raises (like a killed process) on call number ``n + 1``."""

    def __init__(self, n):
        self.n, self.calls = n, 0

    def __call__(self, model, batch):
        self.calls += 1
        if self.calls > self.n:
            raise KeyboardInterrupt("simulated crash")
        return causal_lm_loss(model, batch)


def strip_timing(records):
    return [{k: v for k, v in r.items() if k not in ("elapsed_s", "tokens_per_s")} for r in records]


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("grad_accum, optimizer", [(1, "adamw"), (2, "adamw"), (1, "muon")])
def test_resume_is_bitwise_exact(tmp_path, make_trainer, grad_accum, optimizer):
    """12 steps straight == 6 steps, crash in step 7, resume, 6 more (CPU fp32, dropout 0.1 on)."""
    straight = make_trainer(tmp_path / "a", grad_accum=grad_accum, eval_every=4, checkpoint_every=3,
                            optimizer=optimizer)
    m_a = straight.fit()
    crash = make_trainer(tmp_path / "b", grad_accum=grad_accum, eval_every=4, checkpoint_every=3,
                         loss_fn=CrashAfter(6 * grad_accum + 1), optimizer=optimizer)
    with pytest.raises(KeyboardInterrupt):
        crash.fit()
    assert latest_checkpoint(tmp_path / "b").name == "ckpt-00000006.pt"
    resumed = make_trainer(tmp_path / "b", grad_accum=grad_accum, eval_every=4, checkpoint_every=3,
                           init_seed=123, optimizer=optimizer)  # different initial weights: from the checkpoint
    m_b = resumed.fit(resume=True)
    assert_bitwise_equal(params(straight), params(resumed))
    assert m_b["val_loss"] == m_a["val_loss"] and m_b["best_val_loss"] == m_a["best_val_loss"]
    assert m_b["steps"] == 12 and m_b["train_tokens"] == m_a["train_tokens"]
    # the resumed log reads as one run: same records, no step logged twice
    assert strip_timing(read_jsonl(tmp_path / "b" / "metrics.jsonl")) == \
        strip_timing(read_jsonl(tmp_path / "a" / "metrics.jsonl"))


def test_evaluation_does_not_change_the_trajectory(tmp_path, make_trainer):
    a = make_trainer(tmp_path / "a", eval_every=1)
    b = make_trainer(tmp_path / "b", evaluate=False)
    a.fit()
    b.fit()
    assert_bitwise_equal(params(a), params(b))


def test_resume_without_checkpoint_starts_fresh_and_fresh_run_refuses_old_checkpoints(tmp_path, make_trainer):
    a = make_trainer(tmp_path / "a", max_steps=4)
    a.fit()
    b = make_trainer(tmp_path / "b", max_steps=4)
    b.fit(resume=True)  # nothing to resume: same as a fresh run
    assert_bitwise_equal(params(a), params(b))
    with pytest.raises(ValueError, match="already holds checkpoints"):
        make_trainer(tmp_path / "a", max_steps=4).fit()


def test_resume_refuses_integer_weights_for_float_parameters_by_name(tmp_path, make_trainer):
    a = make_trainer(tmp_path / "a", max_steps=2, checkpoint_every=2)
    a.fit()
    state = a.state_dict()
    name = next(iter(state["model"]))
    state["model"][name] = state["model"][name].view(torch.int32)  # the same bytes, read as integers
    with pytest.raises(ValueError, match=rf"{name} of the checkpoint is stored as torch.int32.*torch.float32"):
        make_trainer(tmp_path / "b", max_steps=2).load_state_dict(state)


def capture_grads(trainer):
    """Record the gradients handed to the optimiser at every step."""
    seen, orig_step = [], trainer.optimizer.step

    def step(*a, **k):
        seen.append([p.grad.clone() for p in trainer.model.parameters()])
        return orig_step(*a, **k)
    trainer.optimizer.step = step
    return seen


def test_grad_accumulation_equals_the_big_batch(tmp_path, tiny_gpt):
    torch.manual_seed(0)
    xs = [torch.randint(0, VOCAB, (8, BLOCK)) for _ in range(3)]
    batches = [(x, torch.roll(x, -1, 1)) for x in xs]
    halves = [(x[i:i + 4], y[i:i + 4]) for x, y in batches for i in (0, 4)]
    cfg = dict(max_steps=3, lr=1e-2, progress=False, warmup_steps=0, weight_decay=0.1)
    big = Trainer(tiny_gpt(dropout=0.0), TrainConfig(**cfg), train_batches=iter(batches), loss_fn=causal_lm_loss,
                  out_dir=tmp_path / "big")
    acc = Trainer(tiny_gpt(dropout=0.0), TrainConfig(**cfg, grad_accum=2), train_batches=iter(halves),
                  loss_fn=causal_lm_loss, out_dir=tmp_path / "acc")
    g_big, g_acc = capture_grads(big), capture_grads(acc)
    mb, ma = big.fit(), acc.fit()
    for step_big, step_acc in zip(g_big, g_acc):  # (1/2)(mean over half 1 + mean over half 2) = mean over 8 rows
        for a, b in zip(step_acc, step_big):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)  # float32 summation order
    assert len(g_big) == len(g_acc) == 3
    assert ma["train_tokens"] == mb["train_tokens"] == 3 * 8 * BLOCK
    assert ma["train_loss"] == pytest.approx(mb["train_loss"], rel=1e-6)


def test_clipping_bounds_the_update(tmp_path, make_trainer):
    """With clip c the gradient fed to the optimiser has norm <= c (checked on a plain SGD step)."""
    t = make_trainer(tmp_path, max_steps=2, clip=1e-3, dropout=0.0, evaluate=False)
    seen = capture_grads(t)
    t.fit()
    assert len(seen) == 2
    for grads in seen:
        assert torch.nn.utils.get_total_norm(grads).item() <= 1e-3 * (1 + 1e-4)


def test_bf16_autocast_on_cpu(tmp_path, make_trainer):
    dtypes = []

    def loss_fn(model, batch):
        x, y = batch
        logits = model(x).logits
        dtypes.append(logits.dtype)
        return token_cross_entropy(logits, y), y.numel()
    fp32 = make_trainer(tmp_path / "a", max_steps=3, dropout=0.0).fit()
    bf16 = make_trainer(tmp_path / "b", max_steps=3, dropout=0.0, dtype="bf16", loss_fn=loss_fn).fit()
    assert set(dtypes) == {torch.bfloat16}
    assert math.isfinite(bf16["train_loss"]) and abs(bf16["train_loss"] - fp32["train_loss"]) < 0.05
    with pytest.raises(ValueError, match="fp16.*CUDA"):
        make_trainer(tmp_path / "c", dtype="fp16")


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, make_trainer):
    calls = []

    def poisoned(model, batch):
        calls.append(1)
        loss, n = causal_lm_loss(model, batch)
        return (loss * float("nan") if len(calls) == 5 else loss), n
    t = make_trainer(tmp_path, checkpoint_every=2, loss_fn=poisoned)
    with pytest.raises(TrainingDivergedError, match=r"step 5: loss is nan.*ckpt-00000004\.pt"):
        t.fit()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000002.pt", "ckpt-00000004.pt"]
    state = load_checkpoint(latest_checkpoint(tmp_path))
    assert state["step"] == 4 and all(torch.isfinite(v).all() for v in state["model"].values())
    assert all(torch.isfinite(p).all() for p in t.model.parameters())  # the bad update was never applied


def test_gradient_checkpointing_gives_equal_gradients(tiny_gpt):
    torch.manual_seed(0)
    plain = tiny_gpt(dropout=0.1)
    ckpt = copy.deepcopy(plain)
    enable_gradient_checkpointing(ckpt)
    assert ckpt.state_dict().keys() == plain.state_dict().keys()
    x = torch.randint(0, VOCAB, (3, BLOCK))
    for m in (plain, ckpt):
        torch.manual_seed(7)  # same dropout masks (checkpoint replays the RNG in recompute)
        m(x).logits.square().mean().backward()
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7, msg=name)
    with torch.no_grad():  # no grad: the plain forward, same output
        torch.testing.assert_close(ckpt.eval()(x).logits, plain.eval()(x).logits)
    with pytest.raises(ValueError, match="grad_checkpointing"):
        enable_gradient_checkpointing(torch.nn.Linear(2, 2))


def test_outputs_and_max_seconds(tmp_path, make_trainer):
    m = make_trainer(tmp_path / "a", eval_every=5, log_every=2, keep_checkpoints=1, checkpoint_every=4).fit()
    out = tmp_path / "a"
    saved = json.loads((out / "metrics.json").read_text())
    for key in ("val_loss", "best_val_loss", "best_step", "train_tokens_per_s", "wall_s", "steps", "train_loss"):
        assert key in saved and saved[key] == m[key]
    recs = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in recs if r["kind"] == "eval"] == [5, 10, 12]
    assert [r["step"] for r in recs if r["kind"] == "train"] == [2, 4, 6, 8, 10, 12]
    assert saved["best_val_loss"] == min(r["val_loss"] for r in recs if r["kind"] == "eval")
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in list_checkpoints(out)] == ["ckpt-00000012.pt"]
    # a wall budget stops at a step boundary, with a final evaluation and checkpoint
    m = make_trainer(tmp_path / "b", max_steps=10_000, max_seconds=0.5).fit()
    assert 0 < m["steps"] < 10_000 and "val_loss" in m
    assert latest_checkpoint(tmp_path / "b").name == f"ckpt-{m['steps']:08d}.pt"


@pytest.mark.parametrize("field, value, match", [
    ("max_steps", 0, "max_steps must be an int >= 1"),
    ("lr", 0.0, "lr must be > 0"),
    ("min_lr", 1.0, "min_lr must be <= lr"),
    ("dtype", "fp8", "dtype must be one of"),
    ("optimizer", "sgd", "optimizer must be one of"),
    ("schedule", "step", "schedule must be one of"),
    ("betas", (0.9,), "betas must be two numbers"),
    ("grad_accum", 1.5, "grad_accum must be an int"),
    ("max_seconds", -1, "max_seconds must be None or a number > 0"),
    ("compile", "yes", "compile must be a bool"),
    ("muon_lr_scale", -1.0, "muon_lr_scale must be a finite number > 0"),
    ("muon_ns_steps", 0, "muon_ns_steps must be an int >= 1"),
    ("muon_lr_scale", 4.0,
     r"muon_lr_scale must be left at its default \(1.0, muon_ns_steps 5\) unless optimizer='muon'"),
])
def test_config_errors_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=f"TrainConfig.{match}"):
        TrainConfig(**{field: value})


def test_muon_settings_without_muon_are_refused_unless_at_a_default():
    """Muon's settings are unused by another optimiser: refused unless at TrainConfig's defaults or at those of a
    recipe's settings class (so a recipe whose default is Muon can still be run with ``optimizer=adamw``)."""
    from dataclasses import dataclass

    @dataclass
    class MuonFirst(TrainConfig):
        optimizer: str = "muon"
        muon_lr_scale: float = 2.0
        muon_ns_steps: int = 3

    assert MuonFirst(optimizer="adamw").muon_lr_scale == 2.0  # the class's defaults: accepted
    assert MuonFirst(optimizer="adamw", muon_lr_scale=1.0, muon_ns_steps=5).optimizer == "adamw"  # TrainConfig's
    with pytest.raises(ValueError, match=r"muon_lr_scale must be left at its default \(2.0, muon_ns_steps 3\)"):
        MuonFirst(optimizer="adamw", muon_ns_steps=4)
    with pytest.raises(ValueError, match=r"left at its default \(1.0, muon_ns_steps 5\)"):
        TrainConfig(muon_lr_scale=2.0, muon_ns_steps=3)
    # the trainer's own config of such settings: Muon's fields only with Muon
    plain = TrainConfig.of(MuonFirst(optimizer="adamw", lr=3e-3))
    assert type(plain) is TrainConfig and (plain.optimizer, plain.lr) == ("adamw", 3e-3)
    assert (plain.muon_lr_scale, plain.muon_ns_steps) == (1.0, 5)
    assert (TrainConfig.of(MuonFirst()).muon_lr_scale, TrainConfig.of(MuonFirst()).muon_ns_steps) == (2.0, 3)


def test_trainer_argument_errors(tmp_path, tiny_gpt):
    model = tiny_gpt()
    with pytest.raises(TypeError, match="config must be a TrainConfig"):
        Trainer(model, {}, train_batches=iter([]), loss_fn=causal_lm_loss, out_dir=tmp_path)
    with pytest.raises(TypeError, match="train_batches must be an iterator"):
        Trainer(model, TrainConfig(), train_batches=[1, 2], loss_fn=causal_lm_loss, out_dir=tmp_path)
    with pytest.raises(TypeError, match="evaluate"):
        Trainer(model, TrainConfig(), train_batches=iter([]), loss_fn=causal_lm_loss, evaluate=3, out_dir=tmp_path)


class FakeClock:
    """The trainer's clock (``time.perf_counter`` as trainer.py and pacing.py read it), advanced only by the loss
    functions from :meth:`ticking`: a time-budget test then plans the same steps on any machine, however slow or
    busy (the rule: no result may depend on the machine's speed)."""

    def __init__(self, monkeypatch):
        from attnlab.training import pacing, trainer
        self.t = 0.0
        for module in (trainer, pacing):
            monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=lambda: self.t))

    def ticking(self, loss_fn=causal_lm_loss, *, seconds, after=None, then=None):
        """``loss_fn`` that advances the clock by ``seconds`` a call (``then`` from call ``after + 1`` on)."""
        calls = [0]

        def loss(model, batch):
            calls[0] += 1
            self.t += then if after is not None and calls[0] > after else seconds
            return loss_fn(model, batch)
        return loss


def test_a_budget_that_holds_more_steps_than_max_steps_stops_at_max_steps(tmp_path, make_trainer, monkeypatch):
    """max_steps caps the plan (the shakespeare-char default's ~9.8 epochs): a fast machine ends the same run early,
    its cosine complete at the cap, instead of training past it."""
    from attnlab.training.trainer import PLAN_AT
    clock = FakeClock(monkeypatch)
    cap = PLAN_AT + 30
    m = make_trainer(tmp_path / "a", max_steps=cap, time_budget=60.0, eval_every=0, log_every=5,
                     loss_fn=clock.ticking(seconds=0.005)).fit()
    recs = read_jsonl(tmp_path / "a" / "metrics.jsonl")
    (plan,) = [r for r in recs if r["kind"] == "plan"]
    assert plan["max_steps"] == cap and m["steps"] == cap and m["wall_s"] < 5.0  # 60 s would have held ~11,000
    assert [r["lr"] for r in recs if r["kind"] == "train"][-1] == pytest.approx(1e-3, rel=0.05)  # at min_lr


def test_time_budget_plans_the_run_and_resume_keeps_the_plan(tmp_path, make_trainer, monkeypatch):
    from attnlab.training.trainer import PLAN_AT
    clock = FakeClock(monkeypatch)
    m = make_trainer(tmp_path / "a", max_steps=100_000, time_budget=2.0, eval_every=25, log_every=5,
                     loss_fn=clock.ticking(seconds=0.005)).fit()
    recs = read_jsonl(tmp_path / "a" / "metrics.jsonl")
    (plan,) = [r for r in recs if r["kind"] == "plan"]
    assert plan["step"] == PLAN_AT and PLAN_AT < plan["max_steps"] < 100_000 and plan["step_s"] > 0
    replans = [r for r in recs if r["kind"] == "replan"]  # at evaluations, when the measured pace differs
    assert all(r["step"] % 25 == 0 for r in replans)
    assert m["steps"] == (replans or [plan])[-1]["max_steps"]
    # on any machine: 97 % of the budget left after PLAN_AT 5-ms steps, less 1 s for the final files, in 5-ms steps
    assert plan["max_steps"] == PLAN_AT + int(0.97 * (2.0 - PLAN_AT * 0.005 - 1.0) / 0.005) and m["wall_s"] <= 2.0
    last_lr = [r["lr"] for r in recs if r["kind"] == "train"][-1]
    assert last_lr == pytest.approx(1e-3, rel=0.05)  # the cosine reached min_lr inside the budget
    # crash after the plan, resume: the planned length (and so the schedule) is kept, not re-planned
    crash = make_trainer(tmp_path / "b", max_steps=100_000, time_budget=2.0, checkpoint_every=PLAN_AT + 3,
                         loss_fn=clock.ticking(CrashAfter(PLAN_AT + 5), seconds=0.005))
    with pytest.raises(KeyboardInterrupt):
        crash.fit()
    planned = load_checkpoint(latest_checkpoint(tmp_path / "b"))["max_steps"]
    assert crash.max_steps == planned < 100_000
    resumed = make_trainer(tmp_path / "b", max_steps=100_000, time_budget=2.0, checkpoint_every=PLAN_AT + 3,
                           loss_fn=clock.ticking(seconds=0.005))
    assert resumed.fit(resume=True)["steps"] == planned
    assert len([r for r in read_jsonl(tmp_path / "b" / "metrics.jsonl") if r["kind"] == "plan"]) == 1


def test_time_budget_replans_when_the_run_slows_down(tmp_path, make_trainer, monkeypatch):
    # planned on 1-ms steps, then every step costs 10 ms more (a machine that slows down): without re-planning the
    # planned steps take several times the budget and max_seconds cuts the run with the learning rate still high;
    # re-planned at each evaluation, the cosine ends in the budget
    from attnlab.training.trainer import PLAN_AT
    clock = FakeClock(monkeypatch)
    m = make_trainer(tmp_path, max_steps=100_000, time_budget=3.0, max_seconds=6.0, eval_every=20, log_every=1,
                     loss_fn=clock.ticking(seconds=0.001, after=PLAN_AT + 1, then=0.011)).fit()
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    (plan,) = [r for r in recs if r["kind"] == "plan"]
    replans = [r for r in recs if r["kind"] == "replan"]
    assert replans and replans[-1]["max_steps"] < plan["max_steps"]  # slower steps: fewer of them
    assert m["steps"] == replans[-1]["max_steps"] and m["wall_s"] < 6.0  # ended by the plan, not by max_seconds
    last_lr = [r["lr"] for r in recs if r["kind"] == "train"][-1]
    assert last_lr == pytest.approx(1e-3, rel=0.05)  # min_lr reached: the schedule decayed fully


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_trainer_steps_with_fused_adamw_equal_to_torchs_reference(tmp_path, tiny_gpt, dtype):
    """On a CPU the trainer's AdamW is the fused kernel (one kernel for every parameter: ~3x faster than foreach
    on the nanogpt-cpu model); its step equals torch's for-loop AdamW on the same gradients to float32 round-off."""
    torch.manual_seed(0)
    x = torch.randint(0, VOCAB, (4, BLOCK))
    batch = (x, torch.roll(x, -1, 1))
    cfg = TrainConfig(max_steps=1, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99), clip=0.0, progress=False, dtype=dtype)
    trainer = Trainer(tiny_gpt(dropout=0.0), cfg, train_batches=iter([batch]), loss_fn=causal_lm_loss,
                      out_dir=tmp_path)
    assert trainer.optimizer.defaults["fused"] is True and not trainer.optimizer.defaults["foreach"]
    ref_model = copy.deepcopy(trainer.model)
    grads = capture_grads(trainer)
    trainer.fit()
    ref = torch.optim.AdamW([{"params": [p for p in ref_model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in ref_model.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                            lr=cfg.schedule_fn().lr_at(0), betas=(0.9, 0.99), eps=1e-8, foreach=False)
    for p, g in zip(ref_model.parameters(), grads[0]):
        p.grad = g.clone()  # the trainer's gradients (its autocast forward and backward)
    ref.step()
    for p, q in zip(trainer.model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)  # fused vs for-loop kernels: float32 round-off
