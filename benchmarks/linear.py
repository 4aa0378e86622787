"""Linear attention against exact attention (CPU, float32, B=1, H=8, D=64).

(a) Causal linear attention (``attnlab.functional.linear.linear_attention``, ``feature_map="elu"``,
    chunked prefix sums, chunk 64), forward + backward, N = 128 .. 16384, and how its time grows:
    ``t(16384) / t(2048)`` should be about 8 (linear in N), at most 10; these times are taken
    round-robin across the N, so load from other processes hits every length alike. Also the
    peak memory rise of one forward + backward (fresh process) of (a) and (b). With glibc's
    defaults a block of 32 MiB or more is mmap'd afresh, and page-faulted, on every call (at
    N=16384 each (1, 8, N, 64) float32 intermediate is 32 MiB); attnlab keeps such blocks for reuse
    itself (``attnlab._runtime.reuse_large_blocks``), so no environment variable is needed.
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


def bench_growth(sizes: list[int], repeat: int) -> dict[int, float]:
    """Median ms of the linear forward + backward at every N, timed round-robin across the N (one
    call per N per round), so load from other processes hits every length alike."""
    steps = {n: fwd_bwd(linear_causal, *inputs(n, grad=True)) for n in sizes}
    return compare(steps, repeat=repeat, warmup=1)


def bench_pairs(sizes: list[int], budget_s: float) -> list[dict]:
    """Linear against exact at each N, round-robin (``compare``), as many runs as fit in
    ``budget_s`` of exact attention (at least 2; the probe run that counts them is the warm-up)."""
    rows = []
    for n in sizes:
        q, k, v = inputs(n, grad=True)
        for case, wrap in (("fwd+bwd", fwd_bwd), ("fwd", fwd)):
            fns = {"linear": wrap(linear_causal, q, k, v), "exact": wrap(exact_causal, q, k, v)}
            fns["linear"]()
            repeat = auto_repeat(fns["exact"], budget_s=budget_s, lo=2)
            t = compare(fns, repeat=repeat, warmup=0)
            rows.append({"case": case, "N": n, "linear_ms": t["linear"], "exact_ms": t["exact"],
                         "linear/exact": t["linear"] / t["exact"], "repeat": repeat})
        print(f"  N={n}: timed", file=sys.stderr, flush=True)
    return rows


def bench_memory(sizes: list[int], threads: int) -> dict[int, dict[str, float]]:
    """Peak RSS rise (MiB) of one forward + backward, each in a fresh process. Run before any
    timing: a child started by a process that already peaked high inherits that peak in
    ``ru_maxrss`` (Linux keeps it across exec) and would read a rise of 0."""
    setup_code = ("import torch.nn.functional as F\nfrom attnlab.functional.linear import linear_attention\n"
                  "q, k, v = (torch.randn({B}, {H}, {n}, {D}, requires_grad=True) for _ in range(3))")
    stmts = {"linear_mem_mib": "linear_attention(q, k, v, feature_map='elu', causal=True).sum().backward()",
             "exact_mem_mib": "F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()"}
    return {n: {col: peak_rss_rise_mib(setup_code.format(B=B, H=H, n=n, D=D), stmt, threads=threads)
                for col, stmt in stmts.items()} for n in sizes}


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
    sizes = [128, 256, 512, 1024, 2048, 4096] if args.quick else [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    features = [16, 64, 256] if args.quick else [16, 32, 64, 128, 256, 512, 1024]
    budget_s = 0.5 if args.quick else 3.0  # per case and N: exact's share of the interleaved runs

    memory = bench_memory(sizes, args.threads)
    growth = bench_growth(sizes, repeat=5 if args.quick else 15)
    pairs = bench_pairs(sizes, budget_s)
    train = [r | memory[r["N"]] | {"linear_alone_ms": growth[r["N"]]} for r in pairs if r["case"] == "fwd+bwd"]
    infer = [r for r in pairs if r["case"] == "fwd"]
    print(f"causal linear attention (elu, chunk 64) vs exact causal SDPA: fp32, B={B}, H={H}, D={D}, "
          f"{args.threads} threads; medians of `repeat` runs interleaved with the peer; linear_alone_ms: "
          f"medians of {5 if args.quick else 15} runs interleaved across N; memory: peak RSS rise of one call")
    print_table(train + infer, ["case", "N", "linear_ms", "exact_ms", "linear/exact", "repeat", "linear_alone_ms",
                                "linear_mem_mib", "exact_mem_mib"])
    top = max(sizes)
    ratio = growth[top] / growth[2048]
    print(f"linear fwd+bwd time ratio N={top} / N=2048 (linear_alone_ms): {ratio:.2f} (linear in N: "
          f"{top // 2048}; target <= {top / 2048 * 1.25:.0f}: {'yes' if ratio <= top / 2048 * 1.25 else 'no'})")
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

    write_json(args.out, train + infer + favor, growth_ratio={f"{top}/2048": ratio},
               crossover_fwd_bwd=n_train, crossover_fwd=n_infer, favor_error_falling=falling)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
