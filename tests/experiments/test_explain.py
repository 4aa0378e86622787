"""`attnlab explain`: the registry, every experiment in quick mode (its files and the properties its
numbers must have), the helpers with known answers, the CLI; the full runs are marked slow."""
import inspect
import math

import pytest
import torch

from attnlab.cli import main as cli_main
from attnlab.experiments.explain import EXPERIMENTS, run_experiment

from _explain import check_files as _files  # tests/_explain.py: the three files every experiment writes


def test_registry_entries_import_and_share_the_signature():
    assert set(EXPERIMENTS) == {"scaling", "heads", "position", "linear", "receptive-field", "redundancy",
                                "ensemble", "cross-lengths", "more-heads", "addressing",
                                "parallel", "limits", "long-context"}
    for name, (description, target) in EXPERIMENTS.items():
        module, func = target.split(":")
        fn = getattr(__import__(module, fromlist=[func]), func)
        params = inspect.signature(fn).parameters
        assert list(params) == ["out_dir", "seed", "quick"] and description
        assert params["seed"].kind is inspect.Parameter.KEYWORD_ONLY and params["quick"].default is False
    with pytest.raises(ValueError, match="unknown experiment 'nope'; choose one of scaling"):
        run_experiment("nope", "/tmp")


def test_run_argument_errors(tmp_path):
    with pytest.raises(TypeError, match="seed must be an int"):
        run_experiment("scaling", tmp_path, seed="0", quick=True)
    with pytest.raises(TypeError, match="quick must be a bool"):
        run_experiment("scaling", tmp_path, quick=1)


def test_scaling_quick(tmp_path):
    r = run_experiment("scaling", tmp_path, quick=True)
    _files(r, tmp_path, "scaling")
    rows = r["rows"]
    for row in rows:  # Var(q·k) = d_k: 32768 products, the estimate is within a few %
        assert abs(row["var/d_k"] - 1) < 0.10
        assert row["entropy_scaled"] <= math.log(64) and row["entropy_unscaled"] <= math.log(64)
    unscaled = [row["max_weight_unscaled"] for row in rows]
    assert unscaled == sorted(unscaled) and unscaled[-1] > 0.8  # saturates as d_k grows
    assert max(row["max_weight_scaled"] for row in rows) - min(row["max_weight_scaled"] for row in rows) < 0.03
    assert rows[-1]["grad_median_unscaled"] < 0.2 * rows[-1]["grad_median_scaled"]
    assert r["max_rel_error"] < 0.10


def test_heads_quick(tmp_path):
    from attnlab.experiments.explain.heads import OFFSETS, make_batch

    r = run_experiment("heads", tmp_path, quick=True)
    data = _files(r, tmp_path, "heads")
    assert [row["attention"] for row in r["rows"]] == ["one head", "4 heads concatenated", "heads summed"]
    for row in r["rows"]:
        per_field = [row[f"acc_{o}"] for o in OFFSETS]
        assert all(0 <= a <= 1 for a in per_field) and row["acc_all"] <= min(per_field)
    pats = data["attention_by_offset"]
    assert len(pats["one head"]) == 1 and len(pats["heads summed"]) == 4
    for p in pats.values():  # mean weights over offsets 0..max+2: a part of each causal row
        assert all(0 <= sum(h) <= 1 + 1e-6 for h in p)
    ids, tgt = make_batch(3, torch.Generator().manual_seed(0))
    for f, off in enumerate(OFFSETS):
        assert torch.equal(tgt[:, off:, f], ids[:, :-off]) and (tgt[:, :off, f] == -100).all()


def test_position_quick_and_permutation_equivariance(tmp_path):
    from attnlab.experiments.explain.position import ENCODINGS, MarkovChain

    r = run_experiment("position", tmp_path, quick=True)
    _files(r, tmp_path, "position")
    perm = {row["position"]: row for row in r["permutation"]}
    none = perm["none"]  # no positions: exactly a permutation (float64 round-off)
    assert none["equivariant"] and none["out diff: you love I"] < 1e-12 and none["pooled diff: love I you"] < 1e-12
    for kind in ("sinusoidal", "learned", "rope"):
        assert not perm[kind]["equivariant"] and perm[kind]["out diff: you love I"] > 1e-3
    # symmetric ALiBi depends on |i - j| only: blind to the reversal, not to the swap
    assert perm["alibi"]["out diff: you love I"] < 1e-12 < 1e-3 < perm["alibi"]["out diff: love I you"]
    for row in r["loss_by_length"]:
        assert row["oracle"] > 0 and all(math.isfinite(row[k]) and row[k] > 0 for k in ENCODINGS)
    chain = MarkovChain(torch.Generator().manual_seed(0))
    x = chain.sample(2, 10, torch.Generator().manual_seed(1))
    assert torch.allclose(chain.probs.sum(-1), torch.ones(12, 12)) and x.shape == (2, 10)
    want = -sum(math.log(chain.probs[x[b, t - 2], x[b, t - 1], x[b, t]]) for b in range(2) for t in range(2, 10)) / 16
    assert math.isclose(chain.oracle_loss(x), want, rel_tol=1e-5)


def test_linear_quick_and_helpers(tmp_path):
    from attnlab.experiments.explain.linear import LAYERS, build, crossover, saved_activation_mib

    r = run_experiment("linear", tmp_path, quick=True)
    _files(r, tmp_path, "linear")
    assert [row["L"] for row in r["rows"]] == [64, 128, 256]
    for row in r["rows"]:
        assert all(row[f"{name} fwd ms"] > 0 and row[f"{name} MiB"] > 0 for name in LAYERS)
    last = r["rows"][-1]
    # the materialised layer keeps the (1, 8, L, L) float32 weights; flash attention does not
    assert last["exact (materialised) MiB"] - last["exact (flash) MiB"] >= 8 * 256 * 256 * 4 / 2 ** 20
    assert len(r["crossovers"]) == 4
    mod, call = build("linear")
    a = saved_activation_mib(mod, call, torch.randn(1, 128, 512, requires_grad=True))
    b = saved_activation_mib(mod, call, torch.randn(1, 256, 512, requires_grad=True))
    assert math.isclose(b / a, 2.0, rel_tol=0.05)  # O(L) memory (whole chunks of 64)
    assert crossover([1, 2, 4, 8], [10] * 4, [1, 4, 16, 64]) == (pytest.approx(math.sqrt(10)), "measured")
    assert crossover([1, 2, 4, 8], [10, 20, 40, 80], [1, 4, 16, 64]) == (pytest.approx(10), "extrapolated")
    assert crossover([1, 2, 4], [1, 1, 1], [2, 2, 2]) == (1.0, "below range")
    assert crossover([1, 2, 4], [10, 20, 40], [1, 2, 4]) == (None, "curves do not meet")
    with pytest.raises(ValueError, match="layer must be one of"):
        build("lstm")


def test_receptive_field_quick(tmp_path):
    from attnlab.experiments.explain.receptive_field import CausalCNN, effective, influence

    r = run_experiment("receptive-field", tmp_path, quick=True)
    _files(r, tmp_path, "receptive-field")
    for row in r["rows"]:
        d = row["depth"]
        assert row["CNN theory"] == 2 * d and row["CNN ≥1% of max"] <= 2 * d
        assert row["attention ≥1% of max"] == 15  # every earlier position from the first layer
    # the CNN's influence is exactly zero beyond 2·depth back, and the attention's is not
    torch.manual_seed(0)
    g = influence(CausalCNN(3).eval(), torch.randn(2, 16, 32))
    assert torch.equal(g[0, :-3], torch.zeros(13)) and torch.equal(g[2, :-7], torch.zeros(9)) and (g[2, -7:] > 0).all()
    infl = torch.tensor(r["influence"]["attention"])
    assert (infl > 0).all()
    assert effective(torch.tensor([0.0, 0.0, 2.0, 1.0, 7.0])) == (2, 2)  # 70 %, 80 %, 100 % of the mass


def test_redundancy_quick(tmp_path):
    r = run_experiment("redundancy", tmp_path, quick=True)
    _files(r, tmp_path, "redundancy")
    cum = r["cumulative"]
    assert [c["pruned"] for c in cum] == list(range(9)) and len(r["heads"]) == 8
    assert math.isclose(cum[0]["loss"], r["base_loss"], rel_tol=1e-6)
    assert sorted(c["last pruned"] for c in cum[1:]) == sorted(h["head"] for h in r["heads"])
    for h in r["heads"]:
        assert 0 <= h["weight on copy source"] <= 1 and h["entropy"] >= 0


def test_explain_cli_list_run_and_errors(tmp_path, capsys):
    assert cli_main(["explain", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in EXPERIMENTS) and len(listed.strip().splitlines()) == len(EXPERIMENTS)
    assert cli_main(["explain", "scaling", "--quick", "--out", str(tmp_path / "s")]) == 0
    assert "Var(q·k)/d_k" in capsys.readouterr().out and (tmp_path / "s" / "scaling.md").is_file()
    for argv, msg in ((["explain"], "name an experiment"), (["explain", "nope"], "unknown experiment 'nope'")):
        assert cli_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("attnlab explain: error:") and msg in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("command", ["explain", "analyze"])
def test_help_has_examples(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main([command, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "examples:" in out and "--out" in out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_full_experiment(name, tmp_path):
    r = run_experiment(name, tmp_path)
    assert all(r["files"][k] for k in ("plot", "report", "json")) and r["findings"]
    if name == "scaling":
        assert r["max_rel_error"] < 0.05
    if name == "heads":
        rows = {row["attention"]: row for row in r["rows"]}
        assert rows["4 heads concatenated"]["acc_all"] > 0.95 > 0.5 > rows["one head"]["acc_all"]
    if name == "position":
        last = r["loss_by_length"][-1]
        assert last["alibi"] < last["learned"] and last["alibi"] < last["sinusoidal"]
    if name == "redundancy":
        assert r["base_accuracy"] > 0.95


def test_markdown_table_keeps_one_row_per_record_whatever_the_labels_hold():
    from attnlab.experiments.explain._report import table

    rows = [{"label": "a|b\nc\\", "x": 1.5}, {"label": "plain", "x": 2.0}]
    _, md = table(rows, ["label", "x"])
    lines = md.split("\n")
    assert len(lines) == 4 and lines[2] == "| a\\|b<br>c\\\\ | 1.500 |"
    assert all(line.replace("\\|", "").count("|") == 3 for line in lines)
