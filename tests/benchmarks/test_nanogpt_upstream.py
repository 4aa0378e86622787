"""``benchmarks/train.py --nanogpt-dir``: a folder that is not a nanoGPT checkout is refused before any run, in
one line naming what is missing and how to get one. (The run itself needs an upstream checkout, which the tests
do not have: it is exercised by the benchmark, whose output records it.)"""
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "train.py"


def test_a_folder_that_is_not_nanogpt_is_refused_at_once(tmp_path):
    (tmp_path / "train.py").write_text("raise SystemExit('must not run')\n")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--nanogpt-dir", str(tmp_path), "--recipe", "nanogpt-cpu"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "machine:" not in proc.stdout  # refused before the header and any run
    message = proc.stderr.strip().splitlines()[-1]
    assert message == (f"--nanogpt-dir {tmp_path.resolve()} is not a nanoGPT checkout (missing model.py, configurator.py, "
                       "config/train_shakespeare_char.py, data/shakespeare_char/prepare.py); get one with: "
                       "git clone https://github.com/karpathy/nanoGPT")
