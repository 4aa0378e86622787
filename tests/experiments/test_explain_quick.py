"""``attnlab explain NAME --quick`` answers truthfully: an experiment in QUICK_CONCLUDES reaches, quick, the claim its
full run reaches (the same assertions of both runs); every other quick run is a smoke run that draws no conclusion
(tests/_explain.py checks that of each quick run); every run says first what kind it is."""
import pytest

from attnlab.cli import main as cli_main
from attnlab.experiments.explain import EXPERIMENTS, FULL_RUN, QUICK_CONCLUDES, run_experiment
from attnlab.experiments.explain._report import SMOKE


def _scaling(r):
    rows = r["rows"]
    assert all(abs(row["var/d_k"] - 1) < 0.10 for row in rows)  # Var(q·k) = d_k
    unscaled = [row["max_weight_unscaled"] for row in rows]
    assert unscaled == sorted(unscaled) and unscaled[-1] > 0.8  # unscaled, the softmax saturates as d_k grows
    scaled = [row["max_weight_scaled"] for row in rows]
    assert max(scaled) - min(scaled) < 0.03  # scaled, it does not depend on d_k
    assert rows[-1]["grad_median_unscaled"] < 0.2 * rows[-1]["grad_median_scaled"]  # and the gradient vanishes


def _receptive_field(r):
    for row in r["rows"]:  # the CNN sees 2 positions more a layer, attention the whole prefix from the first layer
        assert row["CNN ≥1% of max"] <= row["CNN theory"] == 2 * row["depth"]
        assert row["attention ≥1% of max"] == r["length"] - 1


def _addressing(r):
    attention, fixed = r["rows"]
    assert attention["accuracy"] > 0.9 > 0.6 > fixed["accuracy"]  # content addressing solves recall; an average not


CLAIMS = {"scaling": _scaling, "receptive-field": _receptive_field, "addressing": _addressing}


def test_every_quick_conclusion_has_its_claim_and_every_full_run_its_time():
    assert set(CLAIMS) == QUICK_CONCLUDES and set(FULL_RUN) == set(EXPERIMENTS)
    assert all(FULL_RUN[name].split()[-1] in ("s", "min") for name in EXPERIMENTS)


@pytest.mark.parametrize("quick", [True, pytest.param(False, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", sorted(QUICK_CONCLUDES))
def test_a_concluding_quick_run_reaches_the_full_runs_claim(name, quick, tmp_path):
    r = run_experiment(name, tmp_path, quick=quick)
    CLAIMS[name](r)
    assert r["findings"] != [SMOKE]


def test_the_cli_says_what_kind_of_run_it_is_and_a_smoke_run_concludes_nothing(tmp_path, capsys):
    assert cli_main(["explain", "heads", "--quick", "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    said = [line for line in err.splitlines() if line.startswith("heads: ")]  # (other lines: progress, warnings)
    assert said and said[0].startswith(f"heads: a quick smoke run (seconds): no conclusion; a full run takes about "
                                       f"{FULL_RUN['heads']}"), err[:500]
    assert SMOKE in out and "Fields solved" not in out  # the full run's finding is not printed
    assert "one head" in err  # the training stages' progress (their names) on standard error
