"""Linear attention against exact attention (CPU, float32, B=1, H=8, D=64).

(a) Causal linear attention (``attnlab.functional.linear.linear_attention``, ``feature_map="elu"``,
    chunked prefix sums, chunk 64), forward + backward, N = 256 .. 16384, and how its time grows:
    ``t(16384) / t(2048)`` should be about 8 (linear in N), at most 10. Also its peak memory rise
    (fresh process, forward + backward), which should grow linearly too.
(b) Exact causal attention, ``F.scaled_dot_product_attention(is_causal=True)`` (the flash kernel on
    CPU), at the same N, timed round-robin with (a); the crossover length where linear attention
    becomes cheaper, for forward + backward and for forward only (``no_grad``).
(c) FAVOR+ (``feature_map="favor+"``): mean abs error against exact softmax attention
    (``attnlab.attention``, non-causal, N=1024) as the number of random features grows, for
    moderate-norm inputs (q, k ~ N(0, 0.5²): ‖q‖ ≈ 4) and, to show how the error depends on the
    norms, unit-variance ones (‖q‖ ≈ 8); averaged over 3 draws.

Run: ``python benchmarks/linear.py [--quick] [--threads 2] [--out PATH]``.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import auto_repeat, compare, parser, peak_rss_rise_mib, print_table, setup, write_json  # noqa: E402

import attnlab  # noqa: E402
from attnlab.functional.linear import favor_projection, linear_attention  # noqa: E402

B, H, D = 1, 8, 64


def inputs(n: int, grad: bool):
    return tuple(torch.randn(B, H, n, D, requires_grad=grad) for _ in range(3))


def fwd_bwd(fn, q, k, v):
    def step():
        q.grad = k.grad = v.grad = None
        fn(q, k, v).sum().backward()
    return step


def fwd(fn, q, k, v):
    def call():
        with torch.no_grad():
            fn(q, k, v)
    return call


def linear_causal(q, k, v):
    return linear_attention(q, k, v, feature_map="elu", causal=True)


def exact_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def bench_speed(sizes: list[int], budget_s: float, threads: int) -> list[dict]:
    rows = []
    for n in sizes:
        q, k, v = inputs(n, grad=True)
        for case, wrap in (("fwd+bwd", fwd_bwd), ("fwd", fwd)):
            fns = {"linear": wrap(linear_causal, q, k, v), "exact": wrap(exact_causal, q, k, v)}
            repeat = auto_repeat(fns["exact"], budget_s=budget_s, lo=3)
            t = compare(fns, repeat=repeat, warmup=1)
            rows.append({"case": case, "N": n, "linear_ms": t["linear"], "exact_ms": t["exact"],
                         "linear/exact": t["linear"] / t["exact"], "repeat": repeat})
        setup_code = (f"from attnlab.functional.linear import linear_attention\n"
                      f"q, k, v = (torch.randn({B}, {H}, {n}, {D}, requires_grad=True) for _ in range(3))")
        stmt = "linear_attention(q, k, v, feature_map='elu', causal=True).sum().backward()"
        rows[-2]["linear_mem_mib"] = peak_rss_rise_mib(setup_code, stmt, threads=threads)
        print(f"  N={n}: done", file=sys.stderr, flush=True)
    return rows


def crossover(rows: list[dict]) -> tuple[str, float | None]:
    """The length where linear attention becomes (and stays) cheaper than exact, interpolated
    log-log between the two grid points around the last sign change of ``log(linear/exact)``."""
    rows = sorted(rows, key=lambda r: r["N"])
    if rows[-1]["linear/exact"] >= 1:
        return f"> {rows[-1]['N']} (linear never cheaper on this grid)", None
    i = max((j for j, r in enumerate(rows) if r["linear/exact"] >= 1), default=None)
    if i is None:
        return f"< {rows[0]['N']} (linear cheaper at every N on this grid)", None
    (n0, r0), (n1, r1) = ((rows[j]["N"], math.log(rows[j]["linear/exact"])) for j in (i, i + 1))
    n = math.exp(math.log(n0) + (math.log(n1) - math.log(n0)) * r0 / (r0 - r1))
    return f"≈ {n:.0f} (between N={n0} and N={n1})", n


def bench_favor(features: list[int], n: int = 1024, draws: int = 3) -> list[dict]:
    rows = []
    for m in features:
        row = {"case": "favor+ error", "num_features": m}
        for std in (0.5, 1.0):
            errs = []
            for seed in range(draws):
                g = torch.Generator().manual_seed(seed)
                q, k, v = (torch.randn(B, H, n, D, generator=g) for _ in range(3))
                q, k = std * q, std * k
                w = favor_projection(m, D, generator=g)
                with torch.no_grad():
                    approx = linear_attention(q, k, v, feature_map="favor+", projection=w)
                    errs.append((approx - attnlab.attention(q, k, v)).abs().mean().item())
            row[f"mae_std{std}"] = sum(errs) / draws
        rows.append(row)
    return rows


def main(argv=None) -> None:
    args = parser(__doc__.splitlines()[0], "linear.json").parse_args(argv)
    setup(args)
    sizes = [256, 512, 1024, 2048, 4096] if args.quick else [256, 512, 1024, 2048, 4096, 8192, 16384]
    features = [16, 64, 256] if args.quick else [16, 32, 64, 128, 256, 512, 1024]
    budget_s = 0.5 if args.quick else 3.0  # per case and N; sets the number of interleaved runs

    speed = bench_speed(sizes, budget_s, args.threads)
    train = [r for r in speed if r["case"] == "fwd+bwd"]
    infer = [r for r in speed if r["case"] == "fwd"]
    print(f"causal linear attention (elu, chunk 64) vs exact causal SDPA: fp32, B={B}, H={H}, D={D}, "
          f"{args.threads} threads, medians of `repeat` interleaved runs")
    print_table(train + infer, ["case", "N", "linear_ms", "exact_ms", "linear/exact", "linear_mem_mib", "repeat"])
    t = {r["N"]: r["linear_ms"] for r in train}
    top = max(t)
    growth = t[top] / t[2048]
    print(f"linear fwd+bwd time ratio N={top} / N=2048: {growth:.2f} (linear in N: {top / 2048:.0f}; "
          f"target <= {top / 2048 * 1.25:.0f}: {'yes' if growth <= top / 2048 * 1.25 else 'no'})")
    cross_train, n_train = crossover(train)
    cross_infer, n_infer = crossover(infer)
    print(f"crossover (linear cheaper than exact), fwd+bwd: {cross_train}")
    print(f"crossover (linear cheaper than exact), fwd only: {cross_infer}\n")

    favor = bench_favor(features)
    print("FAVOR+ mean abs error vs exact softmax attention: non-causal, N=1024, fp32, mean of 3 draws; "
          "q, k ~ N(0, std²)")
    print_table(favor, ["num_features", "mae_std0.5", "mae_std1.0"])
    falling = all(a["mae_std0.5"] > b["mae_std0.5"] for a, b in zip(favor, favor[1:]))
    print(f"error falls with every doubling (std 0.5): {'yes' if falling else 'no'}")

    write_json(args.out, speed + favor, growth_ratio={f"{top}/2048": growth},
               crossover_fwd_bwd=n_train, crossover_fwd=n_infer, favor_error_falling=falling)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
