"""``attnlab env``: what this machine computes natively and the defaults that follow.

In the spirit of ``python -m torch.utils.collect_env``, for the questions attnlab's defaults depend on:
the instruction set torch's CPU kernels use, whether bf16 / fp16 run in hardware, AMX, threads, a short
measured figure (matmul GFLOP/s in fp32 and bf16, copy GB/s), and the precision ``dtype="auto"``
resolves to here. ``ATEN_CPU_CAPABILITY`` and ``ONEDNN_MAX_CPU_ISA`` change what it reports (and what
attnlab does), so an AVX-512 machine can be tried as an AVX2 one.
"""
from __future__ import annotations

import argparse
import json
import os
import platform

from attnlab import _choice, _native
from attnlab._runtime import probe, resolve_dtype


def report(*, measure: bool = True) -> dict:
    """The facts :func:`main` prints, as a dict."""
    import torch

    cap = probe(measure=measure)
    device = "cuda" if cap.cuda else "cpu"
    dtype, reason = resolve_dtype("auto", device)
    import attnlab

    return {
        "attnlab": attnlab.__version__, "python": platform.python_version(), "platform": platform.platform(),
        **cap.as_dict(), "mkldnn": torch.backends.mkldnn.is_available(),
        "overrides": {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS")
                      if k in os.environ},
        "auto_dtype": dtype, "auto_dtype_reason": reason, "auto_device": device, "native_kernels": _native.status(),
        "kernel_choices": {"forced": {f: _choice.forced(f) for f in _choice.FAMILIES}, "probe": _choice.probing(),
                           "cache": str(_choice.cache_path()), "table": _choice.table()},
    }


def _yes(v: bool) -> str:
    return "yes" if v else "no"


EPILOG = """examples:
  attnlab env                       # ISA, native bf16, AMX, threads, measured GFLOP/s, what dtype=auto picks
  attnlab env --json
  ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 attnlab env    # behave as an AVX2-only CPU
  attnlab env --reprobe --no-measure   # forget this machine's kernel choices and measure them again"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``attnlab env`` (the common flags are added by :mod:`attnlab.cli`)."""
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-measure", action="store_true", help="skip the ~1 s measurement (GFLOP/s, GB/s)")
    p.add_argument("--reprobe", action="store_true",
                   help="clear the kernel-choice cache of this machine and torch, and measure its classes again")


def reprobe() -> dict:
    """Clear the kernel-choice cache of this machine and torch (:func:`attnlab._choice.clear_cache`) and probe each
    class it held again, as the layers that use it probe it (a float linear layer through
    :func:`attnlab.nn.inference.probe_linears`, an int8 one through :func:`attnlab.adapt.quantize.quantize`), on a
    weight of the recorded shape. Returns ``{"forgotten": [[family, dtype, [in, out]], ...], "measured": [...]}``;
    a class that is not measured again (the C++ kernels not built, the process's probe budget spent) keeps its
    default until a model of that shape probes it.

    Raises:
        ValueError: ``ATTNLAB_PROBE=0`` (the probe and the cache are off) or the family's candidate forced.
    """
    import torch
    from torch import nn

    from attnlab.adapt.quantize import quantize
    from attnlab.nn.inference import probe_linears

    if not _choice.probing():
        raise ValueError("--reprobe: ATTNLAB_PROBE=0 turns the kernel-choice probe and its cache off; "
                         "set ATTNLAB_PROBE=1 (the default) to measure again")
    if _choice.forced("decode_linear") is not None:
        raise ValueError("--reprobe: decode_linear's candidate is forced (ATTNLAB_FORCE_DECODE_LINEAR or "
                         "ATTNLAB_KERNELS), so nothing is probed; unset it to measure again")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    forgotten = _choice.clear_cache()
    for family, dtype, (n_in, n_out) in forgotten:
        with torch.random.fork_rng():  # a weight of the shape; the user's random stream untouched
            torch.manual_seed(0)
            layer = nn.Linear(n_in, n_out)
        if dtype in dtypes:
            probe_linears(layer, dtype=dtypes[dtype], rows=1)
        elif dtype in ("int8", "int8-weight"):
            quantize(nn.Sequential(layer), dtype, inplace=True)
    measured = [[e["family"], e["dtype"], e["shape"]] for e in _choice.table() if e["source"] == "probed"]
    return {"forgotten": [list(f) for f in forgotten], "measured": measured}


def main(args: argparse.Namespace) -> int:
    again = reprobe() if args.reprobe else None
    r = report(measure=not args.no_measure)
    if again is not None:
        r["kernel_choices"]["reprobed"] = again
    if again is not None and not args.json:
        print(f"kernel choices: forgot {len(again['forgotten'])} class(es) of {r['kernel_choices']['cache']}, "
              f"measured {len(again['measured'])} again")
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    rows = [
        ("attnlab", r["attnlab"]), ("torch", r["torch_version"]), ("python", r["python"]),
        ("platform", r["platform"]), ("CPU", f"{r['cpu']} ({r['cores']} cores)"),
        ("instruction set (torch)", r["isa"]), ("native bf16", _yes(r["bf16_native"])),
        ("native fp16", _yes(r["fp16_native"])), ("AMX", _yes(r["amx"])), ("oneDNN", _yes(r["mkldnn"])),
        ("threads", str(r["threads"])), ("CUDA", r["cuda"] or "no"),
    ]
    if r["fp32_gflops"] is not None:
        rows += [("matmul 512² fp32", f"{r['fp32_gflops']:.0f} GFLOP/s"),
                 ("matmul 512² bf16", f"{r['bf16_gflops']:.0f} GFLOP/s"),
                 ("copy (read + write)", f"{r['copy_gbps']:.1f} GB/s")]
    for k, v in r["overrides"].items():
        rows.append((f"override {k}", v))
    rows.append(("dtype=auto", f"{r['auto_dtype']} ({r['auto_dtype_reason']})"))
    rows.append(("attnlab C++ kernels", r["native_kernels"]))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    for line in choice_lines(r["kernel_choices"]):
        print(line)
    return 0


def choice_lines(choices: dict) -> list[str]:
    """The table of kernel choices (:mod:`attnlab._choice`): what each family forces, then one line per probed or
    cached shape class: the candidate chosen at each row count and each candidate's median milliseconds."""
    lines = [f"kernel choices (probe {'on' if choices['probe'] else 'off: ATTNLAB_PROBE=0'}; cache {choices['cache']})"]
    for family, cand in choices["forced"].items():
        if cand is not None:
            lines.append(f"  {family}: {cand}, forced")
    if not choices["table"]:
        lines.append("  none probed yet (optimize_for_inference, quantize and a plain model's first generate probe its "
                     "shapes)")
    for e in choices["table"]:
        rows = e["rows"]
        if "crossover" in e:  # decode_linear: a candidate per row count
            chosen = " ".join(f"{r}:{'own' if r <= e['crossover'] else 'aten'}" for r in rows)
        else:  # one candidate for every row count probed
            chosen = " ".join(f"{r}:{e['choice']}" for r in rows)
        times = "; ".join(f"{c} " + " ".join("-" if t is None else f"{t:.3f}" for t in ms) for c, ms in e["ms"].items())
        inexact = f"; inexact: {', '.join(e['inexact'])}" if e["inexact"] else ""
        source = e["source"] if _choice.whole(e) else "probe cut short, the default runs"
        lines.append(f"  {e['family']} {e['dtype']} {e['class']} ({e['shape'][0]}x{e['shape'][1]}), {source}: "
                     f"rows {chosen}; ms {times}{inexact}")
    return lines
