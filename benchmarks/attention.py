"""attnlab attention against PyTorch's own, side by side (CPU, float32).

Suite ``basic`` (writes ``results/runs/attention.json``):

1. The pipeline, ``attnlab.attention(q, k, v)`` with ``backend="auto"``, against
   ``F.scaled_dot_product_attention``: B=1, H=8, D=64, N in 512..4096, forward only, no grad;
   dense and causal (``causal=True`` against ``is_causal=True``).
2. The module, ``attnlab.modules.multihead.MultiheadAttention`` (weights copied with
   ``from_torch``) against ``torch.nn.MultiheadAttention(E, H, batch_first=True)``, B=8, L=256,
   E=512, H=8, ``need_weights=False``: (a) eval + no_grad self-attention, where torch may take its
   fused fast path; (b) training forward + backward.

Suite ``efficient`` (writes ``results/runs/attention_efficient.json``): the ``tiled`` backend's targets, in
``_attention_efficient.py`` (its docstring has the table of rows and targets).

Each pair is timed round-robin (see ``_common.compare``) after checking that both compute the same
output (and, for fwd+bwd, the same input gradients). Run:
``python benchmarks/attention.py [--suite basic|efficient|all] [--quick] [--threads 2] [--out PATH]
[--out-efficient PATH] [--only SECTION ...]``; ``--only`` runs some sections of the efficient suite (e.g. ``--only
window causal`` to fit a time limit).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, auto_repeat, compare, parser, print_table, result, setup, write_json  # noqa: E402
from _attention_efficient import SECTIONS, run_efficient  # noqa: E402

import attnlab  # noqa: E402
from attnlab.modules.multihead import MultiheadAttention  # noqa: E402

COLUMNS = ["case", "N", "ours_ms", "peer_ms", "ratio", "repeat"]


def row(case: str, n: int, times: dict[str, float]) -> dict:
    return {"case": case, "N": n, "ours_ms": times["ours"], "peer_ms": times["peer"],
            "ratio": times["ours"] / times["peer"]}


def check(ours, peer, what: str) -> None:
    torch.testing.assert_close(ours, peer, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")


def bench_functional(sizes: list[int], budget_s: float) -> list[dict]:
    rows = []
    B, H, D = 1, 8, 64
    for n in sizes:
        q, k, v = (torch.randn(B, H, n, D) for _ in range(3))
        with torch.no_grad():
            for case, ours, peer in [
                ("dense", lambda: attnlab.attention(q, k, v),
                 lambda: F.scaled_dot_product_attention(q, k, v)),
                ("causal", lambda: attnlab.attention(q, k, v, causal=True),
                 lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
            ]:
                check(ours(), peer(), f"{case} N={n}")
                repeat = auto_repeat(peer, budget_s=budget_s)
                rows.append(row(case, n, compare({"ours": ours, "peer": peer}, repeat=repeat)) | {"repeat": repeat})
    return rows


def torch_fast_path_taken(module: torch.nn.MultiheadAttention, x: torch.Tensor) -> bool:
    """Whether torch's MHA dispatched to its fused ``_native_multi_head_attention`` kernel."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        module(x, x, x, need_weights=False)
    return any("_native_multi_head_attention" in e.key for e in prof.key_averages())


def bench_module(budget_s: float) -> tuple[list[dict], bool]:
    B, L, E, H = 8, 256, 512, 8
    peer = torch.nn.MultiheadAttention(E, H, batch_first=True)
    ours = MultiheadAttention.from_torch(peer)
    x = torch.randn(B, L, E)
    rows = []

    # (a) inference: eval + no_grad, self-attention (query is key is value)
    peer.eval()
    ours.eval()
    with torch.no_grad():
        check(ours(x, x, x, need_weights=False)[0], peer(x, x, x, need_weights=False)[0], "MHA eval")
        fast = torch_fast_path_taken(peer, x)
        fns = {"ours": lambda: ours(x, x, x, need_weights=False), "peer": lambda: peer(x, x, x, need_weights=False)}
        repeat = auto_repeat(fns["peer"], budget_s=budget_s)
        rows.append(row("mha eval no_grad", L, compare(fns, repeat=repeat)) | {"repeat": repeat})

    # (b) training: forward + backward (dropout 0, so both compute the same function)
    peer.train()
    ours.train()
    xg = x.clone().requires_grad_(True)

    def step(module):
        def fn():
            module.zero_grad(set_to_none=True)
            xg.grad = None
            module(xg, xg, xg, need_weights=False)[0].sum().backward()
            return xg.grad
        return fn

    check(step(ours)(), step(peer)(), "MHA train input grad")
    repeat = auto_repeat(step(peer), budget_s=budget_s)
    rows.append(row("mha train fwd+bwd", L, compare({"ours": step(ours), "peer": step(peer)}, repeat=repeat))
                | {"repeat": repeat})
    return rows, fast


def run_basic(args) -> None:
    sizes = [512, 1024] if args.quick else [512, 1024, 2048, 4096]
    budget_s = 0.3 if args.quick else 2.0  # per peer and case; sets the number of interleaved runs

    functional = bench_functional(sizes, budget_s)
    print(f"attnlab.attention (auto) vs F.scaled_dot_product_attention: fp32, B=1, H=8, D=64, "
          f"no grad, {args.threads} threads, medians of `repeat` interleaved runs")
    print_table(functional, COLUMNS)
    worst = max(functional, key=lambda r: r["ratio"])
    overhead = worst["ratio"] - 1
    verdict = "yes" if overhead <= 0.05 else "no"
    print(f"max overhead {overhead:+.1%} ({worst['case']}, N={worst['N']}): within 5 %: {verdict}\n")

    module, fast = bench_module(budget_s)
    print("attnlab MultiheadAttention vs torch.nn.MultiheadAttention: B=8, L=256, E=512, H=8, "
          "need_weights=False")
    print_table(module, COLUMNS)
    print(f"torch took its fused fast path in eval: {'yes' if fast else 'no'}")

    results = [result(f"{r['case']} N={r['N']}", r["ours_ms"], r["peer_ms"], unit="ms", ratio=r["ratio"],
                      target="ratio <= 1.05" if r in functional else "", met=r["ratio"] <= 1.05 if r in functional
                      else None) for r in functional + module]
    write_json(args.out, functional + module, results=results, max_overhead=overhead,
               within_5_percent=overhead <= 0.05, torch_mha_fast_path=fast)
    print(f"wrote {args.out}\n")


def main(argv=None) -> None:
    p = parser(__doc__.splitlines()[0], "attention.json")
    p.add_argument("--suite", choices=["basic", "efficient", "all"], default="all", help="which suite (default all)")
    p.add_argument("--out-efficient", default=str(RESULTS / "runs" / "attention_efficient.json"),
                   help="where the efficient suite writes its JSON results")
    p.add_argument("--only", nargs="+", choices=SECTIONS, metavar="SECTION",
                   help=f"run only these sections of the efficient suite ({', '.join(SECTIONS)}; default all)")
    args = p.parse_args(argv)
    setup(args)
    if args.suite in ("basic", "all"):
        run_basic(args)
    if args.suite in ("efficient", "all"):
        run_efficient(args)


if __name__ == "__main__":
    main()
