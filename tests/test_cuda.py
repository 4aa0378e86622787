"""On a CUDA device: every backend, a model, generation and a training run equal their CPU/float64 oracles.

CI has no GPU, so these tests skip there, saying so; they run wherever ``torch.cuda.is_available()``.
Oracles: the float64 ``reference`` backend on the CPU (attention), the same model on the CPU (logits, greedy
tokens), the trainer's own invariants (finite falling loss, a checkpoint that resumes to the same weights).
Tolerances: fp32 on the GPU against float64 — 1e-4 (no TF32: PyTorch leaves it off for fp32 products by default;
the test asserts that); bf16 — :func:`tests._tolerance.tolerance` of the bf16 ε over the head dimension.
"""
import pytest
import torch

from attnlab import attention
from attnlab.backends import BACKENDS, BackendUnavailable
from attnlab.functional.masks import sliding_window_mod
from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel
from attnlab.generation import generate
from tests._tolerance import tolerance

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
CUDA = torch.device("cuda")

CASES = {
    "dense": dict(),
    "causal": dict(causal=True),
    "window": dict(causal=True, window=24),
    "alibi": dict(causal=True, score_mod=lambda s, b, h, q, kv: s - (0.125 * (h + 1) * (q - kv).abs()).to(s.dtype)),
    "mask_mod": dict(mask_mod=sliding_window_mod(8, causal=False)),
}


def _qkv(dtype, *, device, B=2, H=4, Hkv=2, L=80, D=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(B, h, L, D, generator=g, dtype=torch.float64)  # noqa: E731
    return [t.to(device=device, dtype=dtype).requires_grad_() for t in (make(H), make(Hkv), make(Hkv))]


def test_fp32_products_are_not_tf32():
    assert not torch.backends.cuda.matmul.allow_tf32


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backend_on_cuda_equals_the_float64_reference(backend, case, dtype):
    request = CASES[case]
    q, k, v = _qkv(dtype, device=CUDA)
    why = BACKENDS[backend].unsupported(q, k, v, **{"mask": None, "causal": False, "window": None, "scale": None,
                                                       "score_mod": None, "mask_mod": None, "dropout_p": 0.0,
                                                       "normalize": "softmax", "top_k": None,
                                                       "return_weights": False, **request})
    if why:
        pytest.skip(f"{backend} declines {case}: {why}")
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    ref = attention(q64, k64, v64, backend="reference", **request)
    grad = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (q64, k64, v64), grad)
    try:
        out = attention(q, k, v, backend=backend, **request)
    except BackendUnavailable as e:
        pytest.skip(f"{backend} unavailable here: {e}")
    assert out.device.type == CUDA.type and out.dtype == dtype
    got = torch.autograd.grad(out, (q, k, v), grad.to(CUDA, dtype))
    if dtype == torch.float32:
        tol = dict(rtol=1e-4, atol=1e-4)
    else:
        atol = tolerance(ref, dtype=torch.bfloat16, n=q.shape[-1], depth=2)
        tol = dict(rtol=2 ** -7, atol=atol)
    torch.testing.assert_close(out.double().cpu(), ref.detach(), **tol)
    for a, b in zip(got, want):
        b_tol = dict(tol, atol=tol["atol"] * max(1.0, float(b.abs().max())))
        torch.testing.assert_close(a.double().cpu(), b, **b_tol)


def _tiny_gpt(seed=0):
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                       bos_token_id=None, eos_token_id=None)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)  # wide weights: greedy continuations vary, ties are unlikely
    return model


def test_model_logits_and_greedy_tokens_on_cuda_equal_the_cpu():
    cpu = _tiny_gpt()
    gpu = _tiny_gpt().to(CUDA)
    ids = torch.randint(0, 97, (3, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = cpu(ids).logits, gpu(ids.to(CUDA)).logits
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    tokens_cpu = generate(cpu, ids, max_new_tokens=20, do_sample=False)
    tokens_gpu = generate(gpu, ids.to(CUDA), max_new_tokens=20, do_sample=False)
    assert tokens_gpu.device.type == CUDA.type
    assert torch.equal(tokens_gpu.cpu(), tokens_cpu)


class _CrashAfter:
    """A loss function that raises KeyboardInterrupt at its ``n``-th call (a crash mid-run)."""

    def __init__(self, n):
        self.n, self.calls = n, 0

    def __call__(self, *args, **kwargs):
        from attnlab.training.losses import causal_lm_loss
        self.calls += 1
        if self.calls == self.n:
            raise KeyboardInterrupt
        return causal_lm_loss(*args, **kwargs)


def test_training_on_cuda_learns_and_resumes(tmp_path):
    """bf16 autocast on the GPU: the loss falls; 40 steps straight and 20 + crash + resume end at the same
    validation loss (within 0.02: CUDA's embedding backward adds with atomics, so runs are not bitwise equal)."""
    import functools

    from attnlab.data.batching import LMBatches, lm_eval_batches
    from attnlab.training.checkpoint import latest_checkpoint
    from attnlab.training.losses import causal_lm_loss
    from attnlab.training.recipes.shakespeare import evaluate_lm
    from attnlab.training.trainer import TrainConfig, Trainer

    g = torch.Generator().manual_seed(1)
    data = torch.where(torch.rand(4000, generator=g) < 0.8, torch.arange(4000) % 7,
                       torch.randint(0, 97, (4000,), generator=g))
    val = lm_eval_batches(data, block_size=32, batch_size=8, num_batches=2, seed=5)

    def trainer(out, loss_fn=causal_lm_loss):
        cfg = TrainConfig(max_steps=40, lr=1e-2, min_lr=1e-3, warmup_steps=2, log_every=1, progress=False,
                          seed=0, device=str(CUDA), dtype="bf16", eval_every=20, checkpoint_every=10)
        return Trainer(_tiny_gpt().train(), cfg, train_batches=LMBatches(data, block_size=32, batch_size=8, seed=3),
                       loss_fn=loss_fn, evaluate=functools.partial(evaluate_lm, batches=val), out_dir=out)

    before = evaluate_lm(_tiny_gpt().to(CUDA), batches=val)["val_loss"]
    straight = trainer(tmp_path / "a")
    done = straight.fit()
    assert next(straight.model.parameters()).device.type == CUDA.type
    assert done["val_loss"] < before - 0.5, (before, done["val_loss"])
    with pytest.raises(KeyboardInterrupt):
        trainer(tmp_path / "b", loss_fn=_CrashAfter(25)).fit()
    assert latest_checkpoint(tmp_path / "b").name == "ckpt-00000020.pt"
    resumed = trainer(tmp_path / "b").fit(resume=True)
    assert resumed["steps"] == 40
    assert abs(resumed["val_loss"] - done["val_loss"]) < 0.02, (resumed["val_loss"], done["val_loss"])


@pytest.mark.parametrize("request_", [dict(causal=True, window=64),
                                      dict(causal=True, score_mod=CASES["alibi"]["score_mod"])],
                         ids=["window", "alibi"])
def test_auto_takes_flex_for_sparse_training_shapes_and_not_for_decode_steps(request_, monkeypatch):
    from attnlab.backends import flex, select_backend
    monkeypatch.setattr(flex, "_compile", True)  # tests/conftest.py runs flex eagerly; auto takes it compiled only
    torch._dynamo.reset()  # earlier tests may have compiled flex for many shapes: past the recompile limit auto skips it
    monkeypatch.setattr(flex, "_compiled_signatures", set())
    base = {"mask": None, "causal": False, "window": None, "scale": None, "score_mod": None, "mask_mod": None,
            "dropout_p": 0.0, "normalize": "softmax", "top_k": None, "return_weights": False}
    q, k, v = _qkv(torch.bfloat16, device=CUDA, L=256)
    assert select_backend(q, k, v, **{**base, **request_}).name == "flex"
    assert select_backend(q[:, :, -1:], k, v, **{**base, **request_}).name != "flex"  # one query: a decode step
    out = attention(q, k, v, **request_)
    ref = attention(*(t.detach().double().cpu() for t in (q, k, v)), backend="reference", **request_)
    atol = tolerance(ref, dtype=torch.bfloat16, n=q.shape[-1], depth=2)
    torch.testing.assert_close(out.double().cpu(), ref, rtol=2 ** -7, atol=atol)


def test_muon_step_on_cuda_equals_the_cpu_step():
    """One Muon step (Newton–Schulz in fp32, no TF32) on the GPU equals the CPU's within fp32 round-off (16 ε √n ·
    5 steps of the update's largest entry); in bf16 within bf16's (relative Frobenius difference of the updates
    < 5 %, as against torch's own Muon)."""
    from attnlab.training.optim import Muon
    g = torch.Generator().manual_seed(0)
    shapes = [(64, 160), (160, 64), (64, 64)]
    start = [torch.randn(*s, generator=g) for s in shapes]
    grads = [torch.randn(*s, generator=g) for s in shapes]
    results = {}
    for device, dtype in (("cpu", torch.float32), ("cuda", torch.float32), ("cuda", torch.bfloat16)):
        ps = [torch.nn.Parameter(w.to(device, copy=True)) for w in start]
        opt = Muon(ps, lr=0.02, weight_decay=0.1, ns_dtype=dtype)
        for p, grad in zip(ps, grads):
            p.grad = grad.to(device)
        opt.step()
        results[device, dtype] = [(p.detach().cpu() - w) for p, w in zip(ps, start)]
    for ref, gpu, half in zip(*results.values()):
        # fp32 round-off of products over n ≤ 160 terms, through 5 Newton–Schulz steps, of the update's magnitude
        tol = tolerance(torch.ones(()), n=160, depth=5) * ref.abs().max().item()
        torch.testing.assert_close(gpu, ref, rtol=0, atol=tol)
        assert (half - ref).norm() / ref.norm() < 0.05


@torch.no_grad()
def test_int4_model_on_cuda_equals_the_dequantised_model():
    """An int4-quantised GPT-2 moved to the GPU (dequantised products there: the int4 kernel is CPU code) gives the
    logits of the float model holding the dequantised weights on the CPU within float32's reordering (1e-5 ·
    max|logit|, as tests/adapt/test_quantize.py's), and its greedy tokens."""
    import copy

    from attnlab.adapt import quantize
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=97, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=None,
                     eos_token_id=None)
    model = GPT2LMHeadModel(cfg).eval()
    q = quantize(copy.deepcopy(model), "int4", group_size=32)
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            m.weight.copy_(q.get_submodule(name).weight)
    ids = torch.randint(0, 97, (2, 12))
    want = model(ids).logits
    got = q.to(CUDA)(ids.to(CUDA)).logits.cpu()
    assert (got - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item())
    tokens = generate(q, ids[:1].to(CUDA), max_new_tokens=8, do_sample=False).cpu()
    assert torch.equal(tokens, generate(model, ids[:1], max_new_tokens=8, do_sample=False))
