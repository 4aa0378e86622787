"""The per-machine kernel choice (attnlab._choice): the force settings, the cache, the probe's exactness rule, and
each ``decode_linear`` candidate forced on every layer that has it, compared with the float formula. Nothing here
depends on a timing: the probe's crossover is asserted only where exactness alone decides it."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnlab import _choice, _native, _native_train
from attnlab._runtime import _cpu_name
from attnlab.adapt import quant_formats
from attnlab.adapt.quantize import Int8Linear, int_mm_exact, quantize
from attnlab.nn.inference import PackedLinear, native_rows

NATIVE = _native.available()
needs_native = pytest.mark.skipif(not NATIVE,
                                  reason="attnlab's native kernels are not built here (attnlab env says why)")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """No force setting, probing on, the cache in ``tmp_path``, an empty table; restored afterwards."""
    for name in ("ATTNLAB_KERNELS", *(f"ATTNLAB_FORCE_{f.upper()}" for f in _choice.FAMILIES)):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ATTNLAB_PROBE", "1")
    path = tmp_path / "attnlab" / "choices.json"
    monkeypatch.setattr(_choice, "cache_path", lambda: path)
    monkeypatch.setattr(_choice, "_table", {})
    monkeypatch.setattr(_choice, "_loaded", [])
    monkeypatch.setattr(_choice, "_spent", [0.0])
    return path


def test_force_settings(fresh, monkeypatch):
    assert _choice.forced("decode_linear") is None
    assert _choice.decode_rows("fp32", 768, 768, 5) == (5, "default")
    monkeypatch.setenv("ATTNLAB_FORCE_DECODE_LINEAR", "own")
    assert _choice.decode_rows("fp32", 768, 768, 5) == (_choice.DECODE_ROWS, "forced")
    monkeypatch.setenv("ATTNLAB_FORCE_DECODE_LINEAR", "aten")
    assert _choice.decode_rows("int8", 768, 768, 5) == (0, "forced")
    assert not _choice.needs_probe("fp32", 768, 768)  # forced: nothing to measure
    monkeypatch.delenv("ATTNLAB_FORCE_DECODE_LINEAR")
    monkeypatch.setenv("ATTNLAB_KERNELS", " decode_linear = own ")
    assert _choice.forced("decode_linear") == "own"


@pytest.mark.parametrize("env, match", [
    ({"ATTNLAB_FORCE_DECODE_LINEAR": "fast"},
     r"ATTNLAB_FORCE_DECODE_LINEAR: decode_linear's candidates are \['own', 'aten'\], got 'fast'"),
    ({"ATTNLAB_KERNELS": "decode_linear=blas"}, r"ATTNLAB_KERNELS: decode_linear's candidates"),
    ({"ATTNLAB_KERNELS": "matmul=own"},
     r"ATTNLAB_KERNELS takes family=candidate pairs .*\['batch_linear', 'decode_linear', 'int8_linear'\]; "
     r"got 'matmul=own'"),
    ({"ATTNLAB_KERNELS": "decode_linear"}, r"ATTNLAB_KERNELS takes family=candidate pairs"),
    ({"ATTNLAB_KERNELS": "decode_linear=own", "ATTNLAB_FORCE_DECODE_LINEAR": "aten"}, r"force different candidates"),
    ({"ATTNLAB_PROBE": "yes"}, r"ATTNLAB_PROBE must be 0 or 1, got 'yes'"),
])
def test_a_bad_setting_is_one_named_error(fresh, monkeypatch, env, match):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=match):
        _choice.decode_rows("fp32", 768, 768, 4)


def test_unknown_family():
    with pytest.raises(ValueError, match=r"family must be one of \['batch_linear', 'decode_linear', 'int8_linear'\], "
                                         r"got 'gemm'"):
        _choice.forced("gemm")


def test_shape_classes():
    """GPT-2's five linear shapes fall in four classes (QKV and the FFN's first product share one)."""
    shapes = [(768, 2304), (768, 768), (768, 3072), (3072, 768), (768, 50257)]
    assert [_choice.shape_class(i, o) for i, o in shapes] == [(1024, 4096), (1024, 1024), (1024, 4096),
                                                              (4096, 1024), (1024, 65536)]
    assert _choice.shape_class(1, 1) == (1, 1) and _choice.shape_class(1024, 1025) == (1024, 2048)


def _probe(fresh_weight, candidates, dtype="fp32"):
    w, b = fresh_weight
    return _choice.probe_decode(dtype, w, b, candidates)


@pytest.fixture
def weight():
    g = torch.Generator().manual_seed(1)
    return torch.randn(24, 40, generator=g), torch.randn(24, generator=g)


def test_an_inexact_candidate_is_never_chosen(fresh, weight):
    """``own`` off by more than the tolerance: ``aten`` at every row count, whatever the timings; then the
    reverse. The entry lands in the cache file, keyed by this machine."""
    w, b = weight
    exact = lambda x: F.linear(x, w, b)  # noqa: E731
    off = lambda x: F.linear(x, w, b) + 1e-2  # noqa: E731
    e = _probe(weight, {"own": off, "aten": exact})
    assert e["inexact"] == ["own"] and e["crossover"] == 0 and e["source"] == "probed"
    assert _choice.decode_rows("fp32", 40, 24, 4) == (0, "probed")
    e = _probe((torch.randn(24, 70), None), {"own": lambda x: x[:, :24].clone(), "aten": lambda x: x[:, :24] * 0})
    assert e["inexact"] == ["aten", "own"] and e["crossover"] == 0  # neither exact: never the kernel
    data = json.loads(fresh.read_text(encoding="utf-8"))
    assert data["key"] == _choice.machine_key() and set(data["choices"]) == {"decode_linear/fp32/64x32",
                                                                          "decode_linear/fp32/128x32"}


def test_the_own_candidate_exact_and_the_other_not_runs_to_the_last_row_count(fresh, weight):
    w, b = weight
    e = _probe(weight, {"own": lambda x: F.linear(x, w, b), "aten": lambda x: F.linear(x, w, b) * 1.01})
    assert e["inexact"] == ["aten"] and e["crossover"] == max(_choice.PROBE_ROWS)
    assert all(t is not None and t >= 0 for ms in e["ms"].values() for t in ms)


def test_the_cache_round_trip_and_a_corrupt_or_foreign_file(fresh, weight, monkeypatch):
    w, b = weight
    _probe(weight, {"own": lambda x: F.linear(x, w, b), "aten": lambda x: F.linear(x, w, b) * 1.01})
    monkeypatch.setattr(_choice, "_table", {})
    monkeypatch.setattr(_choice, "_loaded", [])
    assert _choice.decode_rows("fp32", 40, 24, 4) == (max(_choice.PROBE_ROWS), "cached")
    assert not _choice.needs_probe("fp32", 40, 24) and _choice.needs_probe("bf16", 40, 24)
    assert [r["source"] for r in _choice.table()] == ["cached"]
    monkeypatch.setenv("ATTNLAB_PROBE", "0")  # off: the default, the cache unread
    assert _choice.decode_rows("fp32", 40, 24, 4) == (4, "default") and not _choice.needs_probe("bf16", 40, 24)
    monkeypatch.setenv("ATTNLAB_PROBE", "1")
    good = fresh.read_text(encoding="utf-8")
    foreign = json.loads(good)
    foreign["key"]["torch"] = "0.0"
    for text in ("{not json", "[]", json.dumps(foreign), good.replace('"crossover": 8', '"crossover": 99'),
                 good.replace('"inexact"', '"exact"')):
        fresh.write_text(text, encoding="utf-8")
        monkeypatch.setattr(_choice, "_table", {})
        monkeypatch.setattr(_choice, "_loaded", [])
        assert _choice.decode_rows("fp32", 40, 24, 4) == (4, "default"), text[:40]


def test_a_probe_cut_short_is_neither_cached_nor_followed(fresh, weight, monkeypatch):
    w, b = weight
    monkeypatch.setattr(_choice, "PROBE_SECONDS", 0.0)  # stops after the first row count
    e = _probe(weight, {"own": lambda x: F.linear(x, w, b), "aten": lambda x: F.linear(x, w, b) * 1.01})
    assert e["crossover"] == 1 and e["ms"]["own"][1:] == [None] * (len(_choice.PROBE_ROWS) - 1)
    assert _choice.decode_rows("fp32", 40, 24, 4) == (4, "default")  # listed, not followed
    assert [r["class"] for r in _choice.table()] == ["64x32"] and not _choice.needs_probe("fp32", 40, 24)
    assert not fresh.exists() or "64x32" not in fresh.read_text(encoding="utf-8")


def _linear(in_features=48, out_features=80):
    g = torch.Generator().manual_seed(2)
    lin = nn.Linear(in_features, out_features)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_features, in_features, generator=g))
        lin.bias.copy_(torch.randn(out_features, generator=g))
    return lin


@needs_native
@pytest.mark.parametrize("cand", ["own", "aten"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_each_forced_candidate_of_a_packed_linear_equals_the_float_formula(monkeypatch, cand, dtype):
    """A layer packed for a decoding step runs the forced candidate at 1..8 rows: ``own`` attnlab's matvec (its plain
    weight), ``aten`` oneDNN's packed weight or F.linear; both within the dtype's tolerance of the float64 product
    of x and the rounded weight."""
    monkeypatch.setenv("ATTNLAB_FORCE_DECODE_LINEAR", cand)
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported() and cand == "aten":
        pytest.skip("no bf16 oneDNN here: F.linear's bf16 product is emulated")
    lin = _linear()
    p = PackedLinear(lin, dtype=dtype, rows=1)
    assert p.native == (cand == "own") and p.max_rows == native_rows(p.weight)
    calls = []
    real = _native.matvec
    monkeypatch.setattr(_native, "matvec", lambda *a: calls.append(1) or real(*a))
    for rows in range(1, _choice.DECODE_ROWS + 1):
        x = torch.randn(rows, 48)
        y = p(x)
        want = F.linear(x.double(), lin.weight.detach().to(dtype).double(), lin.bias.detach().to(dtype).double())
        assert ((y.double() - want).abs() <= _choice.tolerance("fp32" if dtype == torch.float32 else "bf16", x,
                                                               lin.weight.detach().to(dtype).float())).all()
    assert len(calls) == (_choice.DECODE_ROWS if cand == "own" else 0)


@needs_native
@pytest.mark.parametrize("cand", ["own", "aten"])
@pytest.mark.parametrize("mode", ["int8", "int8-weight"])
def test_each_forced_candidate_of_an_int8_linear_equals_the_float_formula(monkeypatch, cand, mode):
    """An int8 layer runs the forced candidate at 1..8 rows: ``own`` attnlab's int8 matvec, ``aten`` fbgemm's
    product (``int8``) or ``_weight_int8pack_mm`` (``int8-weight``); both within int8's tolerance of the float64
    product of x and the dequantised weight."""
    monkeypatch.setenv("ATTNLAB_FORCE_DECODE_LINEAR", cand)
    q = quantize(nn.Sequential(_linear()), mode)[0]
    assert isinstance(q, Int8Linear) and q.own_rows() == (_choice.DECODE_ROWS if cand == "own" else 0)
    for rows in range(1, _choice.DECODE_ROWS + 1):
        x = torch.randn(rows, 48)
        assert (q.matvec_args(x) is not None) == (cand == "own")
        want = F.linear(x.double(), q.weight.double(), q.bias.double())
        assert ((q(x).double() - want).abs() <= _choice.tolerance("int8", x, q.weight)).all()


@needs_native
def test_optimize_probes_once_per_shape_class(fresh, monkeypatch):
    """optimize_for_inference's conversion probes each shape class once, on its first layer; a forced or a known
    class is not probed again; the layers follow the recorded crossover."""
    seen = []
    real = _choice.probe_decode
    monkeypatch.setattr(_choice, "probe_decode", lambda dtype, w, b, c: seen.append((dtype, tuple(w.shape)))
                        or real(dtype, w, b, c))
    from attnlab.nn.inference import optimize_linears_

    model = nn.Sequential(_linear(48, 80), _linear(48, 96), _linear(80, 48))  # classes 64x128 twice, 128x64
    optimize_linears_(model, dtype=torch.float32, rows=1)
    assert seen == [("fp32", (80, 48)), ("fp32", (48, 80))]
    for layer in model:
        assert layer.max_rows == _choice.decode_rows("fp32", layer.in_features, layer.out_features, -1)[0]
        assert layer.native == (layer.max_rows >= 1)
    optimize_linears_(nn.Sequential(_linear(48, 80)), dtype=torch.float32, rows=1)
    assert len(seen) == 2  # known now
    optimize_linears_(nn.Sequential(_linear(48, 80)), dtype=torch.float32, rows=None)  # not a decoding step
    assert len(seen) == 2


def test_env_prints_the_table(fresh, weight, capsys, monkeypatch):
    from attnlab.cli import main

    w, b = weight
    _probe(weight, {"own": lambda x: F.linear(x, w, b), "aten": lambda x: F.linear(x, w, b) * 1.01})
    monkeypatch.setenv("ATTNLAB_KERNELS", "decode_linear=aten")
    assert main(["env", "--no-measure"]) == 0
    out = capsys.readouterr().out
    assert "kernel choices (probe on" in out and "  decode_linear: aten, forced" in out
    assert "decode_linear fp32 64x32 (40x24), probed: rows 1:own 2:own 4:own 6:own 8:own; ms own " in out


def _new_process(monkeypatch):
    """This process's table and budget as a new process finds them (the cache file stays)."""
    monkeypatch.setattr(_choice, "_table", {})
    monkeypatch.setattr(_choice, "_loaded", [])
    monkeypatch.setattr(_choice, "_spent", [0.0])


def test_clear_cache_forgets_the_file_and_the_process_and_names_the_classes(fresh, weight, monkeypatch):
    w, b = weight
    _probe(weight, {"own": lambda x: F.linear(x, w, b), "aten": lambda x: F.linear(x, w, b) * 1.01})
    assert fresh.is_file()
    _new_process(monkeypatch)
    assert _choice.needs_probe("bf16", 40, 24)  # (reads the cache, as every probe's caller does)
    _probe(weight, {"own": lambda x: F.linear(x, w, b), "aten": lambda x: F.linear(x, w, b) * 1.01}, dtype="bf16")
    assert _choice.clear_cache() == [("decode_linear", "bf16", [40, 24]), ("decode_linear", "fp32", [40, 24])]
    assert not fresh.exists() and _choice.table() == [] and _choice._spent == [0.0]
    assert _choice.decode_rows("fp32", 40, 24, 4) == (4, "default") and _choice.needs_probe("fp32", 40, 24)
    assert _choice.clear_cache() == []  # nothing left: no error


@needs_native
def test_env_reprobe_measures_the_cached_classes_again(fresh, monkeypatch, capsys):
    """``attnlab env --reprobe`` forgets the cache of this machine and torch and probes each class it held again on
    a weight of the recorded shape (a float layer's and an int8 layer's), writing the new choices to the cache."""
    import json as json_

    from attnlab.cli import main
    from attnlab.nn.inference import probe_linears

    probe_linears(_linear(48, 80), dtype=torch.float32, rows=1)
    quantize(nn.Sequential(_linear(64, 32)), "int8")
    classes = sorted([e["family"], e["dtype"], e["shape"]] for e in _choice.table())
    assert [c for c in classes if c[0] == "decode_linear"] == [["decode_linear", "fp32", [48, 80]],
                                                               ["decode_linear", "int8", [64, 32]]]
    assert (["int8_linear", "int8", [64, 32]] in classes) == int_mm_exact()
    stale = json_.loads(fresh.read_text(encoding="utf-8"))
    for k, e in stale["choices"].items():  # a choice measured under other conditions: own never, the fallback
        e.update(seconds=-1.0, **({"crossover": 0} if "crossover" in e
                                  else {"choice": _choice.FALLBACK[k.split("/")[0]]}))
    fresh.write_text(json_.dumps(stale), encoding="utf-8")
    _new_process(monkeypatch)
    assert main(["env", "--reprobe", "--no-measure", "--json"]) == 0
    again = json_.loads(capsys.readouterr().out)["kernel_choices"]
    assert again["reprobed"] == {"forgotten": classes, "measured": classes}
    assert [e["source"] for e in again["table"]] == ["probed"] * len(classes)
    cached = json_.loads(fresh.read_text(encoding="utf-8"))["choices"]
    assert sorted(cached) == sorted(stale["choices"]) and all(e["seconds"] >= 0 for e in cached.values())
    _new_process(monkeypatch)
    assert main(["env", "--reprobe", "--no-measure"]) == 0  # the text form says what it did
    assert f"kernel choices: forgot {len(classes)} class(es) of " in capsys.readouterr().out


@pytest.mark.parametrize("env, named", [({"ATTNLAB_PROBE": "0"}, "ATTNLAB_PROBE=0"),
                                        ({"ATTNLAB_FORCE_DECODE_LINEAR": "own"}, "forced")])
def test_env_reprobe_with_the_probe_off_or_forced_is_one_error_and_keeps_the_cache(fresh, weight, monkeypatch,
                                                                                   capsys, env, named):
    from attnlab.cli import main

    w, b = weight
    _probe(weight, {"own": lambda x: F.linear(x, w, b), "aten": lambda x: F.linear(x, w, b) * 1.01})
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["env", "--reprobe", "--no-measure"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attnlab env: error: --reprobe: ") and named in err[0]
    assert fresh.is_file()


def test_batch_linear_probe_chooses_the_exact_candidate_and_caches_it(fresh, weight, monkeypatch):
    """``batch_linear``: an inexact candidate is never chosen; the choice is cached and read back; a forced one
    wins; a class too large to probe within its budget of multiply–adds is not probed."""
    w, b = weight
    exact = lambda x: F.linear(x, w, b)  # noqa: E731
    e = _choice.probe_batch("fp32", w, b, {"onednn": lambda x: exact(x) + 1e-2, "aten": exact})
    assert e["inexact"] == ["onednn"] and e["choice"] == "aten" and e["rows"] == list(_choice.BATCH_ROWS)
    assert _choice.batch_kernel("fp32", 40, 24, "onednn") == ("aten", "probed")
    assert not _choice.needs_probe("fp32", 40, 24, family="batch_linear")
    e = _choice.probe_batch("bf16", w, b, {"onednn": exact, "aten": lambda x: exact(x) * 1.5})
    assert e["inexact"] == ["aten"] and e["choice"] == "onednn"
    _new_process(monkeypatch)
    assert _choice.batch_kernel("fp32", 40, 24, "onednn") == ("aten", "cached")
    assert _choice.batch_kernel("bf16", 40, 24, "aten") == ("onednn", "cached")
    assert _choice.decode_rows("fp32", 40, 24, 4) == (4, "default")  # another family's class: not known
    side = int((_choice.BATCH_MACS // max(_choice.BATCH_ROWS)) ** 0.5) + 1
    assert not _choice.needs_probe("fp32", side, side, family="batch_linear") and _choice.needs_probe("fp32", side,
                                                                                                        side)
    monkeypatch.setenv("ATTNLAB_KERNELS", "batch_linear=onednn")
    assert _choice.batch_kernel("fp32", 40, 24, "aten") == ("onednn", "forced")
    monkeypatch.setenv("ATTNLAB_FORCE_BATCH_LINEAR", "own")
    with pytest.raises(ValueError, match=r"ATTNLAB_FORCE_BATCH_LINEAR: batch_linear's candidates are "
                                         r"\['onednn', 'aten'\], got 'own'"):
        _choice.batch_kernel("fp32", 40, 24, "aten")


@needs_native
@pytest.mark.parametrize("cand", ["onednn", "aten"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_each_forced_batch_candidate_of_a_packed_linear_equals_the_float_formula(monkeypatch, cand, dtype):
    """A layer kept plain for the matvec multiplies more rows than a decoding step's by the forced candidate:
    ``onednn`` oneDNN's inner product on the plain weight, ``aten`` F.linear; both within the dtype's tolerance of
    the float64 product of x and the rounded weight."""
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no bf16 oneDNN here: the bf16 product is emulated")
    monkeypatch.setenv("ATTNLAB_KERNELS", f"decode_linear=own,batch_linear={cand}")
    lin = _linear()
    p = PackedLinear(lin, dtype=dtype, rows=1)
    assert p.native and p.onednn == (cand == "onednn" and torch.backends.mkldnn.is_available())
    name = "fp32" if dtype == torch.float32 else "bf16"
    w = lin.weight.detach().to(dtype)
    for rows in (_choice.DECODE_ROWS + 1, *_choice.BATCH_ROWS, 300):
        x = torch.randn(rows, 48)
        want = F.linear(x.double(), w.double(), lin.bias.detach().to(dtype).double())
        assert ((p(x).double() - want).abs() <= _choice.tolerance(name, x, w.float())).all()


@needs_native
def test_probe_linears_measures_the_batch_family_of_a_class_the_matvec_serves(fresh, monkeypatch, capsys):
    from attnlab.cli import main
    from attnlab.nn.inference import batch_onednn, probe_linears

    monkeypatch.setenv("ATTNLAB_KERNELS", "decode_linear=own")  # the matvec serves every class: batch is probed
    entries = probe_linears(nn.Sequential(_linear(48, 80)), dtype=torch.float32, rows=1)
    batch = [e for e in entries if "choice" in e]
    assert len(batch) == 1 and batch[0]["shape"] == [48, 80] and batch[0]["inexact"] == []
    assert batch_onednn(_linear(48, 80).weight.detach()) == (batch[0]["choice"] == "onednn")
    assert main(["env", "--no-measure"]) == 0
    chosen = " ".join(f"{r}:{batch[0]['choice']}" for r in _choice.BATCH_ROWS)
    assert f"batch_linear fp32 64x128 (48x80), probed: rows {chosen}; ms onednn " in capsys.readouterr().out


def test_the_cache_is_keyed_by_the_machine_and_torch(monkeypatch):
    """The cache file's name digests the CPU's model and flags, torch's version, attnlab's and the threads: another
    torch or another CPU reads another file (and a file whose key differs is ignored: the round-trip test)."""
    key, path = _choice.machine_key(), _choice.cache_path()
    assert key["torch"] == torch.__version__ and key["cpu"] == _cpu_name() and len(key["flags"]) == 16
    assert key["threads"] == torch.get_num_threads()
    monkeypatch.setattr(torch, "__version__", "0.0")
    assert _choice.cache_path() != path
    monkeypatch.undo()
    monkeypatch.setattr(_choice, "_cpu_name", lambda: "another CPU")
    assert _choice.cache_path() != path


def test_int8_linear_probe_never_chooses_an_inexact_candidate(fresh, weight, monkeypatch):
    w, b = weight
    exact = lambda x: F.linear(x, w, b)  # noqa: E731
    e = _choice.probe_batch("int8", w, b, {"fbgemm": exact, "int_mm": lambda x: exact(x) + 1e3}, family="int8_linear")
    assert e["inexact"] == ["int_mm"] and e["choice"] == "fbgemm"
    e = _choice.probe_batch("int8", torch.randn(24, 70), None, {"fbgemm": lambda x: x[:, :24] * 0,
                                                                "int_mm": lambda x: x[:, :24] * 0},
                            family="int8_linear")
    assert e["inexact"] == ["fbgemm", "int_mm"] and e["choice"] == "fbgemm"  # none exact: the fallback
    _new_process(monkeypatch)
    assert _choice.batch_kernel("int8", 40, 24, "int_mm", family="int8_linear") == ("fbgemm", "cached")
    assert _choice.batch_kernel("int8", 40, 24, "onednn") == ("onednn", "default")  # batch_linear: not known
    monkeypatch.setenv("ATTNLAB_KERNELS", "int8_linear=int_mm")
    assert _choice.batch_kernel("int8", 40, 24, "fbgemm", family="int8_linear") == ("int_mm", "forced")


@needs_native
@pytest.mark.parametrize("cand", _choice.FAMILIES["int8_linear"])
def test_each_forced_int8_linear_candidate_equals_the_float_formula(monkeypatch, cand):
    """An ``"int8"`` layer multiplies more rows than a decoding step's by the forced ``int8_linear`` candidate
    (``fbgemm``; ``int_mm`` where its sums are exact here): within int8's tolerance of the float64 product of x and
    the dequantised weight, rows six decades apart; a row holding NaN or inf gets the float layer's result and
    changes no other row."""
    if cand == "int_mm" and not int_mm_exact():
        pytest.skip("torch._int_mm's int8 sums are not exact here (no VNNI that oneDNN may use)")
    monkeypatch.setenv("ATTNLAB_FORCE_INT8_LINEAR", cand)
    q = quantize(nn.Sequential(_linear()), "int8")[0]
    assert q.int8_kernel() == cand
    calls = []
    real = _native_train.int8_product
    monkeypatch.setattr(_native_train, "int8_product", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        for rows in (_choice.DECODE_ROWS + 1, *_choice.BATCH_ROWS, 300):
            x = torch.randn(rows, 48) * torch.logspace(-3, 3, rows)[:, None]
            want = F.linear(x.double(), q.weight.double(), q.bias.double())
            assert ((q(x).double() - want).abs() <= _choice.tolerance("int8", x, q.weight)).all(), rows
        assert bool(calls) == (cand == "int_mm")
        x = torch.randn(20, 48)
        clean = q(x)
        x[3, 5], x[7, 1] = float("nan"), float("inf")
        y = q(x)
        keep = [i for i in range(20) if i not in (3, 7)]
        assert torch.equal(y[keep], clean[keep])
        torch.testing.assert_close(y[[3, 7]], F.linear(x[[3, 7]], q.weight, q.bias), rtol=0, atol=0, equal_nan=True)


def test_int_mm_forced_where_its_sums_are_not_exact_is_one_named_error(monkeypatch):
    monkeypatch.setattr(quant_formats, "_onednn_vnni", lambda: False)
    monkeypatch.setenv("ATTNLAB_FORCE_INT8_LINEAR", "int_mm")
    q = quantize(nn.Sequential(_linear()), "int8")[0]
    with pytest.raises(ValueError, match=r"ATTNLAB_FORCE_INT8_LINEAR / ATTNLAB_KERNELS: int8_linear=int_mm needs "
                                         r"torch._int_mm, .* a CPU with VNNI .*; here only 'fbgemm' runs"):
        q(torch.randn(_choice.DECODE_ROWS + 1, 48))


@needs_native
def test_quantize_probes_the_int8_linear_family_where_int_mm_is_offered(fresh, capsys):
    """``quantize(..., "int8")`` times ``fbgemm`` against ``int_mm`` once per shape class where ``int_mm`` is offered
    (:func:`int_mm_exact`), both exact; the layer follows the choice and ``attnlab env`` lists it. Elsewhere there is
    nothing to choose: no entry, ``fbgemm``."""
    from attnlab.cli import main

    q = quantize(nn.Sequential(_linear(48, 80)), "int8")[0]
    entries = [e for e in _choice.table() if e["family"] == "int8_linear"]
    if not int_mm_exact():
        assert entries == [] and q.int8_kernel() == "fbgemm"
        return
    assert len(entries) == 1 and entries[0]["shape"] == [48, 80] and entries[0]["inexact"] == []
    assert entries[0]["source"] == "probed" and q.int8_kernel() == entries[0]["choice"]
    assert main(["env", "--no-measure"]) == 0
    chosen = " ".join(f"{r}:{entries[0]['choice']}" for r in _choice.BATCH_ROWS)
    assert f"int8_linear int8 64x128 (48x80), probed: rows {chosen}; ms fbgemm " in capsys.readouterr().out
