"""attnlab's C++ training passes against the PyTorch operations they replace, and the training step with and without.

(a) Each pass, forward + backward, at the ``shakespeare-char`` default preset's shapes (16 × 256 tokens, width 256,
    4 heads of 64, FFN 704), float32 and bf16, ours and PyTorch's timed round-robin in one process:

    - RMSNorm: ``_native_train.rms_norm_train`` + backward (``nn.RMSNorm`` in training) against PyTorch's operations of the
      same formula under autograd (``x · rsqrt(mean(x²) + ε) · g``), float32 only (the residual stream it reads is
      float32 under bf16 autocast too);
    - RoPE: ``_native_train.rope_train`` on q as a strided view of a packed projection, and the rotation by −φ for the
      backward (``nn.RotaryEmbedding`` in training) against ``functional.positional.apply_rope`` under autograd;
    - SwiGLU's gate ``silu(g) ⊙ u``: ``_native_train.act_train`` + backward against ``F.silu(g) * u`` under autograd;
    - a plain GELU (nanoGPT's MLP): ``_native_train.act_with_grad`` (GELU and its derivative in one pass, the
      backward one product) against ``F.gelu`` at (12, 64, 512), nanogpt-cpu's shape;
    - gradient clipping: ``training.optim.clip_grad_norm_`` (one C++ call) against ``torch.nn.utils.clip_grad_norm_`` on
      nanogpt-cpu's parameters' shapes (0.8 M float32 gradients, every one clipped);
    - causal attention (the ``short`` backend): the fused kernel (``short.fused_short_attention``) against SDPA's CPU
      kernel (what ``auto`` takes without it), at the default preset's and nanogpt-cpu's (12 × 4 × 64 × 32) shapes.

(b) The default preset's training step (llama 4 × 256, AdamW, bf16 autocast where the CPU has native bf16, else
    float32), with every pass above against with none, each switched at the point the model calls it, timed in
    interleaved rounds in one process: ``ratio`` < 1 is the passes paying.

``ratio`` = ours / PyTorch's (lower is better). Medians. The machine line says which CPU and ISA gave the numbers.

Run: ``python benchmarks/train_passes.py [--quick] [--threads 2] [--out PATH]``.
"""
from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import compare, parser, print_table, setup, write_json  # noqa: E402

from attnlab import _native, _native_train, _runtime  # noqa: E402
from attnlab.backends import short  # noqa: E402
from attnlab.backends.dispatch import attention  # noqa: E402
from attnlab.functional.positional import apply_rope, rope_frequencies  # noqa: E402
from attnlab.nn import feedforward, norms, positional  # noqa: E402
from attnlab.training.optim import clip_grad_norm_  # noqa: E402

B, L, E, H, FFN = 16, 256, 256, 4, 704


def _nanogpt_cpu_params() -> list:
    """nanogpt-cpu's model's parameters, each with a random gradient (the same gradients on every call)."""
    from attnlab.training.recipes.shakespeare import PRESETS, ShakespeareSettings, make_model
    gen = torch.Generator().manual_seed(0)
    params = list(make_model(ShakespeareSettings(**PRESETS["nanogpt-cpu"]), vocab_size=65).parameters())
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    return params


def _backward(fn, inputs, grad):
    def call():
        for t in inputs:
            t.grad = None
        fn().backward(grad)
    return call


def pass_rows(dtype: torch.dtype, repeat: int, scale: int) -> list[dict]:
    b = max(1, B // scale)
    eps = 1e-6
    rows = []

    def row(name, shape, ours, theirs):
        t = compare({"ours": ours, "pytorch": theirs}, repeat=repeat)
        rows.append({"pass": name, "dtype": str(dtype).replace("torch.", ""), "shape": shape,
                     "ours_ms": t["ours"], "pytorch_ms": t["pytorch"], "ratio": t["ours"] / t["pytorch"]})

    if dtype == torch.float32:  # the residual stream a norm reads stays float32 under bf16 autocast too
        x = torch.randn(b, L, E, requires_grad=True)
        w = (torch.rand(E) + 0.5).requires_grad_()
        dy = torch.randn(b, L, E)
        norm = norms.RMSNorm(E)
        row("rmsnorm fwd+bwd", f"{b}x{L}x{E}", _backward(lambda: norm(x), (x, norm.weight), dy),
            _backward(lambda: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w, (x, w), dy))

    packed = torch.randn(b, L, 3 * E).to(dtype).requires_grad_()
    cos, sin = rope_frequencies(E // H, torch.arange(L))
    rope = positional.RotaryEmbedding(E // H)
    positions = torch.arange(L)
    q = lambda: packed[..., :E].view(b, L, H, E // H).transpose(1, 2)  # noqa: E731
    dq = torch.randn(b, H, L, E // H).to(dtype)
    row("rope fwd+bwd (q)", f"{b}x{H}x{L}x{E // H}", _backward(lambda: rope(q(), positions), (packed,), dq),
        _backward(lambda: apply_rope(q(), cos, sin), (packed,), dq))

    g, u = (torch.randn(b, L, FFN).to(dtype).requires_grad_() for _ in range(2))
    dh = torch.randn(b, L, FFN).to(dtype)
    row("swiglu gate fwd+bwd", f"{b}x{L}x{FFN}", _backward(lambda: feedforward._activate(g, u, "swiglu"),
                                                           (g, u), dh),
        _backward(lambda: F.silu(g) * u, (g, u), dh))

    a = torch.randn(12, 64, 512).to(dtype).requires_grad_()
    da = torch.randn(12, 64, 512).to(dtype)
    row("gelu fwd+bwd", "12x64x512", _backward(lambda: feedforward._activate(a, None, "gelu"), (a,), da),
        _backward(lambda: F.gelu(a), (a,), da))

    if dtype == torch.float32:  # the trainer's gradients are float32 (master weights) under autocast too
        mine, theirs = _nanogpt_cpu_params(), _nanogpt_cpu_params()
        row("clip grad norm (0.8 M grads)", f"{len(mine)} tensors",
            lambda: clip_grad_norm_(mine, 1e-3), lambda: torch.nn.utils.clip_grad_norm_(theirs, 1e-3))

    for (bb, hh, ll, dd) in ((b, H, L, E // H), (12, 4, 64, 32)):  # the default preset's, nanogpt-cpu's
        packed_qkv = torch.randn(bb, ll, 3 * hh * dd).to(dtype).requires_grad_()
        do = torch.randn(bb, hh, ll, dd).to(dtype)

        def heads():
            q, k, v = packed_qkv.split(hh * dd, dim=-1)
            return [t.view(bb, ll, hh, dd).transpose(1, 2) for t in (q, k, v)]
        causal = _backward(lambda: attention(*heads(), causal=True, backend="short"), (packed_qkv,), do)
        sdpa = _backward(lambda: attention(*heads(), causal=True, backend="sdpa"), (packed_qkv,), do)
        if short.fused_applies(*heads()):
            row("causal attention fwd+bwd: fused (ours) vs sdpa", f"{bb}x{hh}x{ll}x{dd}", causal, sdpa)
    return rows


@contextlib.contextmanager
def _fused_off():
    """The short backend's attention as PyTorch's products (its general path) instead of the fused kernel."""
    before = short.FUSED_KEYS
    short.FUSED_KEYS = 0
    try:
        yield
    finally:
        short.FUSED_KEYS = before


@contextlib.contextmanager
def _without_passes():
    """The model's call sites of the passes switched to PyTorch's operations (and back after)."""
    saved = norms._RMSNormFunction.native
    norms._RMSNormFunction.native = staticmethod(lambda x, w: False)  # the Function's PyTorch branch
    positional._Rotate.apply = staticmethod(lambda x, c, s: apply_rope(x, c, s))
    saved_activate = feedforward._activate
    feedforward._activate = (
        lambda g, u, a: feedforward.GATED_ACTIVATIONS[a](g) * u if u is not None else feedforward.ACTIVATIONS[a](g))
    try:
        with _fused_off():
            yield
    finally:
        norms._RMSNormFunction.native = staticmethod(saved)
        del positional._Rotate.apply  # autograd.Function's own again
        feedforward._activate = saved_activate


def step_rows(steps: int, rounds: int, scale: int) -> list[dict]:
    from attnlab._runtime import resolve_dtype
    from attnlab.training.optim import build_optimizer
    from attnlab.training.recipes.shakespeare import ShakespeareSettings, make_model

    settings = ShakespeareSettings(batch_size=max(1, B // scale))
    dtype_name, _ = resolve_dtype("auto")
    dtype = torch.bfloat16 if dtype_name == "bf16" else None
    model = make_model(settings, vocab_size=65, dropout=0.0)
    opt = build_optimizer(model, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    data = torch.randint(0, 65, (8, settings.batch_size, settings.block_size + 1))

    def step(i):
        x, y = data[i % 8, :, :-1], data[i % 8, :, 1:]
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(model(x).logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = {"ours": [], "pytorch": []}
    for _ in range(rounds):
        for name in times:
            with (contextlib.nullcontext() if name == "ours" else _without_passes()):
                step(0)
                for i in range(steps):
                    t = time.perf_counter()
                    step(i)
                    times[name].append((time.perf_counter() - t) * 1e3)
    ours, theirs = statistics.median(times["ours"]), statistics.median(times["pytorch"])
    return [{"pass": "default preset's training step (every pass)", "dtype": dtype_name,
             "shape": f"{settings.batch_size}x{settings.block_size} tokens", "ours_ms": ours, "pytorch_ms": theirs,
             "ratio": ours / theirs}]


def main(argv=None) -> None:
    args = parser(__doc__.splitlines()[0], "train_passes.json").parse_args(argv)
    setup(args)
    _runtime.reuse_freed_memory()  # as the trainer does
    if not _native.available():
        raise SystemExit(f"attnlab's native kernels are unavailable here: {_native.status()}")
    scale, repeat = (8, 3) if args.quick else (1, 15)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        rows += pass_rows(dtype, repeat, scale)
    rows += step_rows(steps=2 if args.quick else 10, rounds=1 if args.quick else 3, scale=scale)
    print_table(rows, ["pass", "dtype", "shape", "ours_ms", "pytorch_ms", "ratio"])
    write_json(args.out, rows, quick=args.quick)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
