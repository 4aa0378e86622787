"""attnlab attention against PyTorch's own, side by side (CPU, float32).

Suite ``basic`` (writes ``results/attention.json``):

1. The pipeline, ``attnlab.attention(q, k, v)`` with ``backend="auto"``, against
   ``F.scaled_dot_product_attention``: B=1, H=8, D=64, N in 512..4096, forward only, no grad;
   dense and causal (``causal=True`` against ``is_causal=True``).
2. The module, ``attnlab.modules.multihead.MultiheadAttention`` (weights copied with
   ``from_torch``) against ``torch.nn.MultiheadAttention(E, H, batch_first=True)``, B=8, L=256,
   E=512, H=8, ``need_weights=False``: (a) eval + no_grad self-attention, where torch may take its
   fused fast path; (b) training forward + backward.

Suite ``efficient`` (writes ``results/attention_efficient.json``): the ``tiled`` backend's
targets, B=1, H=8, D=64, fwd+bwd unless said otherwise:

1. causal sliding window w=256, ``attnlab.attention(q, k, v, causal=True, window=256)`` (auto
   picks ``tiled``) against SDPA with the dense boolean causal-window mask: forward at N=4096,
   8192, 16384; fwd+bwd at N=8192 (target ≥ 5× faster, peak memory ≤ ¼ of SDPA's); ours at
   N=16384 against ours at N=8192 (time ratio ≤ 2.3: linear in N).
2. causal full attention through ``backend="tiled"`` against SDPA ``is_causal=True``, N=4096
   (within 2×).
3. ALiBi ``score_mod``, causal, N=16384, ours only (peak memory ≤ 512 MiB; the naive
   materialised path's 3-4 × B·H·N²·4 bytes is printed, computed, not run).
4. ``attention_weights`` for 4 rows of one head at N=16384 from the saved log-sum-exp (tiny).

Peak memory is the rise of the peak RSS during one step in a fresh process, inputs (and SDPA's
mask) allocated before and one small warm-up step of the same case run first
(``_common.peak_rss_rise_mib``).

Each pair is timed round-robin (see ``_common.compare``) after checking that both compute the same
output (and, for fwd+bwd, the same input gradients). Run:
``python benchmarks/attention.py [--suite basic|efficient|all] [--quick] [--threads 2] [--out PATH]
[--out-efficient PATH]``.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (RESULTS, auto_repeat, compare, parser, peak_rss_rise_mib, print_table,  # noqa: E402
                     setup, write_json)

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

    write_json(args.out, functional + module, max_overhead=overhead, within_5_percent=overhead <= 0.05,
               torch_mha_fast_path=fast)
    print(f"wrote {args.out}\n")


# ---- suite "efficient": the tiled backend's targets ------------------------------------------

WINDOW = 256
HEADS, HEAD_DIM = 8, 64
SIZES = {  # full / --quick
    False: dict(window_fwd=[4096, 8192, 16384], window=8192, window_long=16384, causal=4096, alibi=16384,
                weights=16384),
    True: dict(window_fwd=[256, 512], window=512, window_long=1024, causal=256, alibi=512, weights=512),
}
REPEAT = 3
EFF_COLUMNS = ["case", "N", "ours_ms", "peer_ms", "ratio", "ours_mib", "peer_mib", "target", "met", "repeat"]


def make_inputs(n: int, *, grad: bool) -> tuple[torch.Tensor, ...]:
    """``q, k, v`` of shape ``(1, 8, n, 64)``."""
    return tuple(torch.randn(1, HEADS, n, HEAD_DIM, requires_grad=grad) for _ in range(3))


def window_mask(n: int, w: int = WINDOW) -> torch.Tensor:
    """``(n, n)`` bool, True where ``0 <= i - j < w`` (built in place: no N² temporaries)."""
    return torch.ones(n, n, dtype=torch.bool).tril_().triu_(1 - w)


def alibi():
    return attnlab.alibi_score_mod(attnlab.alibi_slopes(HEADS))


def make_step(case: str, qkv, *, grad: bool) -> Callable[[], tuple]:
    """One step of ``case`` on ``qkv``, its extra inputs (SDPA's mask, the saved LSE) allocated now.

    The step returns what is checked: ``(out,)``, or ``(out, dq, dk, dv)`` with ``grad`` (it
    runs ``out.sum().backward()``).
    """
    q, k, v = qkv
    n = q.shape[2]
    if case == "window":
        fwd = lambda: attnlab.attention(q, k, v, causal=True, window=WINDOW)  # noqa: E731
    elif case == "window_sdpa":
        mask = window_mask(n)
        fwd = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # noqa: E731
    elif case == "causal_tiled":
        fwd = lambda: attnlab.attention(q, k, v, causal=True, backend="tiled")  # noqa: E731
    elif case == "causal_sdpa":
        fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    elif case == "alibi":
        mod = alibi()
        fwd = lambda: attnlab.attention(q, k, v, causal=True, score_mod=mod)  # noqa: E731
    elif case == "weights":  # 4 rows of head 0, from the LSE a forward pass saved
        mod = alibi()
        with torch.no_grad():
            _, lse = attnlab.attention(q, k, v, causal=True, score_mod=mod, return_lse=True)
        rows = weight_rows(n)
        return lambda: (attnlab.attention_weights(q, k, lse=lse, heads=0, rows=rows, causal=True, score_mod=mod),)
    else:
        raise ValueError(f"unknown case {case!r}")

    def step():
        if not grad:
            with torch.no_grad():
                return (fwd(),)
        for t in qkv:
            t.grad = None
        out = fwd()
        out.sum().backward()
        return (out.detach(), q.grad, k.grad, v.grad)
    return step


def weight_rows(n: int) -> list[int]:
    return [0, n // 3, n // 2, n - 1]


def rise_mib(case: str, n: int, *, grad: bool, threads: int) -> float:
    """Peak RSS rise of one step of ``case`` in a fresh process (inputs allocated before).

    One small step of the same case (N/4, at most 512) runs first, so one-time library scratch
    (oneDNN/MKL buffers, thread pools) is not charged to the measured step, as in any long-running
    process; it is smaller than the measured one, so its freed pages cannot hide the whole rise.
    """
    warm = max(64, min(512, n // 4))
    setup_code = (f"import runpy\nns = runpy.run_path({str(Path(__file__).resolve())!r})\n"
                  f"ns['make_step']({case!r}, ns['make_inputs']({warm}, grad={grad}), grad={grad})()\n"
                  f"step = ns['make_step']({case!r}, ns['make_inputs']({n}, grad={grad}), grad={grad})")
    return peak_rss_rise_mib(setup_code, "step()", threads=threads)


def check_all(ours: tuple, peer: tuple, what: str) -> None:
    for name, a, b in zip(["out", "dq", "dk", "dv"], ours, peer):
        where = f"{what} {name}"
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5, msg=lambda m, where=where: f"{where}: {m}")


def timed_pair(ours: Callable, peer: Callable, what: str, *, repeat: int = REPEAT) -> dict[str, float]:
    """Check ``ours`` against ``peer`` on the warm-up call, then ``repeat`` interleaved runs."""
    check_all(ours(), peer(), what)
    return compare({"ours": ours, "peer": peer}, repeat=repeat, warmup=0)


def eff_row(case: str, n: int, ours_ms: float, peer_ms: float | None = None, *, target: str, met,
            repeat: int = REPEAT, ours_mib: float | None = None, peer_mib: float | None = None,
            **extra) -> dict:
    return {"case": case, "N": n, "ours_ms": ours_ms, "peer_ms": peer_ms,
            "ratio": None if peer_ms is None else ours_ms / peer_ms, "ours_mib": ours_mib,
            "peer_mib": peer_mib, "target": target, "met": None if met is None else ("yes" if met else "no"),
            "repeat": repeat, **extra}


def alibi_dense_bias(n: int) -> torch.Tensor:
    """``(H, n, n)`` float: ``m_h (j - i)`` where ``j <= i``, ``-inf`` above the diagonal."""
    d = (torch.arange(n).view(1, -1) - torch.arange(n).view(-1, 1)).float()   # j - i
    bias = attnlab.alibi_slopes(HEADS).view(-1, 1, 1) * d
    return bias.masked_fill(d > 0, float("-inf"))


def bench_efficient(sizes: dict, threads: int) -> dict[str, list[dict]]:
    tables: dict[str, list[dict]] = {}
    say = lambda msg: print(f"  [{msg}]", file=sys.stderr, flush=True)  # noqa: E731

    # 1. sliding window, forward only
    rows = []
    for n in sizes["window_fwd"]:
        qkv = make_inputs(n, grad=False)
        t = timed_pair(make_step("window", qkv, grad=False), make_step("window_sdpa", qkv, grad=False),
                       f"window fwd N={n}")
        rows.append(eff_row("window fwd", n, t["ours"], t["peer"], target="-", met=None))
        say(f"window fwd N={n}")
    tables["window fwd (no grad)"] = rows

    # 2. sliding window, fwd+bwd: time and memory against SDPA; then ours at 2N against ours at N
    n, n2 = sizes["window"], sizes["window_long"]
    qkv = make_inputs(n, grad=True)
    ours = make_step("window", qkv, grad=True)
    t = timed_pair(ours, make_step("window_sdpa", qkv, grad=True), f"window fwd+bwd N={n}")
    mem = {c: rise_mib(c, n, grad=True, threads=threads) for c in ("window", "window_sdpa")}
    speed = t["ours"] / t["peer"]
    mem_ratio = mem["window"] / mem["window_sdpa"] if mem["window_sdpa"] > 0 else None
    tables["window fwd+bwd"] = [eff_row(
        "window fwd+bwd", n, t["ours"], t["peer"], ours_mib=mem["window"], peer_mib=mem["window_sdpa"],
        mem_ratio=mem_ratio, target="ratio<=0.2, mem<=1/4", met=speed <= 0.2 and (mem_ratio or 1.0) <= 0.25)]
    say(f"window fwd+bwd N={n}")
    long = make_step("window", make_inputs(n2, grad=True), grad=True)
    long()  # warm-up
    t = compare({"long": long, "short": ours}, repeat=REPEAT, warmup=0)
    tables[f"window fwd+bwd, ours at N={n2} vs ours at N={n}"] = [eff_row(
        "window 2N/N", n2, t["long"], t["short"], ours_mib=rise_mib("window", n2, grad=True, threads=threads),
        peer_mib=mem["window"], target="ratio<=2.3", met=t["long"] / t["short"] <= 2.3)]
    say(f"window fwd+bwd N={n2}")

    # 3. full causal attention through the tiled backend
    n = sizes["causal"]
    qkv = make_inputs(n, grad=True)
    t = timed_pair(make_step("causal_tiled", qkv, grad=True), make_step("causal_sdpa", qkv, grad=True),
                   f"causal tiled N={n}")
    tables["causal fwd+bwd, backend='tiled' vs SDPA is_causal"] = [eff_row(
        "causal tiled", n, t["ours"], t["peer"], ours_mib=rise_mib("causal_tiled", n, grad=True, threads=threads),
        peer_mib=rise_mib("causal_sdpa", n, grad=True, threads=threads), target="ratio<=2",
        met=t["ours"] / t["peer"] <= 2)]
    say(f"causal N={n}")

    # 4. ALiBi score_mod at long N: ours only; checked first against SDPA with the dense bias, small N
    small = make_inputs(512, grad=False)
    check_all(make_step("alibi", small, grad=False)(),
              (F.scaled_dot_product_attention(*small, attn_mask=alibi_dense_bias(512)),), "alibi N=512")
    n = sizes["alibi"]
    step = make_step("alibi", make_inputs(n, grad=True), grad=True)
    repeat = 2 if n >= 16384 else REPEAT  # ~10-25 s a step on 2 cores
    step()  # warm-up
    ms = compare({"ours": step}, repeat=repeat, warmup=0)["ours"]
    naive = [c * HEADS * n * n * 4 / 2**20 for c in (3, 4)]  # B = 1
    mib = rise_mib("alibi", n, grad=True, threads=threads)
    tables["ALiBi score_mod, causal, fwd+bwd (ours only)"] = [eff_row(
        "alibi causal", n, ms, ours_mib=mib, naive_mib=naive, target="mem<=512", met=mib <= 512, repeat=repeat)]
    say(f"alibi N={n}")

    # 5. a few rows of the weights, recovered from the saved LSE
    n = sizes["weights"]
    q, k, _ = qkv = make_inputs(n, grad=False)
    step = make_step("weights", qkv, grad=False)
    (w,) = step()
    rows = weight_rows(n)
    d = (torch.arange(n).view(1, -1) - torch.tensor(rows).view(-1, 1)).float()  # j - i, (4, N)
    s = q[0, 0, rows] @ k[0, 0].T / HEAD_DIM ** 0.5 + attnlab.alibi_slopes(HEADS)[0] * d
    s = s.masked_fill(d > 0, float("-inf"))
    torch.testing.assert_close(w[0, 0], torch.softmax(s, dim=-1), rtol=1e-4, atol=1e-6)
    repeat = max(REPEAT, auto_repeat(step, budget_s=0.5))
    ms = compare({"ours": step}, repeat=repeat, warmup=0)["ours"]
    mib = rise_mib("weights", n, grad=False, threads=threads)
    tables["attention_weights: 4 rows of head 0 from the LSE (ALiBi, causal)"] = [eff_row(
        "weights 4 rows", n, ms, ours_mib=mib, target="ms<100, mem<16", met=ms < 100 and mib < 16,
        repeat=repeat)]
    say(f"weights N={n}")
    return tables


def run_efficient(args) -> None:
    tables = bench_efficient(SIZES[args.quick], args.threads)
    print(f"efficient attention (tiled backend): fp32, B=1, H={HEADS}, D={HEAD_DIM}, window={WINDOW}, "
          f"{args.threads} threads; ms = median of `repeat` interleaved runs after 1 warm-up; ratio = "
          f"ours_ms / peer_ms; MiB = peak RSS rise of one step in a fresh process"
          + (" (--quick: sizes too small for the targets)" if args.quick else ""))
    for title, rows in tables.items():
        print(f"\n{title}")
        print_table([{c: "-" if r.get(c) is None else r[c] for c in EFF_COLUMNS} for r in rows], EFF_COLUMNS)
        for r in rows:
            if "naive_mib" in r:
                lo, hi = r["naive_mib"]
                print(f"naive materialised path (3-4 x B*H*N^2*4 bytes, computed, not run): "
                      f"{lo:.0f}-{hi:.0f} MiB, {lo / r['ours_mib']:.1f}-{hi / r['ours_mib']:.1f}x ours")
    rows = [r for rs in tables.values() for r in rs]
    met = [r["met"] for r in rows if r["met"] is not None]
    print(f"\ntargets met: {met.count('yes')}/{len(met)}")
    write_json(args.out_efficient, rows, window=WINDOW, heads=HEADS, head_dim=HEAD_DIM, quick=args.quick)
    print(f"wrote {args.out_efficient}")


def main(argv=None) -> None:
    p = parser(__doc__.splitlines()[0], "attention.json")
    p.add_argument("--suite", choices=["basic", "efficient", "all"], default="all", help="which suite (default all)")
    p.add_argument("--out-efficient", default=str(RESULTS / "attention_efficient.json"),
                   help="where the efficient suite writes its JSON results")
    args = p.parse_args(argv)
    setup(args)
    if args.suite in ("basic", "all"):
        run_basic(args)
    if args.suite in ("efficient", "all"):
        run_efficient(args)


if __name__ == "__main__":
    main()
