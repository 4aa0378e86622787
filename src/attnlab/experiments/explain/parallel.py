"""Why attention replaced recurrence though it does O(L²) work to an RNN's O(L): parallel steps.

An RNN computes ``h_t = f(h_{t-1}, x_t)``: ``L`` steps, each waiting for the one before, whatever
the hardware. Self-attention computes every position at once, ``softmax(Q Kᵀ/sqrt(d)) V``: more
work, in a few large matrix products with no dependency between positions: one step per layer,
which as many cores as there are can share (Vaswani et al. 2017, Table 1: sequential operations
O(L) vs O(1), maximum path length O(L) vs O(1)).

Both are measured, on the layers of ``explain linear`` (E = 512, batch 1, float32: ``torch.nn.GRU``
and causal :class:`MultiheadAttention`, 8 heads), with one input leaf per position:

* dependent steps: the longest chain of operations in the autograd graph of one forward pass (the
  ops that must run one after another, whatever the number of cores), and the path length
  between positions: the fewest operations from the input at ``s`` to the output at ``t = L − 1``,
  for ``s = 0`` (the farthest pair) and ``s = L − 1`` (for these counts the GRU is stepped by hand,
  ``h_t = GRUCell(x_t, h_{t-1})`` with the same weights, so that each input enters its own step);
* time: the median wall time of forward + backward against L, with torch's default number of
  threads and with one thread; the speed-up the extra threads give each layer; and where the GRU
  becomes faster than attention (the crossover, as in ``explain linear``) at each thread count.

The machine is recorded (CPU capability, threads, the load average while measuring): timings on
a shared machine are noisy, and the counts of steps are exact whatever the machine.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Union

import torch
from torch import nn

from attnlab.experiments.explain._report import check_run_args, finish, fmt, median_ms, plt, stage
from attnlab.experiments.explain.linear import build, crossover, power_fit

LAYERS = {"GRU": "GRU", "attention": "exact (flash)"}  # our name -> linear.build's name
DIM = 512


def unrolled_gru(gru: nn.GRU) -> nn.GRUCell:
    """The one-layer ``gru`` as a :class:`torch.nn.GRUCell` with the same weights, to be stepped by hand."""
    cell = nn.GRUCell(gru.input_size, gru.hidden_size)
    with torch.no_grad():
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            getattr(cell, name).copy_(getattr(gru, f"{name}_l0"))
    return cell


def graph_paths(name: str, length: int) -> dict:
    """Operation counts in the autograd graph of the output at ``L − 1`` for an input made of one
    leaf per position: the longest chain of operations (critical path) and the fewest operations
    from input position ``s`` to that output, for ``s = 0`` and ``s = L − 1``. The GRU is stepped
    by hand (its weights in a ``GRUCell``), so that each position's input enters its own step."""
    torch.manual_seed(0)
    mod, call = build(LAYERS[name])
    leaves = [torch.randn(1, DIM, requires_grad=True) for _ in range(length)]
    if name == "GRU":
        cell, h = unrolled_gru(mod), torch.zeros(1, DIM)
        for x in leaves:  # h_t = GRUCell(x_t, h_{t-1})
            h = cell(x, h)
        root = h.sum().grad_fn
    else:
        root = call(mod, torch.stack(leaves, dim=1))[:, -1].sum().grad_fn
    # the graph as adjacency lists, nodes in the order of a depth-first walk from the root
    children, order, stack = {}, [], [root]
    while stack:
        node = stack.pop()
        if node in children:
            continue
        children[node] = [f for f, _ in node.next_functions if f is not None]
        order.append(node)
        stack.extend(children[node])
    # longest path from the root: relax edges in a topological order (Kahn's algorithm)
    indegree = {n: 0 for n in children}
    for n in children:
        for c in children[n]:
            indegree[c] += 1
    longest, ready = {root: 0}, [root]
    while ready:
        n = ready.pop()
        for c in children[n]:
            longest[c] = max(longest.get(c, 0), longest[n] + 1)
            indegree[c] -= 1
            if indegree[c] == 0:
                ready.append(c)
    # shortest path from the root to each input leaf (breadth first)
    dist, frontier = {root: 0}, [root]
    while frontier:
        nxt = []
        for n in frontier:
            for c in children[n]:
                if c not in dist:
                    dist[c] = dist[n] + 1
                    nxt.append(c)
        frontier = nxt
    leaf_dist = {id(getattr(n, "variable", None)): d for n, d in dist.items()}
    return {"critical path": max(longest.values()), "path from s = 0": leaf_dist[id(leaves[0])],
            "path from s = L−1": leaf_dist[id(leaves[-1])], "ops": len(order)}


def time_layers(lengths: list[int], threads: int, budget: float) -> dict:
    """Median ms of forward + backward per layer and length at ``threads`` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = {}
        for name, kind in LAYERS.items():
            stage(f"parallel: timing {name} at {threads} thread(s)")
            torch.manual_seed(0)
            mod, call = build(kind)
            for n in lengths:
                x = torch.randn(1, n, DIM, requires_grad=True)

                def step():
                    mod.zero_grad(set_to_none=True)
                    call(mod, x).sum().backward()
                out[name, n] = median_ms(step, budget_s=budget, max_repeat=5)
        return out
    finally:
        torch.set_num_threads(before)


def run(out_dir: Union[str, Path], *, seed: int = 0, quick: bool = False) -> dict:
    """Count dependent steps and path lengths; time both layers at 1 and all threads; the report."""
    out = check_run_args(out_dir, seed, quick)
    torch.manual_seed(seed)
    graph_lens = [4, 8, 16] if quick else [8, 16, 32, 64, 128]
    lengths = [32, 64, 128] if quick else [64, 128, 256, 512, 1024, 2048]
    budget = 0.03 if quick else 0.3
    counts = {(name, n): graph_paths(name, n) for name in LAYERS for n in graph_lens}
    graph_rows = [{"L": n, **{f"{name} {k}": counts[name, n][k] for name in LAYERS
                              for k in ("critical path", "path from s = 0", "path from s = L−1")}}
                  for n in graph_lens]
    slope = {name: power_fit(graph_lens, [counts[name, n]["critical path"] for n in graph_lens])[0]
             for name in LAYERS}
    per_step = {name: (counts[name, graph_lens[-1]]["critical path"] - counts[name, graph_lens[0]]["critical path"])
                / (graph_lens[-1] - graph_lens[0]) for name in LAYERS}

    n_threads = torch.get_num_threads()
    thread_counts = sorted({1, n_threads})
    load = [os.getloadavg()[0]]
    times = {t: time_layers(lengths, t, budget) for t in thread_counts}
    load.append(os.getloadavg()[0])
    time_rows = []
    for n in lengths:
        row = {"L": n}
        for t in thread_counts:
            row.update({f"{name} ms, {t} thr": times[t][name, n] for name in LAYERS})
        for name in LAYERS:
            row[f"{name} speed-up"] = times[1][name, n] / times[n_threads][name, n]
        time_rows.append(row)
    cross = {t: crossover(lengths, [times[t]["GRU", n] for n in lengths], [times[t]["attention", n] for n in lengths])
             for t in thread_counts}
    machine = {"cpu capability": torch.backends.cpu.get_cpu_capability(), "cpu count": os.cpu_count(),
               "torch threads": n_threads, "load average (1 min) before / after": [round(v, 2) for v in load]}

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.3))
    for i, name in enumerate(LAYERS):  # one colour per layer in every panel
        axes[0].plot(graph_lens, [counts[name, n]["critical path"] for n in graph_lens], "o-", color=f"C{i}",
                     label=f"{name}: critical path")
        axes[0].plot(graph_lens, [counts[name, n]["path from s = 0"] for n in graph_lens], "s--", color=f"C{i}",
                     label=f"{name}: path x_0 → y_L−1")
        for t, style in zip(thread_counts, ("o:", "o-")):
            axes[1].loglog(lengths, [times[t][name, n] for n in lengths], style, color=f"C{i}",
                           label=f"{name}, {t} thread(s)")
        axes[2].semilogx(lengths, [r[f"{name} speed-up"] for r in time_rows], "o-", color=f"C{i}", label=name)
    axes[0].set_xlabel("sequence length L")
    axes[0].set_ylabel("operations (autograd graph)")
    axes[0].set_title("dependent steps and path length")
    axes[0].legend(fontsize=8)
    axes[1].set_xlabel("sequence length L")
    axes[1].set_ylabel("forward + backward, ms")
    axes[1].set_title(f"time ({machine['cpu capability']}, {os.cpu_count()} CPUs)")
    axes[1].legend(fontsize=8)
    axes[2].axhline(1, color="k", lw=0.8)
    axes[2].set_xlabel("sequence length L")
    axes[2].set_ylabel(f"time at 1 thread / at {n_threads}")
    axes[2].set_title("what the extra threads give each layer")
    axes[2].legend(fontsize=8)
    for ax in axes[1:]:
        ax.set_xscale("log", base=2)

    g0, g1, last = graph_lens[0], graph_lens[-1], time_rows[-1]
    c = lambda name, n, k="critical path": counts[name, n][k]  # noqa: E731
    findings = [
        f"Dependent steps: the GRU's longest chain of operations grows from {c('GRU', g0)} at L = {g0} to "
        f"{c('GRU', g1)} at L = {g1} ({per_step['GRU']:.1f} more per position, growth ∝ L^{slope['GRU']:.2f}): "
        f"every step waits for the one before. Attention's is {c('attention', g0)} at L = {g0} and "
        f"{c('attention', g1)} at L = {g1}: the same at every length, one step for the whole layer.",
        f"Path length at L = {g1}: from x_0 to y_{g1 - 1}, {c('GRU', g1, 'path from s = 0')} operations through the "
        f"GRU vs {c('GRU', g1, 'path from s = L−1')} from x_{g1 - 1}; through attention "
        f"{c('attention', g1, 'path from s = 0')} and {c('attention', g1, 'path from s = L−1')}: every pair of "
        "positions is one step apart, as near as neighbours.",
    ]
    if n_threads > 1:
        sp = {name: [r[f"{name} speed-up"] for r in time_rows] for name in LAYERS}
        findings.append(
            f"Threads ({n_threads} vs 1), forward + backward at L = {last['L']}: attention "
            f"{last[f'attention ms, 1 thr']:.0f} → {last[f'attention ms, {n_threads} thr']:.0f} ms (×"
            f"{last['attention speed-up']:.2f}), GRU {last['GRU ms, 1 thr']:.0f} → "
            f"{last[f'GRU ms, {n_threads} thr']:.0f} ms (×{last['GRU speed-up']:.2f}); across lengths attention "
            f"×{min(sp['attention']):.2f}–{max(sp['attention']):.2f}, "
            f"GRU ×{min(sp['GRU']):.2f}–{max(sp['GRU']):.2f}. "
            + (f"Attention gains more from the extra threads than the GRU at L = {last['L']}: its one large step "
               "splits across cores and pays the threads' synchronisation once, while the GRU's steps are too "
               f"small to split and each of its {last['L']} steps pays it."
               if last["attention speed-up"] > last["GRU speed-up"] else
               f"Here the extra threads did not help attention more than the GRU at L = {last['L']}.")
            + ("" if max(max(v) for v in sp.values()) >= 0.75 * n_threads or max(load) <= (os.cpu_count() or 1)
               else f" Neither comes near ×{n_threads}" + (", and more threads even slowed both" if
                                                             max(max(v) for v in sp.values()) < 1 else "")
               + ": the cores were busy with other work (load below), so a thread often waited for one."))
    else:
        findings.append("torch uses one thread on this machine: no speed-up from threads can be measured here.")
    findings.append(
        "Where the GRU becomes faster than attention (forward + backward): "
        + "; ".join(f"{t} thread(s): {'none' if cross[t][0] is None else '≈ L ' + fmt(round(cross[t][0]))} "
                    f"({cross[t][1]})" for t in thread_counts)
        + f". Machine: {machine['cpu capability']}, {machine['cpu count']} CPUs, torch threads {n_threads}, "
        f"load average {load[0]:.1f} before and {load[1]:.1f} after timing"
        + (" — higher than the CPU count: other work shared the cores, so the times are noisy." if
           max(load) > (os.cpu_count() or 1) else "."))
    findings.append("Not measured here (this run times only this CPU): on a GPU, thousands of lanes can take "
                    "attention's one step at once, while the GRU's L steps stay L launches one after another.")
    time_cols = ["L"] + [f"{name} ms, {t} thr" for t in thread_counts for name in LAYERS] + \
        [f"{name} speed-up" for name in LAYERS]
    return finish(out, "parallel", title="Attention vs recurrence: dependent steps, path length, threads",
                  intro=__doc__.split("\n\n", 1)[1].strip(),
                  tables=[("Operations in the autograd graph of one forward pass (exact)", graph_rows,
                           list(graph_rows[0])),
                          (f"Forward + backward, median ms (E = {DIM}, batch 1, float32)", time_rows, time_cols),
                          ("Machine", [machine], list(machine))],
                  findings=findings, fig=fig,
                  results={"seed": seed, "quick": quick, "graph": graph_rows, "ops_per_position": per_step,
                           "times": time_rows, "crossover": {str(t): list(v) for t, v in cross.items()},
                           "machine": machine})
