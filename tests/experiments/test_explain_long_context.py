"""`attnlab explain long-context`: char models at growing contexts, dense and with a sliding window."""
import pytest
import torch

from attnlab.backends import tiled
from attnlab.experiments.explain import run_experiment
from attnlab.experiments.explain.long_context import _visible, make_model

from _explain import check_files


def test_long_context_quick(tmp_path, shakespeare):  # trains on tiny-shakespeare
    r = run_experiment("long-context", tmp_path, quick=True)
    check_files(r, tmp_path, "long-context")
    rows = r["rows"]
    assert [(row["context"], row["window"]) for row in rows] == [(64, "dense"), (256, "dense"), (64, 16), (256, 16)]
    for row in rows:
        assert 0 < row["val loss"] < 6 and 0 < row["val loss (late positions)"] < 6 and row["ms per step"] > 0
        L, w = row["context"], row["window"]
        assert row["keys per query"] == pytest.approx(_visible(L, L if w == "dense" else w))
        assert ("val loss at 2L (late)" in row) == (w != "dense")
    assert rows[3]["keys per query"] < 16 < rows[1]["keys per query"]


def test_windowed_model_attends_through_the_window(monkeypatch):
    """The windowed model's layers compute windowed attention (the tiled backend, float64: its block loop), equal to
    the float64 reference backend with the window mask."""
    torch.manual_seed(0)
    calls = []
    orig = tiled._TiledAttention.forward

    def spy(ctx, *a):
        calls.append(a[0].window)
        return orig(ctx, *a)

    monkeypatch.setattr(tiled._TiledAttention, "forward", staticmethod(spy))
    model = make_model(65, 1024, 32).double()
    x = torch.randint(0, 65, (1, 1024))
    got = model(x).logits
    assert calls == [32, 32]  # both layers, through the tiled backend's window

    for layer in model.layers:  # the same model, every attention through the reference backend
        layer.self_attn.backend = "reference"
    calls.clear()
    want = model(x).logits
    assert calls == []
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_visible_keys():
    assert _visible(4, 4) == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert _visible(8, 2) == pytest.approx((1 + 2 * 7) / 8)


@pytest.mark.slow
def test_long_context_claim(tmp_path, shakespeare):
    """At the longest context the 256-wide window does no worse than the dense model (late positions, 0.05 nats
    of slack) while each query reads under a quarter of the keys: ~240 of a causal query's 1024.5 on average at
    L = 2048 (w − w(w−1)/2L against (L+1)/2; "a sixth" was asserted before, which that arithmetic never allowed).
    (Measured: 2.164 against 2.255.)"""
    rows = run_experiment("long-context", tmp_path)["rows"]
    get = {(r["context"], r["window"]): r for r in rows}
    dense, win = get[(2048, "dense")], get[(2048, 256)]
    assert win["val loss (late positions)"] <= dense["val loss (late positions)"] + 0.05
    assert win["keys per query"] < dense["keys per query"] / 4
