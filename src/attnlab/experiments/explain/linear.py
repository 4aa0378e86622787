"""Exact vs linear attention vs an RNN: time and memory as the sequence grows, and the crossover.

Four causal sequence-mixing layers of the same width E = 512 (8 heads of 64), batch 1, float32:

* exact attention, flash-style kernel: :class:`MultiheadAttention` (``softmax(Q Kᵀ/sqrt(d)) V``,
  SDPA backend): O(L²) time, O(L) memory;
* exact attention, materialised: the same module on the ``reference`` backend (the L × L weights
  are built): O(L²) time and memory;
* linear attention (Katharopoulos et al. 2020): :class:`PerformerAttention` with ``φ = elu + 1``,
  ``out_i = φ(q_i)ᵀ Σ_{j≤i} φ(k_j) v_jᵀ / φ(q_i)ᵀ Σ_{j≤i} φ(k_j)``: O(L) time and memory;
* an RNN: ``torch.nn.GRU(512, 512)``: O(L) time and memory, but L sequential steps.

Time: median wall-clock of the forward pass (``no_grad``) and of forward + backward. Memory: the
activation memory autograd keeps for the backward pass (bytes of the distinct tensors saved by
``saved_tensors_hooks``, parameters excluded), exact and independent of the allocator.
The crossover is where an O(L) layer becomes faster than exact attention (interpolated between
measured lengths on a log-log scale; extrapolated from the last two points when it lies beyond).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Optional, Union

import torch
from torch import Tensor, nn

from attnlab.modules.linear import PerformerAttention
from attnlab.modules.multihead import MultiheadAttention
from attnlab.experiments.explain._report import check_run_args, finish, fmt, median_ms, plt, stage

DIM, HEADS = 512, 8
LAYERS = ("exact (flash)", "exact (materialised)", "linear", "GRU")


def build(name: str) -> tuple[nn.Module, Callable[[nn.Module, Tensor], Tensor]]:
    """The layer and how to call it on ``x (1, L, E)``."""
    if name == "exact (flash)":
        return MultiheadAttention(DIM, HEADS), lambda m, x: m(x, need_weights=False, is_causal=True)[0]
    if name == "exact (materialised)":
        return (MultiheadAttention(DIM, HEADS, backend="reference"),
                lambda m, x: m(x, need_weights=False, is_causal=True)[0])
    if name == "linear":
        return PerformerAttention(DIM, HEADS, causal=True, feature_map="elu"), lambda m, x: m(x)
    if name == "GRU":
        return nn.GRU(DIM, DIM, batch_first=True), lambda m, x: m(x)[0]
    raise ValueError(f"layer must be one of {LAYERS}, got {name!r}")


def saved_activation_mib(module: nn.Module, call, x: Tensor) -> float:
    """MiB of the distinct non-parameter tensors autograd saves for the backward of ``call(module, x)``."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        call(module, x)
    return sum(seen.values()) / 2 ** 20


def power_fit(ns: list[float], ts: list[float]) -> tuple[float, float]:
    """Least-squares ``log t = p log n + c``: returns ``(p, c)``."""
    x = torch.tensor(ns, dtype=torch.float64).log()
    a = torch.stack([x, torch.ones_like(x)], 1)
    p, c = torch.linalg.lstsq(a, torch.tensor(ts, dtype=torch.float64).log().unsqueeze(1)).solution.flatten().tolist()
    return p, c


def crossover(lengths: list[int], fast: list[Optional[float]], slow: list[Optional[float]]
              ) -> tuple[Optional[float], str]:
    """The length from which ``fast`` stays below ``slow`` at every larger measured length.

    Returns ``(L, how)``: ``"measured"`` — interpolated on a log-log scale between the last length
    where ``fast`` was not faster and the next one; ``"below range"`` — faster at every measured
    length; ``"extrapolated"`` — never faster, so power laws fitted (least squares, log-log) to
    each curve's last three points are solved for their meeting point; ``(None, "curves do not
    meet")`` when ``fast`` grows at least as fast as ``slow``.
    """
    pts = [(n, f, s) for n, f, s in zip(lengths, fast, slow) if f is not None and s is not None]
    if len(pts) < 2:
        return None, "too few points"
    slower = [i for i, (_, f, s) in enumerate(pts) if f >= s]
    if not slower:
        return float(pts[0][0]), "below range"
    i = slower[-1]
    if i < len(pts) - 1:
        (n0, f0, s0), (n1, f1, s1) = pts[i], pts[i + 1]
        r0, r1 = math.log(f0 / s0), math.log(f1 / s1)  # r0 >= 0 > r1
        return math.exp(math.log(n0) + (math.log(n1) - math.log(n0)) * r0 / (r0 - r1)), "measured"
    tail = pts[-3:]
    pf, cf = power_fit([n for n, _, _ in tail], [f for _, f, _ in tail])
    ps, cs = power_fit([n for n, _, _ in tail], [s for _, _, s in tail])
    if ps <= pf + 1e-9 * max(1.0, abs(pf)):  # equal slopes up to LAPACK's round-off (it varies with alignment)
        return None, "curves do not meet"
    log_l = (cf - cs) / (ps - pf)
    if log_l > math.log(1e12):
        return None, "extrapolated beyond 1e12"
    return math.exp(log_l), "extrapolated"


def run(out_dir: Union[str, Path], *, seed: int = 0, quick: bool = False) -> dict:
    """Time and memory of the four layers across lengths; the crossovers; the report."""
    out = check_run_args(out_dir, seed, quick)
    torch.manual_seed(seed)
    lengths = [64, 128, 256] if quick else [128, 256, 512, 1024, 2048, 4096, 8192]
    # largest L per layer: the L × L × 8 heads weights are 128 MiB at 2048; the GRU's L steps are slow
    cap = {"exact (materialised)": 256 if quick else 2048, "GRU": 256 if quick else 4096}
    budget = 0.05 if quick else 0.6
    layers = {name: build(name) for name in LAYERS}
    rows = []
    for n in lengths:
        stage(f"linear: timing L = {n}")
        x = torch.randn(1, n, DIM)
        xg = x.clone().requires_grad_(True)
        row = {"L": n}
        for name, (mod, call) in layers.items():
            if n > cap.get(name, n):
                row.update({f"{name} fwd ms": None, f"{name} fwd+bwd ms": None, f"{name} MiB": None})
                continue
            with torch.no_grad():
                row[f"{name} fwd ms"] = median_ms(lambda: call(mod, x), budget_s=budget)

            def step():
                mod.zero_grad(set_to_none=True)
                call(mod, xg).sum().backward()
            row[f"{name} fwd+bwd ms"] = median_ms(step, budget_s=budget, max_repeat=5)
            row[f"{name} MiB"] = saved_activation_mib(mod, call, xg)
        rows.append(row)
        print(f"L={n}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items() if k != "L" and v is not None), flush=True)

    series = lambda name, what: [r[f"{name} {what}"] for r in rows]  # noqa: E731
    cross = {}
    for fast in ("linear", "GRU"):
        for what in ("fwd ms", "fwd+bwd ms"):
            cross[f"{fast} vs exact (flash), {what[:-3]}"] = crossover(lengths, series(fast, what),
                                                                       series("exact (flash)", what))
    cross_rows = [{"pair": k, "crossover L": None if v[0] is None else round(v[0]), "how": v[1]}
                  for k, v in cross.items()]

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, what, ttl in ((axes[0], "fwd ms", "forward (no_grad), ms"),
                          (axes[1], "fwd+bwd ms", "forward + backward, ms"),
                          (axes[2], "MiB", "activation memory saved for backward, MiB")):
        for name in LAYERS:
            pts = [(n, v) for n, v in zip(lengths, series(name, what)) if v is not None]
            ax.loglog(*zip(*pts), "o-", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length L")
        ax.set_title(ttl)
        ax.legend(fontsize=8)
    first, last = rows[0], rows[-1]
    last_mat = [r for r in rows if r["exact (materialised) MiB"] is not None][-1]
    last_gru = [r for r in rows if r["GRU MiB"] is not None][-1]
    n1 = last["L"]

    def growth(name, what):
        pts = [(r["L"], r[f"{name} {what}"]) for r in rows if r[f"{name} {what}"] is not None][-3:]
        return power_fit(*zip(*pts))[0]

    findings = [
        "Growth exponent p (∝ L^p, least squares over the last three lengths measured), forward + backward time: "
        + ", ".join(f"{name} {growth(name, 'fwd+bwd ms'):.2f}" for name in LAYERS) + "; memory: "
        + ", ".join(f"{name} {growth(name, 'MiB'):.2f}" for name in LAYERS) + ".",
        f"At L = {n1}, forward + backward: exact (flash) {last['exact (flash) fwd+bwd ms']:.0f} ms, linear "
        f"{last['linear fwd+bwd ms']:.0f} ms (GRU at L = {last_gru['L']}: {last_gru['GRU fwd+bwd ms']:.0f} ms); "
        f"activation memory {last['exact (flash) MiB']:.0f} / {last['linear MiB']:.0f} MiB (GRU "
        f"{last_gru['GRU MiB']:.0f} MiB at {last_gru['L']}). The materialised "
        f"exact layer keeps the L × L weights: {first['exact (materialised) MiB']:.1f} MiB at L = {first['L']}, "
        f"{last_mat['exact (materialised) MiB']:.0f} MiB at L = {last_mat['L']}, growing as L² (stopped there).",
        "Crossovers (where the O(L) layer becomes faster than exact flash attention): "
        + "; ".join(f"{r['pair']}: {'none' if r['crossover L'] is None else '≈ ' + fmt(r['crossover L'])} "
                    f"({r['how']})" for r in cross_rows) + ".",
        "Exact attention does O(L²) work but in large matrix products that use the cores fully; the GRU does "
        "O(L) work in L small sequential steps, so on a CPU it loses to exact attention until L is long; linear "
        "attention does O(L) work in chunked matrix products.",
    ]
    per = lambda what: [{"L": r["L"], **{name: r[f"{name} {what}"] for name in LAYERS}} for r in rows]  # noqa: E731
    setup = f"E = {DIM}, {HEADS} heads, batch 1, float32, {torch.get_num_threads()} threads"
    return finish(out, "linear", title="Exact vs linear attention vs an RNN", intro=__doc__.split("\n\n", 1)[1].strip(),
                  tables=[(f"Forward (no_grad), median ms ({setup})", per("fwd ms"), ["L", *LAYERS]),
                          ("Forward + backward, median ms", per("fwd+bwd ms"), ["L", *LAYERS]),
                          ("Activation memory saved for backward, MiB", per("MiB"), ["L", *LAYERS]),
                          ("Crossovers", cross_rows, ["pair", "crossover L", "how"])],
                  findings=findings, fig=fig,
                  results={"seed": seed, "quick": quick, "threads": torch.get_num_threads(), "rows": rows,
                           "crossovers": cross_rows})
