"""Model FLOPs utilisation (MFU) of a ``shakespeare-char`` training run: ours and nanoGPT's, one formula.

Matrix-product FLOPs of a run, counted from the model's shape (``L`` layers, width ``d``, MLP width ``f``,
context ``T``, vocabulary ``V``) and the training tokens (``steps × batch × T``)::

    N_mm  = L · (4·d² + m·d·f) + d·V          weights that multiply activations: Q, K, V, O; the MLP's
                                              m matrices (m = 2 for GELU, 3 for SwiGLU); the (tied) head.
                                              Embedding look-ups, norms and biases are not products.
    FLOPs = tokens · (6·N_mm + 12·L·T·d)      6 = 2 (multiply-add) × 3 (forward, and backward's two products
                                              per weight); 12·L·T·d = QKᵀ and A·V over the full T×T
                                              (no causal halving), forward and backward (PaLM, appendix B).

Only training tokens are counted: evaluation passes are not (their time stays in the wall). The same formula
is applied to nanoGPT's model (``gpt2``: GELU MLP, ``f = 4d``) and ours (``f`` and ``m`` from the run's
settings), so the two MFUs compare the same work measure.

``MFU = FLOPs / wall_s / peak``: ``wall_s`` is the whole process (start-up, data, evaluations, files
included), ``peak`` the matrix-product rate this machine measured in the same benchmark run for the dtype
the run computed in (:func:`attnlab._runtime.probe` with ``measure=True``: the best of a short run of
512 × 512 products, at the benchmark's thread count); a run with ``int8_training`` is measured against the int8
products' peak (:func:`int8_gflops`), though its attention and head products stay in its float dtype.
"""
from __future__ import annotations

import functools

__all__ = ["matmul_params", "train_flops", "run_flops", "settings_flops", "nanogpt_flops", "peak_gflops",
           "int8_gflops", "mfu", "shown"]


def matmul_params(*, n_layer: int, n_embd: int, ffn_dim: int, vocab_size: int, gated: bool) -> int:
    """``N_mm = L · (4·d² + m·d·f) + d·V`` with ``m = 3`` if ``gated`` (SwiGLU) else 2."""
    return n_layer * (4 * n_embd ** 2 + (3 if gated else 2) * n_embd * ffn_dim) + n_embd * vocab_size


def train_flops(*, tokens: int, n_layer: int, n_embd: int, block_size: int, n_mm: int) -> float:
    """``FLOPs = tokens · (6·N_mm + 12·L·T·d)``: the matrix products of ``tokens`` training tokens."""
    return float(tokens) * (6 * n_mm + 12 * n_layer * block_size * n_embd)


def run_flops(*, tokens: int, n_layer: int, n_embd: int, ffn_dim: int, block_size: int, vocab_size: int,
              gated: bool) -> float:
    """:func:`train_flops` of a model of this shape (:func:`matmul_params`) over ``tokens`` training tokens."""
    n_mm = matmul_params(n_layer=n_layer, n_embd=n_embd, ffn_dim=ffn_dim, vocab_size=vocab_size, gated=gated)
    return train_flops(tokens=tokens, n_layer=n_layer, n_embd=n_embd, block_size=block_size, n_mm=n_mm)


def settings_flops(settings, *, vocab_size: int, tokens: int) -> float:
    """:func:`run_flops` of a ``shakespeare-char`` run with ``settings`` (``arch`` llama: SwiGLU, m = 3)."""
    from attnlab.training.recipes.shakespeare import ffn_width

    return run_flops(tokens=tokens, n_layer=settings.n_layer, n_embd=settings.n_embd, ffn_dim=ffn_width(settings),
                     block_size=settings.block_size, vocab_size=vocab_size, gated=settings.arch == "llama")


def nanogpt_flops(model_args: dict, *, steps: int, batch_size: int) -> float:
    """:func:`run_flops` of nanoGPT's ``GPT`` with these ``model_args`` (its checkpoint's: GELU MLP, f = 4d) over
    ``steps × batch_size × block_size`` tokens."""
    d = model_args["n_embd"]
    return run_flops(tokens=steps * batch_size * model_args["block_size"], n_layer=model_args["n_layer"], n_embd=d,
                     ffn_dim=4 * d, block_size=model_args["block_size"], vocab_size=model_args["vocab_size"],
                     gated=False)


def peak_gflops(dtype: str) -> float:
    """This machine's measured matrix-product GFLOP/s for ``dtype``: ``fp32`` or ``bf16`` from the probe, ``int8``
    (a run with ``int8_training``: its linear layers' products) from :func:`int8_gflops`."""
    from attnlab._runtime import probe

    if dtype == "int8":
        return int8_gflops()
    cap = probe(measure=True)  # cached per process: the figure the benchmark's header printed
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype must be fp32, bf16 or int8 for a CPU peak, got {dtype!r}")
    return cap.fp32_gflops if dtype == "fp32" else cap.bf16_gflops


@functools.lru_cache(maxsize=1)
def int8_gflops(n: int = 512, seconds: float = 0.1) -> float:
    """GFLOP/s (2n³ integer multiply-adds counted as flops) of the int8 product :mod:`attnlab.adapt.int8_training`
    calls (``_native_train.int8_product``: with AVX2 and no VNNI attnlab's kernel, else ``torch._int_mm``; plain
    ``torch._int_mm`` where the native kernels are not built) on ``n × n`` int8 operands, the right one within ±63,
    the best of ``seconds`` of them."""
    import torch

    from attnlab import _native
    from attnlab._runtime import product_gflops

    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (n, n), generator=gen, dtype=torch.int8)
    b = torch.randint(-63, 64, (n, n), generator=gen, dtype=torch.int8)
    product = torch._int_mm
    if _native.available():
        from attnlab import _native_train

        rs = torch.ones(n)
        product = lambda a, b: _native_train.int8_product(a, b, rs, max_inner=1 << 30)  # noqa: E731
    return product_gflops(product, a, b, seconds=seconds)


def mfu(flops: float, wall_s: float, dtype: str) -> float:
    """``flops / wall_s / peak(dtype)``: the fraction of the measured peak the whole run sustained."""
    if not wall_s > 0:
        raise ValueError(f"wall_s must be > 0, got {wall_s!r}")
    return flops / wall_s / (peak_gflops(dtype) * 1e9)


def shown(rows: list[dict]) -> list[dict]:
    """``rows`` for a printed table: ``mfu`` (a fraction in the JSON) as a percentage with two decimals."""
    return [{**r, "mfu": f"{100 * r['mfu']:.2f}%"} if isinstance(r.get("mfu"), float) else r for r in rows]
