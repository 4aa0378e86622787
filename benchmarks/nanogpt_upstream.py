"""nanoGPT's own code as the peer of ``benchmarks/train.py --nanogpt-dir DIR``.

Nothing of nanoGPT enters this repository: the user points at an upstream checkout
(``git clone https://github.com/karpathy/nanoGPT``; it needs ``numpy`` and ``requests``, which its ``prepare.py``
imports). Its files are copied into a temporary folder, so the checkout is never written to, and there:

1. ``data/shakespeare_char/prepare.py`` (nanoGPT's own) tokenises the very ``input.txt`` our recipe reads
   (``attnlab.data.datasets.load_text("tinyshakespeare")``, written beside it, so it downloads nothing);
2. ``train.py`` runs the CPU command of nanoGPT's README (fp32, no compile), plus ``--always_save_checkpoint=True``
   so that the final model is the one saved, in a fresh process with ``OMP_NUM_THREADS`` set to the benchmark's
   thread count; its wall time is the process's and its val loss is its own last estimate;
3. its saved model, loaded by its own ``model.py`` (``torch.load(weights_only=True)``), is scored on the same fixed
   validation blocks as our rows (:func:`attnlab.data.batching.lm_eval_batches` over the last 10 % of the text:
   nanoGPT's ``val.bin`` is the same split of the same character ids).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

# nanoGPT's README, "I only have a macbook" (its CPU recipe), which the ``nanogpt-cpu`` preset reproduces
CPU_FLAGS = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
             "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
             "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0"]
NEEDED = ("train.py", "model.py", "configurator.py", "config/train_shakespeare_char.py",
          "data/shakespeare_char/prepare.py")

SCORE = """
import json, sys, torch
sys.path.insert(0, ".")
b = json.loads(sys.argv[1])  # our recipe's fixed validation blocks
from model import GPT, GPTConfig
from attnlab.data.batching import lm_eval_batches
ckpt = torch.load("out/ckpt.pt", map_location="cpu", weights_only=True)
model = GPT(GPTConfig(**ckpt["model_args"]))
model.load_state_dict(dict((k.removeprefix("_orig_mod."), v) for k, v in ckpt["model"].items()))
model.eval()
text = open("data/shakespeare_char/input.txt", encoding="utf-8").read()
stoi = {c: i for i, c in enumerate(sorted(set(text)))}
data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
val = data[int(0.9 * len(data)):]
blocks = lm_eval_batches(val, block_size=b["block"], batch_size=b["batch"], num_batches=b["batches"], seed=b["seed"])
with torch.no_grad():
    total = sum(model(x.contiguous(), y.contiguous())[1].item() * y.numel() for x, y in blocks)
print(json.dumps({"val_loss_fixed": total / sum(y.numel() for _, y in blocks), "iter": int(ckpt["iter_num"])}))
"""


def check_checkout(directory: Path) -> Path:
    """``directory`` as a resolved path, or SystemExit naming what is missing and how to get nanoGPT."""
    directory = Path(directory).expanduser().resolve()
    missing = [f for f in NEEDED if not (directory / f).is_file()]
    if missing:
        raise SystemExit(f"--nanogpt-dir {directory} is not a nanoGPT checkout (missing {', '.join(missing)}); "
                         "get one with: git clone https://github.com/karpathy/nanoGPT")
    return directory


def run_upstream(checkout: Path, *, threads: int, work: Path, steps: int = 2000, fixed_blocks: dict) -> dict:
    """nanoGPT's ``train.py`` (CPU recipe, ``steps`` iterations) in ``work``; its wall time, its own val loss and
    its final model's loss on ``fixed_blocks`` (``block``, ``batch``, ``batches``, ``seed`` of our recipe)."""
    from attnlab.data.datasets import load_text

    checkout = check_checkout(checkout)
    for name in NEEDED:
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(checkout / name, work / name)
    (work / "data/shakespeare_char/input.txt").write_text(load_text("tinyshakespeare"), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    _run([sys.executable, "prepare.py"], cwd=work / "data/shakespeare_char", env=env)
    flags = [f if not f.startswith(("--max_iters", "--lr_decay_iters")) else f"{f.split('=')[0]}={steps}"
             for f in CPU_FLAGS] + ([f"--eval_interval={steps}"] if steps < 250 else [])  # a short smoke run
    t0 = time.perf_counter()
    log = _run([sys.executable, "train.py", *flags, "--always_save_checkpoint=True", "--out_dir=out"],
               cwd=work, env=env)
    process_s = time.perf_counter() - t0
    evals = re.findall(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)", log)
    if not evals:
        raise SystemExit(f"nanoGPT's train.py printed no evaluation:\n{log[-2000:]}")
    scored = _run([sys.executable, "-c", SCORE, json.dumps(fixed_blocks)], cwd=work, env=env)

    fixed = json.loads(scored.strip().splitlines()[-1])
    return {"process_s": process_s, "steps": int(evals[-1][0]), "val_loss_own": float(evals[-1][2]),
            "val_loss_fixed": fixed["val_loss_fixed"], "scored_iter": fixed["iter"]}


def _run(cmd: list[str], *, cwd: Path, env: dict) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"nanoGPT: {' '.join(cmd[:3])} failed in {cwd}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc.stdout
