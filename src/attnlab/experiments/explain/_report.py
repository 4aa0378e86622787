"""What every explain experiment shares: tables, the three output files, timing, a training loop."""
from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import matplotlib.pyplot as plt  # no matplotlib.use(): a notebook keeps its backend (the CLI picks Agg)
import torch
from torch import Tensor, nn

from attnlab._checks import boolean, integer
from attnlab._io import atomic_write

__all__ = ["plt", "fmt", "table", "finish", "median_ms", "train", "check_run_args", "stage", "SMOKE"]

# what a --quick run says in place of findings, unless its experiment's quick run reaches the full run's conclusion
SMOKE = ("Smoke run (--quick): its sizes and steps are too small to answer the question, so it draws no conclusion; "
         "the numbers above only show that the experiment runs. Run it without --quick for the answer.")


def stage(message: str) -> None:
    """One progress line on standard error (an experiment's stage), flushed at once."""
    import sys

    print(message, file=sys.stderr, flush=True)


def check_run_args(out_dir, seed, quick) -> Path:
    """Validate ``run``'s arguments; create and return ``out_dir``.

    Raises:
        TypeError: ``seed`` not an int or ``quick`` not a bool.
    """
    integer("seed", seed)
    boolean("quick", quick)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out


def fmt(x) -> str:
    """A number as a short string: 3 significant-ish digits, scientific when tiny or huge."""
    if isinstance(x, bool) or x is None:
        return str(x)
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if math.isnan(x) or math.isinf(x):
            return str(x)
        a = abs(x)
        if a != 0 and (a < 1e-3 or a >= 1e5):
            return f"{x:.2e}"
        return f"{x:.4f}" if a < 1 else f"{x:.3f}" if a < 100 else f"{x:.1f}"
    return str(x)


_MD_ESCAPES = str.maketrans({"\\": "\\\\", "|": "\\|", "\n": "<br>", "\r": ""})


def _md_cell(text: str) -> str:
    """``text`` as one markdown table cell: ``|`` and ``\\`` escaped, a line break written ``<br>`` (the row stays
    one line of the table)."""
    return text.translate(_MD_ESCAPES)


def table(rows: Sequence[dict], columns: Sequence[str]) -> tuple[str, str]:
    """``(plain, markdown)`` renderings of ``rows`` restricted to ``columns``."""
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    plain = ["  ".join(c.rjust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    plain += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in cells]
    md = ["| " + " | ".join(map(_md_cell, columns)) + " |", "|" + "|".join("---:" for _ in columns) + "|"]
    md += ["| " + " | ".join(map(_md_cell, r)) + " |" for r in cells]
    return "\n".join(plain), "\n".join(md)


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, Tensor):
        return x.tolist()
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    return x


def finish(out: Path, name: str, *, title: str, intro: str, tables: Iterable[tuple[str, Sequence[dict], Sequence[str]]],
           findings: Sequence[str], fig, results: dict) -> dict:
    """Print the tables and findings; write ``name.png`` (``fig``), ``name.md`` and ``name.json``
    atomically into ``out``; return ``results`` plus ``"files": {"plot", "report", "json"}``.

    A quick run (``results["quick"]``) prints and records :data:`SMOKE` in place of the findings, unless ``name`` is
    in :data:`~attnlab.experiments.explain.QUICK_CONCLUDES` (its quick run reaches the full run's conclusion)."""
    from attnlab.experiments.explain import QUICK_CONCLUDES

    if results.get("quick") and name not in QUICK_CONCLUDES:
        findings = [SMOKE]
    md = [f"# {title}", "", intro, ""]
    print(f"== {title} ==")
    for caption, rows, cols in tables:
        plain, markdown = table(rows, cols)
        print(f"\n{caption}\n{plain}")
        md += [f"**{caption}**", "", markdown, ""]
    print()
    md.append("## What the numbers show")
    md.append("")
    for f in findings:
        print(f"* {f}")
        md.append(f"- {f}")
    md += ["", f"![{name}]({name}.png)", ""]
    files = {"plot": str(out / f"{name}.png"), "report": str(out / f"{name}.md"), "json": str(out / f"{name}.json")}
    fig.tight_layout()
    atomic_write(Path(files["plot"]), lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    atomic_write(Path(files["report"]), lambda tmp: Path(tmp).write_text("\n".join(md), encoding="utf-8"))
    payload = _jsonable({"experiment": name, **results, "findings": list(findings)})
    atomic_write(Path(files["json"]),
                  lambda tmp: Path(tmp).write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8"))
    return {**results, "findings": list(findings), "files": files}


def median_ms(fn: Callable[[], object], *, budget_s: float = 0.5, max_repeat: int = 7) -> float:
    """Median wall time of ``fn()`` in ms: one warm-up call, then as many calls as fit in
    ``budget_s`` (at least 1, at most ``max_repeat``); a first call longer than ``budget_s`` is
    the measurement itself."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    if first >= budget_s:  # a long call: its first run is the measurement (warm-up overhead is small)
        return first * 1e3
    n = max(1, min(max_repeat, int(budget_s / max(first, 1e-6))))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def train(model: nn.Module, batch_fn: Callable[[torch.Generator], tuple], loss_fn: Callable, *, steps: int,
          lr: float, g: torch.Generator, warmup: int = 20, log_every: Optional[int] = None,
          label: str = "training") -> list[float]:
    """AdamW with linear warm-up and cosine decay; ``loss_fn(model, *batch_fn(g))`` per step, with a progress bar
    named ``label`` on standard error (a widget in a notebook with ipywidgets). Returns the loss every ``log_every`` steps
    (default: steps // 20)."""
    from attnlab._runtime import progress_bar as tqdm

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    every = log_every or max(1, steps // 20)
    curve = []
    model.train()
    for step in tqdm(range(steps), desc=label, unit="step", leave=False, mininterval=1.0):
        loss = loss_fn(model, *batch_fn(g))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % every == 0 or step == steps - 1:
            curve.append(loss.item())
    model.eval()
    return curve
