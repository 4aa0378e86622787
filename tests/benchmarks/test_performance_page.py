"""``docs/performance.md`` is generated from ``benchmarks/results/*.json``: the committed page is what the JSON gives,
and a benchmark's summary lands in its CPU class's file, replacing only its own entry."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import _common  # noqa: E402
import _report  # noqa: E402


def test_the_page_is_what_the_results_give():
    assert _report.PAGE.read_text(encoding="utf-8") == _report.render(), \
        "docs/performance.md differs from benchmarks/results/*.json: run python benchmarks/_report.py"


def test_every_results_file_is_its_cpu_class_and_every_row_complete():
    files = sorted(_common.RESULTS.glob("*.json"))
    assert files
    for path in files:
        data = json.loads(path.read_text(encoding="utf-8"))
        assert _common.class_file(data["cpu_class"]).name == path.name
        for name, entry in data["benchmarks"].items():
            assert entry["machine"]["isa"] and entry["machine"]["threads"] >= 1, (path.name, name)
            for row in entry["results"]:
                assert {"case", "ours", "peer", "unit", "ratio", "target", "met"} <= row.keys(), (path.name, name, row)
                assert row["met"] in (True, False, None)


AMD_ZEN3 = {"vendor_id": "AuthenticAMD", "cpu family": "25", "model": "1", "model name": "AMD EPYC 7B13",
            "flags": "fpu avx2 fma"}
INTEL_AMX = {"vendor_id": "GenuineIntel", "cpu family": "6", "model": "143", "flags": "avx2 avx512f amx_tile",
             "model name": "Intel(R) Xeon(R) Platinum 8480+"}


@pytest.mark.parametrize("info, expected", [
    (AMD_ZEN3, "AMD Zen 3 AVX2"),
    ({**AMD_ZEN3, "model": "17", "flags": "avx2 avx512f avx512_vnni"}, "AMD Zen 4 AVX-512"),
    ({**AMD_ZEN3, "cpu family": "26", "model": "2", "flags": "avx2 avx512f"}, "AMD Zen 5 AVX-512"),
    (INTEL_AMX, "Intel Xeon AVX-512 AMX"),
])
def test_cpu_class_from_cpuinfo(info, expected):
    assert _common.cpu_class(info) == expected


def test_record_replaces_one_entry_and_the_page_shows_it(tmp_path, monkeypatch):
    monkeypatch.setattr(_common, "RESULTS", tmp_path)
    machine = {"cpu": "test CPU", "isa": "AVX2", "threads": 2, "torch": "x"}
    row = _common.result("case a", 2.0, 4.0, unit="ms", target="ratio <= 1", met=True)
    assert row["ratio"] == 0.5
    path = _common.record("alpha", [row], cls="AMD Zen 3 AVX2", machine=machine)
    assert path == tmp_path / "amd-zen-3-avx2.json"
    _common.record("beta", [_common.result("case b", 1.0, None, unit="s")], cls="AMD Zen 3 AVX2", machine=machine)
    _common.record("alpha", [_common.result("case a2", 3.0, 4.0, unit="ms", met=False)], cls="AMD Zen 3 AVX2",
                   machine=machine)
    data = json.loads(path.read_text())
    assert list(data["benchmarks"]) == ["alpha", "beta"]
    assert [r["case"] for r in data["benchmarks"]["alpha"]["results"]] == ["case a2"]
    # a run under an ISA override is an entry of its own
    _common.record("alpha", [row], cls="AMD Zen 4 AVX-512", machine=machine)
    assert list(json.loads((tmp_path / "amd-zen-4-avx-512.json").read_text())["benchmarks"]) == ["alpha as AVX2"]
    page = _report.render(tmp_path)
    assert "## AMD Zen 3 AVX2" in page and "## AMD Zen 4 AVX-512" in page
    assert "| case a2 | 3 | 4 | ms | 0.75 | – | no |" in page
    assert "| case b | 1 | – | s | – | – | – |" in page


def test_quick_runs_and_runs_written_elsewhere_record_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(_common, "RESULTS", tmp_path / "results")
    rows = [{"case": "x", "ours_ms": 1.0, "peer_ms": 2.0, "ratio": 0.5}]
    _common.write_json(tmp_path / "elsewhere.json", rows)
    _common.write_json(tmp_path / "results" / "runs" / "quick.json", rows, quick=True)
    assert not list((tmp_path / "results").glob("*.json"))
    _common.write_json(tmp_path / "results" / "runs" / "bench.json", rows)
    (written,) = (tmp_path / "results").glob("*.json")
    (entry,) = json.loads(written.read_text())["benchmarks"].values()
    assert entry["results"] == [_common.result("x", 1.0, 2.0, unit="ms")]
