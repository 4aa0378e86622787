"""Suite ``efficient`` of ``benchmarks/attention.py``: the ``tiled`` backend against SDPA, with its targets.

fp32, B=1, H=8, D=64, fwd+bwd unless said otherwise; every pair is checked equal (output and input
gradients) before it is timed round-robin (``_common.compare``), so both sides see the same machine load.

| row | measured | target |
|---|---|---|
| window fwd | causal window w=256, forward, N=4096/8192/16384, vs SDPA + dense window mask | (reported) |
| window fwd+bwd | the same at N=8192; ``flop_ratio`` = our time / (the band's exact matmul FLOPs ÷ the fp32 rate the probe measures now); peak-memory rise of both | ratio ≤ 0.05 (≥ 20×), flop_ratio ≤ 2 |
| window 2N/N | ours at N=16384 against ours at N=8192 | ≤ 2.3 (linear in N) |
| causal tiled | full causal through ``backend="tiled"``, N=4096, vs SDPA ``is_causal`` | ratio ≤ 1.1 |
| under load | the window row at N=8192, quiet and while a second process (started here) keeps one core busy: slowdown = loaded / quiet time, ours and SDPA's | ours ≤ 2 × SDPA's |
| alibi causal | ALiBi ``score_mod``, time at N=16384; peak-memory rise of one step at N=32768 in a fresh process | ≤ 1024 MiB at 32768 |
| document / bigbird | packed documents of random lengths (causal within each, ``mask_mod``) and BigBird (block 64, 1 global, 3 window, 2 random blocks), N=8192, vs SDPA with the equal dense mask; ``skipped`` = fraction of 128×128 blocks the mask empties | (reported) |
| weights 4 rows | ``attention_weights`` for 4 rows of one head at N=16384 from the saved log-sum-exp | < 100 ms, < 16 MiB |

The band's FLOPs: P visible (query, key) pairs × H heads × 2·D per product × 7 products (forward
``QKᵀ``, ``PV``; backward ``dO Vᵀ``, ``Pᵀ dO``, ``dS K``, ``dSᵀ Q`` and one ``QKᵀ`` — recomputed, or
its ``e^(S-m)`` kept, which the count charges anyway). Peak memory: the rise of the peak RSS during
one step in a fresh process, inputs allocated before and one small warm-up step first
(``_common.peak_rss_rise_mib``).
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import auto_repeat, compare, peak_rss_rise_mib, print_table, write_json  # noqa: E402

import attnlab  # noqa: E402
from attnlab._runtime import probe  # noqa: E402
from attnlab.functional.masks import bigbird_mod, document_mod, evaluate_mask_mod  # noqa: E402

WINDOW = 256
HEADS, HEAD_DIM = 8, 64
# the sections of the suite, in order (``--only`` picks some: a run that must fit a time limit)
SECTIONS = ("window-fwd", "window", "causal", "load", "alibi", "sparse", "weights")

SIZES = {  # full / --quick
    False: dict(window_fwd=[4096, 8192, 16384], window=8192, window_long=16384, causal=4096, alibi=16384,
                alibi_mem=32768, weights=16384, load=8192, sparse=8192),
    True: dict(window_fwd=[256, 512], window=512, window_long=1024, causal=256, alibi=512, alibi_mem=512,
               weights=512, load=512, sparse=512),
}
REPEAT = 3
BUSY = "import torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\nwhile True:\n    a @ a\n"
EFF_COLUMNS = ["case", "N", "ours_ms", "peer_ms", "ratio", "ours_mib", "peer_mib", "target", "met", "repeat"]


def make_inputs(n: int, *, grad: bool) -> tuple[torch.Tensor, ...]:
    """``q, k, v`` of shape ``(1, 8, n, 64)``."""
    return tuple(torch.randn(1, HEADS, n, HEAD_DIM, requires_grad=grad) for _ in range(3))


def window_mask(n: int, w: int = WINDOW) -> torch.Tensor:
    """``(n, n)`` bool, True where ``0 <= i - j < w`` (built in place: no N² temporaries)."""
    return torch.ones(n, n, dtype=torch.bool).tril_().triu_(1 - w)


def alibi():
    return attnlab.alibi_score_mod(attnlab.alibi_slopes(HEADS))


def document_ids(n: int, seed: int = 0) -> torch.Tensor:
    """``(n,)`` document number of each position: documents of 64–1023 tokens (fixed seed) packed to ``n``."""
    g = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < n:
        lengths.append(min(int(torch.randint(64, 1024, (1,), generator=g)), n - total))
        total += lengths[-1]
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def sparse_mod(case: str, n: int):
    """``(mask_mod, causal)`` of the ``document`` or ``bigbird`` case."""
    if case == "document":
        return document_mod(document_ids(n)), True
    return bigbird_mod(64, seq_len=n, num_global_blocks=1, window_blocks=3, num_random_blocks=2), False


def dense_mask(case: str, n: int) -> torch.Tensor:
    """The ``(n, n)`` bool mask SDPA gets for a ``document`` / ``bigbird`` case."""
    mod, causal = sparse_mod(case, n)
    allowed = evaluate_mask_mod(mod, 1, 1, n, n, None).reshape(n, n).clone()
    return allowed.tril_() if causal else allowed


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
    elif case in ("document", "bigbird"):
        mod, causal = sparse_mod(case, n)
        fwd = lambda: attnlab.attention(q, k, v, causal=causal, mask_mod=mod)  # noqa: E731
    elif case in ("document_sdpa", "bigbird_sdpa"):
        mask = dense_mask(case.removesuffix("_sdpa"), n)
        fwd = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # noqa: E731
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


def band_gflop(n: int, w: int = WINDOW) -> float:
    """Matmul GFLOP of one causal-window fwd+bwd: visible pairs × H × 2·D × 7 products."""
    pairs = sum(min(i + 1, w) for i in range(n))
    return pairs * HEADS * 2 * HEAD_DIM * 7 / 1e9


def skipped_blocks(mask: torch.Tensor, block: int = 128) -> float:
    """Fraction of ``block × block`` tiles of an ``(n, n)`` bool mask that are entirely False."""
    n = mask.shape[-1]
    nb = -(-n // block)
    padded = F.pad(mask, (0, nb * block - n, 0, nb * block - n))
    return 1.0 - padded.view(nb, block, nb, block).any(dim=3).any(dim=1).float().mean().item()


def under_load(ours: Callable, peer: Callable, *, repeat: int) -> dict:
    """Quiet and loaded times of ``ours`` and ``peer``; the load is a process busy on one core, killed after."""
    quiet = compare({"ours": ours, "peer": peer}, repeat=repeat, warmup=1)
    busy = subprocess.Popen([sys.executable, "-c", BUSY], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)  # let it start spinning
        loaded = compare({"ours": ours, "peer": peer}, repeat=repeat, warmup=1)
    finally:
        busy.kill()
        busy.wait()
    return {"quiet": quiet, "loaded": loaded, "busy_pid": busy.pid}


def bench_efficient(sizes: dict, threads: int, only: tuple = SECTIONS) -> dict[str, list[dict]]:
    """The tables of the sections in ``only`` (default: all of :data:`SECTIONS`)."""
    tables: dict[str, list[dict]] = {}
    want = lambda section: section in only  # noqa: E731
    say = lambda msg: print(f"  [{msg}]", file=sys.stderr, flush=True)  # noqa: E731
    peak = probe(measure=True).fp32_gflops

    # 1. sliding window, forward only
    if want("window-fwd"):
        rows = []
        for n in sizes["window_fwd"]:
            qkv = make_inputs(n, grad=False)
            t = timed_pair(make_step("window", qkv, grad=False), make_step("window_sdpa", qkv, grad=False),
                           f"window fwd N={n}")
            rows.append(eff_row("window fwd", n, t["ours"], t["peer"], target="-", met=None))
            say(f"window fwd N={n}")
        tables["window fwd (no grad)"] = rows

    # 2. sliding window, fwd+bwd: time against SDPA and against the FLOPs; memory; then ours at 2N against N
    if want("window"):
        n, n2 = sizes["window"], sizes["window_long"]
        qkv = make_inputs(n, grad=True)
        ours = make_step("window", qkv, grad=True)
        t = timed_pair(ours, make_step("window_sdpa", qkv, grad=True), f"window fwd+bwd N={n}")
        mem = {c: rise_mib(c, n, grad=True, threads=threads) for c in ("window", "window_sdpa")}
        speed = t["ours"] / t["peer"]
        flop_ms = band_gflop(n) / peak * 1e3
        tables["window fwd+bwd"] = [eff_row(
            "window fwd+bwd", n, t["ours"], t["peer"], ours_mib=mem["window"], peer_mib=mem["window_sdpa"],
            mem_ratio=mem["window"] / mem["window_sdpa"] if mem["window_sdpa"] > 0 else None,
            gflop=band_gflop(n), peak_gflops=peak, flop_ms=flop_ms, flop_ratio=t["ours"] / flop_ms,
            target="ratio<=0.05, flop_ratio<=2", met=speed <= 0.05 and t["ours"] / flop_ms <= 2)]
        say(f"window fwd+bwd N={n}")
        long = make_step("window", make_inputs(n2, grad=True), grad=True)
        long()  # warm-up
        t = compare({"long": long, "short": ours}, repeat=REPEAT, warmup=0)
        tables[f"window fwd+bwd, ours at N={n2} vs ours at N={n}"] = [eff_row(
            "window 2N/N", n2, t["long"], t["short"], ours_mib=rise_mib("window", n2, grad=True, threads=threads),
            peer_mib=mem["window"], target="ratio<=2.3", met=t["long"] / t["short"] <= 2.3)]
        say(f"window fwd+bwd N={n2}")

    # 3. full causal attention through the tiled backend
    if want("causal"):
        n = sizes["causal"]
        qkv = make_inputs(n, grad=True)
        t = timed_pair(make_step("causal_tiled", qkv, grad=True), make_step("causal_sdpa", qkv, grad=True),
                       f"causal tiled N={n}")
        tables["causal fwd+bwd, backend='tiled' vs SDPA is_causal"] = [eff_row(
            "causal tiled", n, t["ours"], t["peer"], ours_mib=rise_mib("causal_tiled", n, grad=True, threads=threads),
            peer_mib=rise_mib("causal_sdpa", n, grad=True, threads=threads), target="ratio<=1.1",
            met=t["ours"] / t["peer"] <= 1.1)]
        say(f"causal N={n}")

    # 4. the window row again, quiet and with one core taken by another process
    if want("load"):
        n = sizes["load"]
        qkv = make_inputs(n, grad=True)
        ld = under_load(make_step("window", qkv, grad=True), make_step("window_sdpa", qkv, grad=True), repeat=REPEAT)
        slow = {s: ld["loaded"][s] / ld["quiet"][s] for s in ("ours", "peer")}
        tables["window fwd+bwd under load (a second process busy on one core)"] = [eff_row(
            "under load", n, ld["loaded"]["ours"], ld["loaded"]["peer"], quiet_ours_ms=ld["quiet"]["ours"],
            quiet_peer_ms=ld["quiet"]["peer"], slowdown_ours=slow["ours"], slowdown_peer=slow["peer"],
            busy_pid=ld["busy_pid"], target="slowdown_ours<=2*slowdown_peer", met=slow["ours"] <= 2 * slow["peer"])]
        say(f"under load N={n}")

    # 5. ALiBi score_mod: checked against SDPA with the dense bias (small N), timed at N, memory at the long N
    if want("alibi"):
        small = make_inputs(512, grad=False)
        check_all(make_step("alibi", small, grad=False)(),
                  (F.scaled_dot_product_attention(*small, attn_mask=alibi_dense_bias(512)),), "alibi N=512")
        n, n_mem = sizes["alibi"], sizes["alibi_mem"]
        step = make_step("alibi", make_inputs(n, grad=True), grad=True)
        repeat = 2 if n >= 16384 else REPEAT  # ~10-25 s a step on 2 cores
        step()  # warm-up
        ms = compare({"ours": step}, repeat=repeat, warmup=0)["ours"]
        naive = [c * HEADS * n_mem * n_mem * 4 / 2**20 for c in (3, 4)]  # B = 1
        mib = rise_mib("alibi", n_mem, grad=True, threads=threads)
        tables[f"ALiBi score_mod, causal, fwd+bwd (ours only; time at N={n}, memory at N={n_mem})"] = [eff_row(
            "alibi causal", n, ms, ours_mib=mib, naive_mib=naive, mem_n=n_mem, target="mem<=1024 at mem_n",
            met=mib <= 1024, repeat=repeat)]
        say(f"alibi N={n}, memory N={n_mem}")

    # 6. block-sparse masks in a training step: packed documents and BigBird
    if want("sparse"):
        n = sizes["sparse"]
        rows = []
        for case in ("document", "bigbird"):
            qkv = make_inputs(n, grad=True)
            t = timed_pair(make_step(case, qkv, grad=True), make_step(f"{case}_sdpa", qkv, grad=True), f"{case} N={n}")
            rows.append(eff_row(case, n, t["ours"], t["peer"], skipped=skipped_blocks(dense_mask(case, n)),
                                target="-", met=None))
            say(f"{case} N={n}")
        tables["block-sparse masks, fwd+bwd, vs SDPA with the dense mask (skipped = empty 128x128 blocks)"] = rows

    # 7. a few rows of the weights, recovered from the saved LSE
    if want("weights"):
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
    only = tuple(args.only) if getattr(args, "only", None) else SECTIONS
    tables = bench_efficient(SIZES[args.quick], args.threads, only)
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
                print(f"naive materialised path at N={r['mem_n']} (3-4 x B*H*N^2*4 bytes, computed, not run): "
                      f"{lo:.0f}-{hi:.0f} MiB, {lo / max(r['ours_mib'], 1e-9):.0f}-{hi / max(r['ours_mib'], 1e-9):.0f}x ours")
            if "flop_ratio" in r:
                print(f"the band's matmuls: {r['gflop']:.1f} GFLOP, {r['flop_ms']:.0f} ms at the measured "
                      f"{r['peak_gflops']:.0f} GFLOP/s (fp32 512² product); ours / that = {r['flop_ratio']:.2f}")
            if "slowdown_ours" in r:
                print(f"quiet: ours {r['quiet_ours_ms']:.0f} ms, SDPA {r['quiet_peer_ms']:.0f} ms; slowdown under "
                      f"load: ours {r['slowdown_ours']:.2f}x, SDPA {r['slowdown_peer']:.2f}x")
            if "skipped" in r:
                print(f"{r['case']}: {r['skipped']:.1%} of 128x128 blocks empty; speed-up {1 / r['ratio']:.1f}x")
    rows = [r for rs in tables.values() for r in rs]
    met = [r["met"] for r in rows if r["met"] is not None]
    print(f"\ntargets met: {met.count('yes')}/{len(met)}")
    write_json(args.out_efficient, rows, window=WINDOW, heads=HEADS, head_dim=HEAD_DIM, quick=args.quick)
    print(f"wrote {args.out_efficient}")
