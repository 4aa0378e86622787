"""The training benchmarks: ``train.py``'s MFU column (its FLOP count against torch's own counter, its value from the
printed peak), ``train_budget.py``'s race at a tiny size and the live reader that stops nanoGPT at a deadline, and
``train_levers.py``'s levers between two baselines.

The race needs an upstream nanoGPT checkout (``git clone https://github.com/karpathy/nanoGPT``), which the tests do
not ship: its test runs when ``ATTNLAB_NANOGPT_DIR`` names one and says why it skips otherwise. No timing
assertions: only that the numbers are there, consistent with each other and with the formula."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPT = BENCH / "train.py"
NANOGPT = os.environ.get("ATTNLAB_NANOGPT_DIR")
NO_CHECKOUT = {k: v for k, v in os.environ.items() if k != "ATTNLAB_NANOGPT_DIR"}  # the scripts' default unset
sys.path.insert(0, str(BENCH))

from _mfu import matmul_params, settings_flops, train_flops  # noqa: E402
from _nanogpt_upstream import PROBE_EVAL, fit_budget, fitted_iters, follow, may_be_saving  # noqa: E402


def _settings(**overrides):
    from attnlab.training.recipes import get_recipe, resolve_settings

    return resolve_settings(get_recipe("shakespeare-char"), preset="tiny", overrides=overrides)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_flop_formula_equals_torchs_flop_counter(arch, monkeypatch):
    """One forward + backward of the recipe's model: torch's FlopCounterMode counts exactly 6·N_mm + 12·L·T·d per
    token (every matrix product, attention's over the full T × T), the formula the MFU column uses. Attention runs as
    the short backend's batched products here: its fused C++ kernel is one op the counter cannot see into (and it
    skips a causal block's hidden keys; the MFU convention counts the full T × T all the same)."""
    from torch.utils.flop_counter import FlopCounterMode

    from attnlab.backends import short
    from attnlab.training.losses import causal_lm_loss
    from attnlab.training.recipes.shakespeare import make_model
    monkeypatch.setattr(short, "FUSED_KEYS", 0)

    s = _settings(arch=arch)
    torch.manual_seed(0)
    model = make_model(s, vocab_size=65)
    x = torch.randint(0, 65, (s.batch_size, s.block_size))
    with FlopCounterMode(display=False) as counter:
        loss, _ = causal_lm_loss(model, (x, torch.roll(x, -1, 1)))
        loss.backward()
    assert counter.get_total_flops() == settings_flops(s, vocab_size=65, tokens=x.numel())


def test_matmul_params_by_hand():
    # gpt2 2 x 32, vocab 65: 2 · (4·32² + 2·32·128) + 32·65; llama adds a third MLP matrix
    assert matmul_params(n_layer=2, n_embd=32, ffn_dim=128, vocab_size=65, gated=False) == 26_656
    assert matmul_params(n_layer=2, n_embd=32, ffn_dim=96, vocab_size=65, gated=True) == 2 * (4096 + 3 * 32 * 96) + 2080
    assert (train_flops(tokens=10, n_layer=2, n_embd=32, block_size=32, n_mm=26_656)
            == 10 * (6 * 26_656 + 12 * 2 * 32 * 32))


@pytest.fixture(scope="module")
def quick(tmp_path_factory, shakespeare):
    out = tmp_path_factory.mktemp("train") / "train.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=NO_CHECKOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout, json.loads(out.read_text())


def test_quick_run_has_an_mfu_column_from_the_printed_peak(quick):
    stdout, data = quick
    header = next(line.split() for line in stdout.splitlines() if line.split()[:2] == ["run", "preset"])
    assert "peak (measured now" in stdout and "mfu" in header
    peak = data["peak_gflops"]
    assert peak["fp32"] > 0 and peak["bf16"] > 0 and peak["int8"] > 0
    (row,) = data["rows"]
    from attnlab import _native
    # tiny computes in fp32, so int8_training (None) gives its 8 linear layers int8 products where the kernels are
    # built, and its MFU is against the int8 peak; without them, float products and fp32's peak
    assert row["int8_layers"] == (8 if _native.available() else 0)
    product_peak = peak["int8"] if row["int8_layers"] else peak["fp32"]
    assert row["preset"] == "tiny" and row["steps"] == 20 and row["dtype"] == "fp32"
    assert row["train_tokens"] == 20 * 8 * 32  # steps x batch x block
    assert row["flops"] == 20 * 8 * 32 * (6 * 26_656 + 12 * 2 * 32 * 32)  # tiny: gpt2 2 x 32, vocab 65
    assert row["mfu"] == pytest.approx(row["flops"] / row["process_s"] / (product_peak * 1e9))
    assert 0 < row["mfu"] < 1
    assert f"{100 * row['mfu']:.2f}%" in stdout


def test_an_int8_run_is_measured_against_the_int8_products_peak():
    from _mfu import int8_gflops, mfu, peak_gflops
    assert peak_gflops("int8") == int8_gflops() > 0
    assert mfu(1e12, 2.0, "int8") == pytest.approx(1e12 / 2.0 / (int8_gflops() * 1e9))
    with pytest.raises(ValueError, match="fp32, bf16 or int8"):
        peak_gflops("fp16")


def test_the_race_needs_a_nanogpt_checkout():
    proc = subprocess.run([sys.executable, str(BENCH / "train_budget.py")], capture_output=True, text=True,
                          timeout=120, env=NO_CHECKOUT)
    assert proc.returncode == 1 and "machine:" not in proc.stdout  # refused before the header and any run
    assert proc.stderr.strip().splitlines()[-1] == (
        "train_budget.py needs --nanogpt-dir DIR or $ATTNLAB_NANOGPT_DIR (an upstream nanoGPT checkout: "
        "git clone https://github.com/karpathy/nanoGPT)")


@pytest.mark.parametrize("flags", [["--pairs", "3"], ["--pairs", "0", "--nanogpt-dir", "."]])
def test_pairs_need_a_nanogpt_checkout_and_a_positive_count(flags):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--recipe", "nanogpt-cpu", *flags], capture_output=True,
                          text=True, timeout=120, env=NO_CHECKOUT)
    assert proc.returncode == 1 and "machine:" not in proc.stdout
    assert proc.stderr.strip().splitlines()[-1].startswith("--pairs must be >= 1 and needs --nanogpt-dir")


def test_the_pairs_ratio_is_the_median_pairs_and_every_ratio_is_kept():
    from train import median_pair

    pairs = [({"process_s": t}, [{"vs_upstream": r}, {"vs_upstream": 9.0}]) for t, r in
             ((100, 0.61), (90, 0.55), (105, 0.70))]
    (theirs, ours), ratios = median_pair(pairs)
    assert ratios == [0.61, 0.55, 0.70] and theirs == {"process_s": 100} and ours[0]["vs_upstream"] == 0.61
    (theirs, _), _ = median_pair(pairs[:2])  # an even count: the upper of the middle two
    assert theirs == {"process_s": 100}


def test_follow_stamps_lines_and_stops_at_the_deadline(tmp_path):
    """A process that would run forever is killed at the deadline; one that ends is read to its end."""
    forever = "import time\nprint('step 0: train loss 4.0, val loss 4.1', flush=True)\nprint('iter 0: loss 4.0')\n" \
              "time.sleep(600)\n"
    lines, seconds, stopped, rc = follow([sys.executable, "-c", forever], cwd=tmp_path, env=dict(os.environ),
                                         deadline_s=3.0)
    assert stopped and rc != 0 and seconds >= 3.0
    ends = "for i in range(3):\n    print(f'iter {i}: loss 1.0')\n"
    lines, seconds, stopped, rc = follow([sys.executable, "-c", ends], cwd=tmp_path, env=dict(os.environ),
                                         deadline_s=120.0)
    assert not stopped and rc == 0
    assert [line for _, line in lines] == ["iter 0: loss 1.0", "iter 1: loss 1.0", "iter 2: loss 1.0"]
    assert [t for t, _ in lines] == sorted(t for t, _ in lines) and 0 < lines[0][0] <= seconds


def test_a_checkpoint_being_written_is_not_cut():
    assert may_be_saving("step 250: train loss 1.5, val loss 1.6")
    assert may_be_saving("saving checkpoint to out")
    assert not may_be_saving("iter 251: loss 1.4, time 300.00ms, mfu 0.01%")


@pytest.mark.skipif(not NANOGPT, reason="ATTNLAB_NANOGPT_DIR names no nanoGPT checkout (git clone "
                    "https://github.com/karpathy/nanoGPT)")
def test_the_race_at_a_tiny_size(tmp_path):
    """The race at 1 x 32 for 10 s: both curves, both scored on our fixed blocks, the table's arithmetic, a PNG."""
    out = tmp_path / "budget.json"
    tiny = ["n_layer=1", "n_head=2", "n_embd=32", "block_size=32", "batch_size=8", "eval_batches=2",
            "eval_batch_size=16", "eval_every=200"]
    cmd = [sys.executable, str(BENCH / "train_budget.py"), "--nanogpt-dir", NANOGPT, "--budget-s", "10",
           "--nanogpt-iters", "10", "--nanogpt-eval-iters", "2", "--threads", "1", "--out", str(out)]
    proc = subprocess.run(cmd + [a for kv in tiny for a in ("--set", kv)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    ours, theirs = data["rows"]
    s = data["summary"]
    assert s["ours"] == ours["val_loss"] and s["nanogpt"] == theirs["val_loss"]
    assert s["difference"] == pytest.approx(theirs["val_loss"] - ours["val_loss"])
    assert s["met"] == (ours["val_loss"] <= theirs["val_loss"] - 0.08)
    assert "--n_layer=1" in data["nanogpt_flags"] and "--n_embd=32" in data["nanogpt_flags"]
    assert ours["flops"] == settings_flops(_settings(arch="llama", n_layer=1, n_head=2, n_embd=32, block_size=32,
                                                     batch_size=8), vocab_size=65, tokens=ours["train_tokens"])
    n_mm = matmul_params(n_layer=1, n_embd=32, ffn_dim=128, vocab_size=65, gated=False)
    assert theirs["flops"] == train_flops(tokens=theirs["steps"] * 8 * 32, n_layer=1, n_embd=32, block_size=32,
                                          n_mm=n_mm)
    for row in (ours, theirs):
        assert 0 < row["mfu"] < 1 and 0 < row["val_loss"] < 5
    for curve in data["curves"].values():
        assert curve and [p[0] for p in curve] == sorted(p[0] for p in curve)
    assert data["curves"]["nanogpt"][0][1] == 0  # nanoGPT evaluates at step 0
    assert Path(data["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "target ours <= theirs - 0.08" in proc.stdout


@pytest.mark.skipif(not NANOGPT, reason="ATTNLAB_NANOGPT_DIR names no nanoGPT checkout (git clone "
                    "https://github.com/karpathy/nanoGPT)")
def test_nanogpts_iterations_are_fitted_to_the_budget_by_a_probe(tmp_path):
    """The probe times nanoGPT's own iterations and one evaluation (after PROBE_EVAL steps); the fitted run
    (start-up, 11 evaluations, the iterations) fills the budget without running past it."""
    s = _settings(arch="gpt2", n_layer=1, n_head=2, n_embd=32, block_size=32, batch_size=8)
    fit = fitted_iters(Path(NANOGPT), s, budget_s=60.0, eval_iters=2, threads=1, work=tmp_path, probe_s=30.0)
    assert fit["s_per_iter"] > 0 and fit["eval_s"] >= 0 and fit["start_s"] >= 0
    assert fit["iters"] % 10 == 0 and fit["iters"] > PROBE_EVAL
    planned = fit["start_s"] + 11 * fit["eval_s"] + fit["iters"] * fit["s_per_iter"]
    assert 60.0 - 10 * fit["s_per_iter"] < planned <= 60.0


def test_the_budget_fit_reads_iteration_and_evaluation_times_from_the_stamped_lines():
    """Synthetic probe output: start-up 2 s, evaluation 3 s (step 0's line at 5 s), 0.5 s per iteration, and a 3 s
    evaluation with its checkpoint before iteration PROBE_EVAL. 600 s then hold 2 + 11·3 + n·0.5: n = 1130."""
    lines, t = [(5.0, "step 0: train loss 4.1000, val loss 4.1000")], 5.0
    for n in range(PROBE_EVAL + 20):
        if n == PROBE_EVAL:
            lines.append((t + 3.0, f"step {n}: train loss 2.0000, val loss 2.1000"))
            lines.append((t + 3.0, "saving checkpoint to out"))
            t += 3.0
        t += 0.5
        lines.append((t, f"iter {n}: loss 2.0000, time 500.00ms, mfu 1.00%"))
    fit = fit_budget(lines, budget_s=600.0, eval_iters=10, probe_s=60.0)
    assert fit["s_per_iter"] == pytest.approx(0.5) and fit["eval_s"] == pytest.approx(3.0)
    assert fit["start_s"] == pytest.approx(2.0) and fit["iters"] == 1130
    # no second evaluation seen: e = 2 · eval_iters forwards at r / 3 each
    short = fit_budget(lines[:30], budget_s=600.0, eval_iters=10, probe_s=60.0)
    assert short["eval_s"] == pytest.approx(2 * 10 * 0.5 / 3)
    with pytest.raises(SystemExit, match="too few to time it"):
        fit_budget(lines[:5], budget_s=600.0, eval_iters=10, probe_s=60.0)


def test_levers_run_each_lever_between_two_baselines(tmp_path, shakespeare):
    out = tmp_path / "levers.json"
    proc = subprocess.run([sys.executable, str(BENCH / "train_levers.py"), "adamw", "softcap-30", "--quick",
                           "--threads", "1", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [r["run"] for r in rows] == ["baseline", "adamw", "softcap-30", "baseline (again)"]
    assert rows[1]["overrides"][-1] == "optimizer=adamw" and rows[2]["overrides"][-1] == "logit_softcap=30"
    base = (rows[0]["best_val_loss"] + rows[3]["best_val_loss"]) / 2
    assert data["baseline_mean"] == pytest.approx(base)
    assert data["noise"] == pytest.approx(abs(rows[0]["best_val_loss"] - rows[3]["best_val_loss"]))
    for r in rows:
        assert r["steps"] == 20 and r["delta"] == pytest.approx(r["best_val_loss"] - base)
        assert r["s_per_step"] == pytest.approx(r["wall_s"] / 20)
    for r in rows[1:3]:  # the rule the table prints
        noise = data["noise"]
        assert r["pays"] == ("yes" if r["delta"] < -noise else "no" if r["delta"] > noise else "within noise")
    assert "'pays' = delta below -noise" in proc.stdout
