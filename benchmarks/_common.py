"""Helpers shared by the benchmark scripts: the common flags, timing, tables and JSON.

Timings are wall-clock medians in milliseconds. When two implementations are compared,
:func:`compare` runs them round-robin (one call of each per round, starting with a different one
each round), so thermal or background drift hits every peer equally.

Each run writes two files through :func:`write_json`: its full detail (``--out``, by default under
``results/runs/``, not tracked) and its summary into ``results/<cpu class>.json`` (tracked, one file per
CPU class, one entry per benchmark, replaced by the next run of that benchmark on that class), from which
``_report.py`` generates ``docs/performance.md``.
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
    p.add_argument("--out", default=str(RESULTS / "runs" / out), help="where to write the run's full JSON results")
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


def write_json(path: str | Path, rows: list[dict], *, results: list[dict] | None = None, **meta) -> None:
    """``{"environment": ..., **meta, "rows": rows}`` to ``path`` (folders created); for a full run written under
    ``results/`` (the default ``--out``; not ``--quick``), also its summary (``results``, else :func:`summarize` of
    ``rows``) into this CPU class's file (:func:`record`), under the benchmark named by ``path``'s stem."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"environment": environment(), **meta, "rows": rows}, indent=2, default=str) + "\n")
    if not meta.get("quick") and path.resolve().is_relative_to(RESULTS):
        record(path.stem, summarize(rows) if results is None else results)


# ---- the per-CPU-class summaries that docs/performance.md is generated from ----------------------------------

def result(case: str, ours, peer, *, unit: str, target: str = "", met: bool | None = None,
           ratio: float | None | str = "ours/peer") -> dict:
    """One summary row: ``ours`` and ``peer`` in ``unit``, ``ratio`` = ours / peer unless given (None: no ratio),
    the target in words and whether it was met (None: no target)."""
    if ratio == "ours/peer":
        numbers = isinstance(ours, (int, float)) and isinstance(peer, (int, float)) and peer
        ratio = ours / peer if numbers else None
    return {"case": case, "ours": ours, "peer": peer, "unit": unit, "ratio": ratio, "target": target, "met": met}


def _met(value) -> bool | None:
    return {"yes": True, "no": False, True: True, False: False}.get(value) if isinstance(value, (str, bool)) else None


def summarize(rows: list[dict]) -> list[dict]:
    """The summary of a benchmark's rows by their column names: rows with a ``ratio`` or a ``met``; the case from
    ``case`` / ``scenario`` / ``run`` / ``preset`` / ``dtype`` / ``N``; ours and the peer from the first
    ``ours_*`` and ``peer_*`` / ``theirs_*`` column (the suffix is the unit)."""
    out = []
    for row in rows:
        if row.get("ratio") is None and _met(row.get("met")) is None:
            continue
        case = " ".join(str(row[k]) for k in ("case", "scenario", "run", "preset", "dtype", "N") if row.get(k) not in
                        (None, ""))
        ours = next((k for k in row if k.startswith("ours_")), None)
        peer = next((k for k in row if k.startswith(("peer_", "theirs_"))), None)
        target = row.get("target", row.get("targets", ""))
        out.append(result(case, row.get(ours) if ours else None, row.get(peer) if peer else None,
                          unit=ours.split("_", 1)[1] if ours else "", target="" if target in ("-", None) else str(target),
                          met=_met(row.get("met")), ratio=row.get("ratio")))
    return out


def _cpuinfo() -> dict[str, str]:
    """The first processor's ``/proc/cpuinfo`` fields (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def cpu_class(info: dict[str, str] | None = None) -> str:
    """The class of CPU whose numbers are comparable: vendor, microarchitecture and widest vector ISA, e.g.
    ``"AMD Zen 3 AVX2"``, ``"Intel Xeon AVX-512 AMX"`` (from ``/proc/cpuinfo``; the hardware's, not an
    ``ATEN_CPU_CAPABILITY`` override, which :func:`machine_record`'s ``isa`` shows)."""
    info = _cpuinfo() if info is None else info
    flags = set(info.get("flags", "").split())
    vendor, name = info.get("vendor_id", ""), info.get("model name", platform.processor() or platform.machine())
    family, model = int(info.get("cpu family", "0") or 0), int(info.get("model", "0") or 0)
    if vendor == "AuthenticAMD":
        arch = {23: "Zen 2" if model >= 0x30 else "Zen", 26: "Zen 5"}.get(family)
        if family == 25:  # Zen 3 and Zen 4 share the family; Zen 4's models are 0x10-0x1f and 0x60-0xaf
            arch = "Zen 4" if 0x10 <= model <= 0x1F or 0x60 <= model <= 0xAF else "Zen 3"
        head = f"AMD {arch or f'family {family}'}"
    elif vendor == "GenuineIntel":
        head = "Intel Xeon" if "Xeon" in name else "Intel"
    else:
        head = name
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    return " ".join(x for x in (head, isa, "AMX" if "amx_tile" in flags else "") if x)


def machine_record(info: dict[str, str] | None = None) -> dict:
    """The machine a summary was measured on: CPU model, vendor, family/model, the ISA torch's kernels use, native
    bf16, AMX and VNNI, threads and torch's version."""
    import torch.backends.cpu

    from attnlab._runtime import probe

    info = _cpuinfo() if info is None else info
    flags, cap = set(info.get("flags", "").split()), probe()
    return {"cpu": cap.cpu, "vendor": info.get("vendor_id", ""), "family": info.get("cpu family", ""),
            "model": info.get("model", ""), "isa": torch.backends.cpu.get_cpu_capability(),
            "bf16_native": cap.bf16_native, "amx": cap.amx, "vnni": bool({"avx512_vnni", "avx_vnni"} & flags),
            "threads": torch.get_num_threads(), "torch": torch.__version__}


def class_file(cls: str) -> Path:
    """``results/<cpu class as a file name>.json``: ``"AMD Zen 3 AVX2"`` -> ``results/amd-zen-3-avx2.json``."""
    return RESULTS / ("-".join("".join(c if c.isalnum() else " " for c in cls.lower()).split()) + ".json")


def record(benchmark: str, results: list[dict], *, cls: str | None = None, machine: dict | None = None) -> Path:
    """Put ``results`` under ``benchmark`` in the CPU class's file (created, or that one entry replaced; the
    others kept), with the machine they were measured on. A run whose ISA is not the hardware's widest (an
    ``ATEN_CPU_CAPABILITY`` override) is its own entry, ``"<benchmark> as <isa>"``. Returns the file."""
    cls = cpu_class() if cls is None else cls
    machine = machine_record() if machine is None else machine
    hardware_isa = "avx512" if "AVX-512" in cls else "avx2" if "AVX2" in cls else None
    if hardware_isa and not str(machine.get("isa", "")).lower().startswith(hardware_isa):
        benchmark = f"{benchmark} as {machine['isa']}"
    path = class_file(cls)
    data = json.loads(path.read_text()) if path.is_file() else {"cpu_class": cls, "benchmarks": {}}
    if data.get("cpu_class") != cls:
        raise ValueError(f"{path} holds cpu_class {data.get('cpu_class')!r}, not {cls!r}")
    data["benchmarks"][benchmark] = {"machine": machine, "results": results}
    data["benchmarks"] = dict(sorted(data["benchmarks"].items()))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return path


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
