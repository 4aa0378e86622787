"""Helpers shared by the benchmark scripts: the common flags, timing, tables and JSON.

Timings are wall-clock medians in milliseconds. When two implementations are compared,
:func:`compare` runs them round-robin (one call of each per round, starting with a different one
each round), so thermal or background drift hits every peer equally.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def parser(description: str, out: str) -> argparse.ArgumentParser:
    """The flags every benchmark takes: ``--quick``, ``--threads`` (default 2), ``--out``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (a smoke run)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--out", default=str(RESULTS / out), help="where to write the JSON results")
    return p


def setup(args: argparse.Namespace) -> None:
    """Threads and seed; then one header line saying where this runs (see :func:`machine`)."""
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"machine: {machine_line()}", flush=True)


def machine() -> dict:
    """attnlab's capability probe, measured (ISA, native bf16, AMX, threads, matmul GFLOP/s, copy GB/s)
    and the dtype ``auto`` picks here: two numbers from different machines are never compared by mistake."""
    from attnlab._runtime import probe, resolve_dtype

    dtype, reason = resolve_dtype("auto")
    return {**probe(measure=True).as_dict(), "auto_dtype": dtype, "auto_dtype_reason": reason,
            "env": {k: v for k, v in os.environ.items() if k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                                                 "OMP_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_", "ATTNLAB_KEEP_MALLOC")}}


def machine_line() -> str:
    from attnlab._runtime import probe, resolve_dtype

    return f"{probe(measure=True).line()} | auto dtype: {'%s (%s)' % resolve_dtype('auto')}"


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _once(fn: Callable[[], object]) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return (time.perf_counter() - t0) * 1e3


def time_fn(fn: Callable[[], object], *, warmup: int = 3, repeat: int = 10) -> float:
    """Median wall time of ``fn()`` in ms, after ``warmup`` untimed calls."""
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    for _ in range(warmup):
        fn()
    return statistics.median(_once(fn) for _ in range(repeat))


def compare(fns: dict[str, Callable[[], object]], *, repeat: int = 10, warmup: int = 2) -> dict[str, float]:
    """Median ms of each function, timed round-robin ``repeat`` times (interleaved, rotated)."""
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeat):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(_once(fns[name]))
    return {name: statistics.median(t) for name, t in times.items()}


def auto_repeat(fn: Callable[[], object], *, budget_s: float, lo: int = 5, hi: int = 101) -> int:
    """How many timed runs of ``fn`` fit in ``budget_s`` seconds (one probe call), within [lo, hi]:
    short cases get many repeats, where scheduler noise would otherwise dominate the median."""
    fn()
    return max(lo, min(hi, round(budget_s * 1e3 / max(_once(fn), 1e-3))))


def peak_rss_rise_mib(setup_code: str, stmt: str, *, threads: int = 2, attempts: int = 3) -> float:
    """Rise of the peak resident memory (MiB) while ``stmt`` runs, after ``setup_code``, in a
    fresh Python process. A reading <= 0 means the rise was hidden (the allocator reused pages freed
    during setup, which RSS already counted; RSS moves by a few hundred KiB meanwhile): it is measured
    again, in up to ``attempts`` processes, and a last negative reading counts as 0.

    On Linux the high-water mark ``VmHWM`` is reset to the current RSS just before ``stmt``
    (``echo 5 > /proc/self/clear_refs``) and read after it, so neither a peak reached in
    ``setup_code`` nor the parent's RSS (which ``getrusage``'s max RSS inherits across
    fork + exec) hides the rise. Elsewhere: the rise of ``getrusage`` max RSS.
    """
    code = (
        "import resource, torch\n"
        f"torch.set_num_threads({threads})\n"
        f"{setup_code}\n"
        "def _kib(field):\n"
        "    with open('/proc/self/status') as f:\n"
        "        return next(int(l.split()[1]) for l in f if l.startswith(field + ':'))\n"
        "try:\n"
        "    with open('/proc/self/clear_refs', 'w') as f:\n"
        "        f.write('5')\n"
        "    _peak = lambda: _kib('VmHWM')\n"
        "    before = _kib('VmRSS')\n"
        "except OSError:\n"
        "    _peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "    before = _peak()\n"
        f"{stmt}\n"
        "print(_peak() - before)\n"
    )
    for _ in range(attempts):
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
        rise_kib = int(out.split()[-1])  # KiB on Linux
        if rise_kib > 0:
            break
    return max(rise_kib, 0) / 1024


def environment() -> dict:
    return {
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "processor": platform.processor(), "threads": torch.get_num_threads(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "capability": machine(),
    }


def write_json(path: str | Path, rows: list[dict], **meta) -> None:
    """``{"environment": ..., **meta, "rows": rows}`` to ``path`` (folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"environment": environment(), **meta, "rows": rows}, indent=2) + "\n")


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"
    return str(x)


def print_table(rows: list[dict], columns: list[str]) -> None:
    """A plain aligned text table of ``rows`` (dicts) restricted to ``columns``."""
    cells = [[_fmt(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))
