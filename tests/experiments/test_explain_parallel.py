"""`attnlab explain parallel`: dependent steps and path length (exact counts), threads (timed, never asserted)."""
import pytest
import torch

from attnlab.experiments.explain import run_experiment
from attnlab.experiments.explain.parallel import LAYERS, graph_paths, time_layers, unrolled_gru

from _explain import check_files


def _linear_in_length(counts: dict) -> bool:
    """``counts {L: c}`` lie exactly on one line ``c = a + b L``."""
    (l0, c0), *rest = sorted(counts.items())
    (l1, c1) = rest[0]
    return all((c - c0) * (l1 - l0) == (c1 - c0) * (n - l0) for n, c in rest)


def _check_graph(rows):
    lens = [r["L"] for r in rows]
    gru = {r["L"]: r["GRU critical path"] for r in rows}
    assert _linear_in_length(gru) and gru[lens[-1]] > gru[lens[0]]  # L dependent steps, each a few ops
    assert _linear_in_length({r["L"]: r["GRU path from s = 0"] for r in rows})
    assert len({r["GRU path from s = L−1"] for r in rows}) == 1
    assert all(r["GRU path from s = 0"] > r["GRU path from s = L−1"] for r in rows)
    # attention: the same counts at every length, the same path for the farthest and the nearest pair
    for key in ("critical path", "path from s = 0", "path from s = L−1"):
        assert len({r[f"attention {key}"] for r in rows}) == 1
    assert all(r["attention path from s = 0"] == r["attention path from s = L−1"] for r in rows)


def test_parallel_quick(tmp_path):
    r = run_experiment("parallel", tmp_path, quick=True)
    check_files(r, tmp_path, "parallel")
    assert [row["L"] for row in r["graph"]] == [4, 8, 16]
    _check_graph(r["graph"])
    n = torch.get_num_threads()
    assert r["machine"]["torch threads"] == n and r["machine"]["cpu capability"]
    for row in r["times"]:
        for name in LAYERS:
            assert row[f"{name} ms, 1 thr"] > 0 and row[f"{name} ms, {n} thr"] > 0
            assert row[f"{name} speed-up"] == row[f"{name} ms, 1 thr"] / row[f"{name} ms, {n} thr"]


def test_unrolled_gru_is_the_gru():
    torch.manual_seed(0)
    gru = torch.nn.GRU(6, 6, batch_first=True).double()
    cell = unrolled_gru(gru).double()
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    h, outs = torch.zeros(2, 6, dtype=torch.float64), []
    for t in range(5):
        h = cell(x[:, t], h)
        outs.append(h)
    assert torch.allclose(torch.stack(outs, 1), gru(x)[0], rtol=0, atol=1e-12)


def test_graph_paths_count_steps_and_time_layers_restores_threads():
    g3, g6 = graph_paths("GRU", 3), graph_paths("GRU", 6)
    assert g3["critical path"] < g6["critical path"] and g3["path from s = 0"] < g6["path from s = 0"]
    a3, a6 = graph_paths("attention", 3), graph_paths("attention", 6)
    keys = ("critical path", "path from s = 0", "path from s = L−1")
    assert a3["ops"] < a6["ops"] and [a3[k] for k in keys] == [a6[k] for k in keys]  # more leaves, same chains
    before = torch.get_num_threads()
    times = time_layers([8], 1, 0.0)
    assert torch.get_num_threads() == before and set(times) == {(name, 8) for name in LAYERS}
    assert all(t > 0 for t in times.values())


@pytest.mark.slow
def test_parallel_full_counts(tmp_path):
    r = run_experiment("parallel", tmp_path)
    assert [row["L"] for row in r["graph"]] == [8, 16, 32, 64, 128]
    _check_graph(r["graph"])
    assert r["ops_per_position"]["attention"] == 0 and r["ops_per_position"]["GRU"] > 0
