"""Which kernel computes a hot operation on this machine: each family's candidates, timed by a short probe on the
model's own shapes, the fastest exact one chosen, the choice cached per machine.

A *family* is one operation at one regime; its *candidates* compute the same product with different kernels.
:data:`FAMILIES` lists them:

- ``decode_linear``: a linear layer's product at 1..:data:`DECODE_ROWS` rows (a decoding step's batch), with a
  float32, bfloat16 or int8 weight. ``own``: attnlab's matrix–vector kernel (:func:`attnlab._native.matvec`);
  ``aten``: what the layer runs otherwise (oneDNN's inner product on a packed weight or ``F.linear``; fbgemm's
  int8 product or ``aten._weight_int8pack_mm``). The choice is a *crossover*: the number of rows up to which
  ``own`` runs, ``aten`` past it.
- ``batch_linear``: the product at more rows (a prompt's prefill, a batch of sequences) of a float32 or bfloat16
  layer whose weight is kept plain for ``own``'s matvec. ``onednn``: oneDNN's inner product on the plain weight
  (reordered per call); ``aten``: ``F.linear`` (MKL's GEMM, or oneDNN's matmul as ATen picks: AMX where the CPU has
  it). The choice is one candidate per class, probed at :data:`BATCH_ROWS`: the exact one of least total time.
- ``int8_linear``: an ``"int8"`` layer's (:class:`attnlab.adapt.quant_formats.Int8Linear`) product past ``own``'s
  rows (a prompt, a batch), each row of ``x`` rounded to int8 on a scale of its own. ``fbgemm``: fbgemm's dynamic
  int8 product; ``int_mm``: ``torch._int_mm`` (oneDNN's int8 × int8 → int32; offered only where its sums are exact:
  a CPU with VNNI that oneDNN may use, :func:`attnlab.adapt.quant_formats.int_mm_exact`), rescaled per row and
  column. Chosen as ``batch_linear``'s, at :data:`BATCH_ROWS`.

How a choice is made, first match wins:

1. forced: ``ATTNLAB_FORCE_<FAMILY>=<candidate>`` (``ATTNLAB_FORCE_DECODE_LINEAR=aten``) or
   ``ATTNLAB_KERNELS="<family>=<candidate>,..."``; an unknown family or candidate, or the two settings disagreeing,
   is a ValueError that names the setting and the valid values. The tests force each candidate.
2. probed in this process, or read from the cache (a JSON file under the user cache dir, keyed by the CPU's model
   and flags, torch's version, attnlab's and the thread count; written atomically; a corrupt or foreign file is
   ignored);
3. the default: the built-in crossover (deterministic; also wherever ``ATTNLAB_PROBE=0``, which turns off the probe
   and the cache: the test suite sets it).

The probe (:func:`probe_decode`; :func:`probe_batch` alike) runs where a model is prepared for inference
(``optimize_for_inference``, ``quantize``, the first ``generate`` of a plain model), once per *shape class* (the weight's dtype and its ``(in, out)`` each rounded up to a power of two:
GPT-2 has four), on the first layer of that class: for each of :data:`PROBE_ROWS` rows it checks every candidate
against the float formula in float64 within the dtype's tolerance (:func:`tolerance`; an inexact candidate is never
chosen), then times each (a warm-up, then the fastest of :data:`ROUNDS` medians of a few calls, alternating, with
:data:`CONFIRM` more rounds where ``own`` lost), within :data:`PROBE_SECONDS` per
class and :data:`PROBE_BUDGET` per process (a probe cut short by them keeps the class's default: :func:`whole`).
:func:`table` lists the choices for ``attnlab env``.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import Tensor

from attnlab._io import atomic_write_text
from attnlab._runtime import _cpu_flags, _cpu_name

log = logging.getLogger(__name__)

FAMILIES = {"decode_linear": ("own", "aten"), "batch_linear": ("onednn", "aten"),
            "int8_linear": ("fbgemm", "int_mm")}
# the candidate a one-choice family (batch_linear, int8_linear) runs where none of its candidates is exact
FALLBACK = {"batch_linear": "aten", "int8_linear": "fbgemm"}
DECODE_ROWS = 8  # the decode_linear family's largest batch: forcing ``own`` runs it up to this many rows
PROBE_ROWS = (1, 2, 4, 6, 8)
BATCH_ROWS = (16, 64)  # the batch_linear and int8_linear families' probed row counts: a batch, a prompt
BATCH_MACS = 1 << 28  # a class whose product at max(BATCH_ROWS) rows takes more multiply–adds keeps its default
PROBE_CALLS = 5  # timed calls per candidate and row count (their median), after one warm-up
ROUNDS = 2  # rounds of PROBE_CALLS per candidate and row count, alternating; each keeps its fastest median
CONFIRM = 2  # more rounds where ``own`` lost after ROUNDS (a burst of load on one side), until it wins or they end
PROBE_SECONDS = 0.4  # one shape class's probe stops measuring more row counts past this
PROBE_BUDGET = 1.6  # all probes of a process together: past it, unprobed classes keep their default
# ``own`` keeps a row count unless ``aten`` is faster by more than this factor: it also lets a decoder layer's step
# run as one call (attnlab.nn.layer_native.decoder_step, every product ``own``), which one product's timing misses
OWN_MARGIN = 1.1
CHECK_OUTPUTS = 4096  # the probe checks a candidate's first outputs this many against the float formula
_table: dict[str, dict] = {}  # "family/dtype/class" -> entry (see probe_decode), this process's and the cache's
_spent: list = [0.0]  # seconds the probes of this process took
_loaded: list = []  # [True] once the cache was read


def _setting(family: str) -> Optional[str]:
    """The candidate forced for ``family`` by the environment, or None."""
    found = {}
    one = os.environ.get(f"ATTNLAB_FORCE_{family.upper()}")
    if one:
        found[f"ATTNLAB_FORCE_{family.upper()}"] = one.strip()
    for item in filter(None, (s.strip() for s in os.environ.get("ATTNLAB_KERNELS", "").split(","))):
        name, sep, cand = (s.strip() for s in item.partition("="))
        if not sep or name not in FAMILIES:
            raise ValueError(f"ATTNLAB_KERNELS takes family=candidate pairs separated by commas, families "
                             f"{sorted(FAMILIES)}; got {item!r}")
        if name == family:
            found["ATTNLAB_KERNELS"] = cand
    for where, cand in found.items():
        if cand not in FAMILIES[family]:
            raise ValueError(f"{where}: {family}'s candidates are {list(FAMILIES[family])}, got {cand!r}")
    if len(set(found.values())) > 1:
        raise ValueError(f"ATTNLAB_FORCE_{family.upper()} and ATTNLAB_KERNELS force different candidates for "
                         f"{family}: {found}")
    return next(iter(found.values()), None)


def forced(family: str) -> Optional[str]:
    """The candidate the environment forces for ``family`` (:data:`FAMILIES`), or None.

    Raises:
        ValueError: an unknown family or candidate in the settings, or two settings that disagree.
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    return _setting(family)


def probing() -> bool:
    """Whether the probe and the cache are on (``ATTNLAB_PROBE``: ``1``, the default, or ``0``)."""
    value = os.environ.get("ATTNLAB_PROBE", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"ATTNLAB_PROBE must be 0 or 1, got {value!r}")
    return value == "1"


def shape_class(in_features: int, out_features: int) -> tuple[int, int]:
    """``(in, out)`` each rounded up to a power of two: the layers probed once together."""
    return 1 << max(0, in_features - 1).bit_length(), 1 << max(0, out_features - 1).bit_length()


def _key(family: str, dtype: str, in_features: int, out_features: int) -> str:
    i, o = shape_class(in_features, out_features)
    return f"{family}/{dtype}/{i}x{o}"


def machine_key() -> dict:
    """What a cached choice is valid for: the CPU's model and flags, torch's version, attnlab's, and the number of
    threads (the kernels split a product over them; MKL's GEMV does not)."""
    import attnlab

    flags = " ".join(sorted(_cpu_flags()))
    return {"cpu": _cpu_name(), "flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
            "torch": torch.__version__, "attnlab": attnlab.__version__, "threads": torch.get_num_threads()}


def cache_path() -> Path:
    """The cache file: ``$XDG_CACHE_HOME`` or ``~/.cache``, ``attnlab/choices-<digest of machine_key()>.json``."""
    digest = hashlib.sha256(json.dumps(machine_key(), sort_keys=True).encode()).hexdigest()[:16]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "attnlab" / f"choices-{digest}.json"


def _load_cache() -> None:
    if _loaded:
        return
    _loaded.append(True)
    path = cache_path()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        entries = data["choices"] if data.get("key") == machine_key() else {}
        good = {k: dict(e, source="cached") for k, e in entries.items() if _valid(k, e)}
    except FileNotFoundError:
        return
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:  # corrupt: probed again, then replaced
        log.info("attnlab: ignoring the kernel choice cache %s (%s)", path, e)
        return
    for k, e in good.items():
        _table.setdefault(k, e)


def _valid(key: str, e) -> bool:
    """Whether a cached entry has its family's fields (:func:`probe_decode`'s, :func:`probe_batch`'s), of their
    types, from a whole probe."""
    family = key.split("/")[0]
    if family not in FAMILIES or not isinstance(e, dict):
        return False
    rows = list(PROBE_ROWS if family == "decode_linear" else BATCH_ROWS)
    choice = (type(e.get("crossover")) is int and 0 <= e["crossover"] <= DECODE_ROWS if family == "decode_linear"
              else e.get("choice") in FAMILIES[family])
    return (choice and e.get("rows") == rows and isinstance(e.get("ms"), dict)
            and set(e["ms"]) == set(FAMILIES[family])
            and all(isinstance(t, list) and len(t) == len(rows) and all(isinstance(v, (int, float)) for v in t)
                    for t in e["ms"].values())
            and isinstance(e.get("shape"), list) and len(e["shape"]) == 2 and isinstance(e.get("inexact"), list))


def whole(entry: dict) -> bool:
    """Whether a probe measured every row count of its family (:data:`PROBE_ROWS`, :data:`BATCH_ROWS`): one cut
    short by :data:`PROBE_SECONDS` (a large weight, a busy machine) is listed but neither cached nor followed (the
    class keeps its default)."""
    return all(None not in t for t in entry["ms"].values())


def _save_cache() -> None:
    """Write this process's and the cache's entries, atomically (:func:`attnlab._io.atomic_write`)."""
    path = cache_path()
    entries = {k: {f: v for f, v in e.items() if f != "source"} for k, e in _table.items() if whole(e)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"key": machine_key(), "choices": entries}, indent=1, sort_keys=True))
    except OSError as e:  # a read-only home: the choice still holds for this process
        log.info("attnlab: could not write the kernel choice cache %s (%s)", path, e)


def clear_cache() -> list[tuple[str, str, list[int]]]:
    """Forget the choices of this machine and torch (:func:`cache_path`, keyed by :func:`machine_key`): delete the
    cache file and this process's table, and reset the process's probe budget, so that the next probe of each class
    measures again. Returns ``(family, dtype, shape)`` of each class forgotten (``shape``: the ``[in, out]`` of the
    weight it was probed on), sorted, for a caller that re-measures them (``attnlab env --reprobe``)."""
    _loaded.clear()
    _load_cache()  # the file's classes as well as this process's
    known = sorted({(*key.split("/")[:2], tuple(e["shape"])) for key, e in _table.items()})
    _table.clear()
    _spent[0] = 0.0
    cache_path().unlink(missing_ok=True)
    return [(family, dtype, list(shape)) for family, dtype, shape in known]


def decode_rows(dtype: str, in_features: int, out_features: int, default: int) -> tuple[int, str]:
    """``(rows, source)``: the number of rows up to which ``own`` computes a ``decode_linear`` product of this
    weight (0: never), and where that comes from: ``"forced"``, ``"probed"``, ``"cached"`` or ``"default"``
    (``default`` rows, the built-in crossover)."""
    cand = forced("decode_linear")
    if cand is not None:
        return (DECODE_ROWS if cand == "own" else 0), "forced"
    entry = _known("decode_linear", dtype, in_features, out_features)
    return (default, "default") if entry is None else (entry["crossover"], entry["source"])


def batch_kernel(dtype: str, in_features: int, out_features: int, default: str,
                 family: str = "batch_linear") -> tuple[str, str]:
    """``(candidate, source)``: the candidate of ``family`` (``batch_linear``: ``"onednn"`` or ``"aten"``;
    ``int8_linear``: ``"fbgemm"`` or ``"int_mm"``) for this weight's products at more rows than a decoding step's,
    and where it comes from (as :func:`decode_rows`; ``default``: the built-in choice)."""
    cand = forced(family)
    if cand is not None:
        return cand, "forced"
    entry = _known(family, dtype, in_features, out_features)
    return (default, "default") if entry is None else (entry["choice"], entry["source"])


def _known(family: str, dtype: str, in_features: int, out_features: int) -> Optional[dict]:
    """The whole probe of this weight's class, made in this process or cached; None where probing is off."""
    if not probing():
        return None
    _load_cache()
    entry = _table.get(_key(family, dtype, in_features, out_features))
    return entry if entry is not None and whole(entry) else None


def needs_probe(dtype: str, in_features: int, out_features: int, family: str = "decode_linear") -> bool:
    """Whether :func:`probe_decode` (``family="batch_linear"`` or ``"int8_linear"``: :func:`probe_batch`) would
    measure this weight's class: probing on, nothing forced, the class not known yet (for a one-choice family, its
    product at ``max(BATCH_ROWS)`` rows within :data:`BATCH_MACS`), the process's budget not spent."""
    if forced(family) is not None or not probing() or _spent[0] >= PROBE_BUDGET:
        return False
    if family in FALLBACK and max(BATCH_ROWS) * in_features * out_features > BATCH_MACS:
        return False
    _load_cache()
    return _key(family, dtype, in_features, out_features) not in _table


def tolerance(dtype: str, x: Tensor, weight: Tensor) -> Tensor:
    """The largest difference from the float formula ``x Wᵀ`` (float64, ``W`` as stored: rounded to bf16, or
    ``diag(s) Q``) that a ``decode_linear`` candidate may show, per output: float32 summation over K terms
    (``K · 2⁻²⁴ · |x| |W|ᵀ``), plus for bf16 the rounding of the input and the output (``2⁻⁷ · |x| |W|ᵀ``),
    plus for int8 (``int8``, ``int8-weight``) that of each input row to int8 levels of its own range (``max|x| / 127 · Σ|W|``)
    and bf16's (``int8-weight``'s compute dtype)."""
    x, w = x.double(), weight.double()
    mag = x.abs() @ w.abs().T
    rel = w.shape[1] * 2.0 ** -24 + (0.0 if dtype == "fp32" else 2.0 ** -7)
    tol = rel * mag
    if dtype.startswith("int8"):
        tol = tol + x.abs().amax(dim=-1, keepdim=True) / 127 * w.abs().sum(dim=1)
    return tol + torch.finfo(torch.float32).tiny


def _median_ms(fn: Callable, x: Tensor) -> float:
    times = []
    for _ in range(PROBE_CALLS):
        t0 = time.perf_counter()
        fn(x)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _measure_rows(dtype: str, weight: Tensor, bias: Optional[Tensor], candidates: dict[str, Callable],
                  rows_list: tuple, ms: dict, inexact: set, settled: Callable[[int], bool] = lambda i: True):
    """For each row count of ``rows_list`` (the ``i``-th, yielded once measured): every candidate checked on ``x``
    against the float formula within :func:`tolerance` (the inexact ones added to ``inexact``; the check is also the
    warm-up), then timed, alternating, so that a burst of load hits all: :data:`ROUNDS` rounds, then up to
    :data:`CONFIRM` more until ``settled(i)``, each keeping the fastest median in ``ms[candidate][i]``. Stops
    measuring more row counts past :data:`PROBE_SECONDS`."""
    in_features = weight.shape[1]
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    xs = torch.randn(max(rows_list), in_features, generator=gen)  # x of r rows: its first r
    w = weight[:CHECK_OUTPUTS]  # the outputs checked against the formula (all of them up to CHECK_OUTPUTS)
    want = xs.double() @ w.double().T + (0 if bias is None else bias[:CHECK_OUTPUTS].double())
    tol = tolerance(dtype, xs, w)
    for i, rows in enumerate(rows_list):
        x = xs[:rows]
        with torch.no_grad():
            for name, fn in candidates.items():
                got = fn(x)[:, :CHECK_OUTPUTS]
                if not ((got.double() - want[:rows]).abs() <= tol[:rows]).all():
                    inexact.add(name)
                fn(x)
            for r in range(ROUNDS + CONFIRM):
                if r >= ROUNDS and settled(i):
                    break
                for name, fn in candidates.items():
                    t = _median_ms(fn, x)
                    ms[name][i] = t if ms[name][i] is None else min(ms[name][i], t)
        yield i
        if time.perf_counter() - start > PROBE_SECONDS:
            break


def _record(family: str, dtype: str, weight: Tensor, start: float, fields: dict) -> dict:
    """The probe's entry (``shape``, ``fields``, ``seconds``, ``source``) recorded for the class: this process's
    table, its probe budget, and the cache where the probe is whole."""
    out_features, in_features = weight.shape
    seconds = time.perf_counter() - start
    _spent[0] += seconds
    entry = {"shape": [in_features, out_features], **fields, "seconds": round(seconds, 3), "source": "probed"}
    _table[_key(family, dtype, in_features, out_features)] = entry
    if probing() and whole(entry):
        _save_cache()
    return entry


def probe_decode(dtype: str, weight: Tensor, bias: Optional[Tensor], candidates: dict[str, Callable]) -> dict:
    """Measure the ``decode_linear`` candidates (``{"own": f, "aten": g}``, each ``x (rows, in) float32 -> (rows,
    out)``) on a weight of the class, record the choice for the class (this process and the cache) and return its
    entry: ``shape``, ``rows``, ``ms`` (per candidate, per row count; None where not measured), ``inexact`` (the
    candidates outside :func:`tolerance`, never chosen), ``crossover`` (the largest measured row count up to which
    ``own`` is exact and faster at every measured count, within :data:`OWN_MARGIN`; 0 where it is not at 1 row) and
    ``seconds``. Where ``own`` lost a row count, up to :data:`CONFIRM` more rounds confirm it.

    ``weight`` is the float formula's ``(out, in)`` weight (dequantised for int8), ``bias`` its bias or None.
    """
    start = time.perf_counter()
    ms: dict[str, list] = {c: [None] * len(PROBE_ROWS) for c in candidates}
    inexact: set[str] = set()
    crossover, own_wins = 0, True

    def own_faster(i: int) -> bool:
        return ms["own"][i] <= OWN_MARGIN * ms["aten"][i]
    for i in _measure_rows(dtype, weight, bias, candidates, PROBE_ROWS, ms, inexact, own_faster):
        faster = "own" not in inexact and ("aten" in inexact or own_faster(i))
        own_wins = own_wins and faster
        if own_wins:
            crossover = PROBE_ROWS[i]
    return _record("decode_linear", dtype, weight, start, {"rows": list(PROBE_ROWS), "ms": ms,
                                                           "inexact": sorted(inexact), "crossover": crossover})


def probe_batch(dtype: str, weight: Tensor, bias: Optional[Tensor], candidates: dict[str, Callable],
                family: str = "batch_linear") -> dict:
    """Measure a one-choice family's candidates (``batch_linear``: ``{"onednn": f, "aten": g}``; ``int8_linear``:
    ``{"fbgemm": f, "int_mm": g}``; each ``x (rows, in) float32 -> (rows, out)``) at :data:`BATCH_ROWS` on a
    weight of the class, record the choice for the class and return its entry: ``shape``, ``rows``, ``ms``,
    ``inexact`` (as :func:`probe_decode`'s), ``choice`` (the exact candidate of least total time over the row
    counts; :data:`FALLBACK` where none is exact) and ``seconds``."""
    start = time.perf_counter()
    ms: dict[str, list] = {c: [None] * len(BATCH_ROWS) for c in candidates}
    inexact: set[str] = set()
    for _ in _measure_rows(dtype, weight, bias, candidates, BATCH_ROWS, ms, inexact):
        pass
    exact = [c for c in candidates if c not in inexact and None not in ms[c]]
    choice = min(exact, key=lambda c: sum(ms[c])) if exact else FALLBACK[family]
    return _record(family, dtype, weight, start, {"rows": list(BATCH_ROWS), "ms": ms,
                                                  "inexact": sorted(inexact), "choice": choice})


def table() -> list[dict]:
    """The choices known to this process (probed, or read from the cache), for ``attnlab env``: one dict each with
    ``family``, ``dtype``, ``class``, ``shape``, ``ms``, ``rows``, ``inexact``, ``source`` and the family's choice:
    ``crossover`` (``decode_linear``) or ``choice`` (``batch_linear``, ``int8_linear``)."""
    if probing():
        _load_cache()
    out = []
    for key, e in sorted(_table.items()):
        family, dtype, cls = key.split("/")
        out.append({"family": family, "dtype": dtype, "class": cls, **e})
    return out
