"""nanoGPT's own code as the peer of ``benchmarks/train.py`` and ``benchmarks/train_budget.py`` (``--nanogpt-dir DIR``).

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

For ``benchmarks/train_budget.py`` (:func:`run_upstream_for`), step 2 runs nanoGPT's
``shakespeare_char`` config at our default preset's model size (:func:`budget_flags`) and, since its
``train.py`` has no time limit, reads its output live, stamps each line with the seconds since the process
started, and kills it at the deadline; step 3 scores the last checkpoint it saved.
Training steps are counted from its "iter N: loss ..." lines (``--log_interval=1``): iteration ``N`` done.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

# nanoGPT's README, "I only have a macbook" (its CPU recipe), which the ``nanogpt-cpu`` preset reproduces
CPU_FLAGS = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
             "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
             "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0"]
EVAL_LINE = re.compile(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)")
ITER_LINE = re.compile(r"iter (\d+): loss ")
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
print(json.dumps({"val_loss_fixed": total / sum(y.numel() for _, y in blocks), "iter": int(ckpt["iter_num"]),
                  "model_args": ckpt["model_args"], "batch_size": ckpt["config"]["batch_size"]}))
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
    env = prepare(checkout, work=work, threads=threads)
    flags = [f if not f.startswith(("--max_iters", "--lr_decay_iters")) else f"{f.split('=')[0]}={steps}"
             for f in CPU_FLAGS] + ([f"--eval_interval={steps}"] if steps < 250 else [])  # a short smoke run
    t0 = time.perf_counter()
    log = _run([sys.executable, "train.py", *flags, "--always_save_checkpoint=True", "--out_dir=out"],
               cwd=work, env=env)
    process_s = time.perf_counter() - t0
    evals = EVAL_LINE.findall(log)
    if not evals:
        raise SystemExit(f"nanoGPT's train.py printed no evaluation:\n{log[-2000:]}")
    fixed = score(work, env=env, fixed_blocks=fixed_blocks)
    return {"process_s": process_s, "steps": _train_steps(log.splitlines()), "val_loss_own": float(evals[-1][2]),
            "val_loss_fixed": fixed["val_loss_fixed"], "scored_iter": fixed["iter"],
            "model_args": fixed["model_args"], "batch_size": fixed["batch_size"]}


def budget_flags(settings, *, iters: int, eval_iters: int) -> list[str]:
    """nanoGPT's ``shakespeare_char`` config at our ``settings``' model size (``n_layer``, ``n_head``, ``n_embd``,
    ``block_size``, ``batch_size``), on the CPU without compile or dropout (its README's CPU choices), ``iters``
    (rounded to a multiple of 10) iterations with its cosine decaying over them, 10 evaluations of ``eval_iters``
    batches per split, each followed by a checkpoint (``always_save_checkpoint``), every iteration logged."""
    interval = max(1, round(iters / 10))
    return ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", f"--n_layer={settings.n_layer}",
            f"--n_head={settings.n_head}", f"--n_embd={settings.n_embd}", f"--block_size={settings.block_size}",
            f"--batch_size={settings.batch_size}", "--dropout=0.0", f"--max_iters={10 * interval}",
            f"--lr_decay_iters={10 * interval}", f"--eval_interval={interval}", f"--eval_iters={eval_iters}",
            "--log_interval=1", "--always_save_checkpoint=True", "--out_dir=out"]


def run_upstream_for(checkout: Path, *, flags: list[str], deadline_s: float, threads: int, work: Path,
                     fixed_blocks: dict) -> dict:
    """nanoGPT's ``train.py`` with ``flags`` in ``work``, stopped ``deadline_s`` after its start if it runs that long.

    nanoGPT has no time limit, so its output is read as it comes and each line is stamped with the seconds since
    the process started; at the deadline the process is killed (between a checkpoint's start and the next line it
    is given the time to finish writing). Its last saved model is scored on ``fixed_blocks``.

    Returns:
        ``process_s`` (start to exit or kill), ``stopped`` (killed at the deadline), ``steps`` (training steps
        done), ``evals`` (``[seconds, step, its val loss]`` per "step N: train loss X, val loss Y" line),
        ``val_loss_fixed``, ``scored_iter``, ``model_args``, ``batch_size``.
    """
    env = {**prepare(checkout, work=work, threads=threads), "PYTHONUNBUFFERED": "1"}
    lines, process_s, stopped, rc = follow([sys.executable, "train.py", *flags], cwd=work, env=env,
                                            deadline_s=deadline_s)
    if not stopped and rc != 0:
        raise SystemExit(f"nanoGPT: train.py failed in {work}:\n" + "\n".join(line for _, line in lines[-40:]))
    evals = [[t, int(m[1]), float(m[3])] for t, line in lines if (m := EVAL_LINE.match(line))]
    if not (work / "out/ckpt.pt").is_file():
        raise SystemExit(f"nanoGPT saved no checkpoint in {deadline_s:.0f} s (its first is after its first "
                         "evaluation past step 0): give it a longer budget or fewer iterations")
    fixed = score(work, env=env, fixed_blocks=fixed_blocks)
    return {"process_s": process_s, "stopped": stopped, "steps": _train_steps([line for _, line in lines]),
            "evals": evals, "val_loss_fixed": fixed["val_loss_fixed"], "scored_iter": fixed["iter"],
            "model_args": fixed["model_args"], "batch_size": fixed["batch_size"]}


PROBE_EVAL = 50  # the probe's second evaluation (and checkpoint) comes after this many iterations


def fitted_iters(checkout: Path, settings, *, budget_s: float, eval_iters: int, threads: int, work: Path,
                 probe_s: float = 60.0) -> dict:
    """nanoGPT's iterations that fit ``budget_s`` on this machine, timed by a ``probe_s`` run of its own ``train.py``.

    The probe runs :func:`budget_flags` evaluating at steps 0 and :data:`PROBE_EVAL` and reads the stamped lines:
    seconds per iteration ``r`` (the median gap between "iter N" lines), one evaluation with its checkpoint ``e``
    (the gap across step ``PROBE_EVAL``'s, less ``r``) and start-up ``t0`` (step 0's line less ``e``). A budget run
    evaluates 11 times, so ``iters = (budget_s - t0 - 11 · e) / r``, rounded down to a multiple of 10: its cosine
    then ends within the budget instead of being cut off midway. Without a second evaluation within ``probe_s``
    ``e`` is taken as ``2 · eval_iters`` forward passes at a third of ``r`` each.
    """
    names = ("--max_iters", "--lr_decay_iters", "--eval_interval")
    flags = [f for f in budget_flags(settings, iters=10, eval_iters=eval_iters) if not f.startswith(names)]
    flags += ["--max_iters=1000000", "--lr_decay_iters=1000000", f"--eval_interval={PROBE_EVAL}"]
    env = {**prepare(checkout, work=work, threads=threads), "PYTHONUNBUFFERED": "1"}
    lines, _, _, _ = follow([sys.executable, "train.py", *flags], cwd=work, env=env, deadline_s=probe_s)
    return fit_budget(lines, budget_s=budget_s, eval_iters=eval_iters, probe_s=probe_s)


def fit_budget(lines: list[tuple[float, str]], *, budget_s: float, eval_iters: int, probe_s: float) -> dict:
    """:func:`fitted_iters`' arithmetic on the probe's stamped ``(seconds, line)`` output."""
    evals = [t for t, line in lines if EVAL_LINE.match(line)]
    iters = {int(m[1]): t for t, line in lines if (m := ITER_LINE.match(line))}
    steps = sorted(n for n in iters if n >= 2 and n - 1 in iters and n != PROBE_EVAL)
    if not evals or len(steps) < 10:
        raise SystemExit(f"nanoGPT: a {probe_s:.0f} s probe logged {len(iters)} iterations, too few to time it "
                         "(give --nanogpt-iters)")
    gaps = sorted(iters[n] - iters[n - 1] for n in steps)
    per_iter = gaps[len(gaps) // 2]
    if PROBE_EVAL in iters and PROBE_EVAL - 1 in iters:
        eval_s = iters[PROBE_EVAL] - iters[PROBE_EVAL - 1] - per_iter
    else:
        eval_s = 2 * eval_iters * per_iter / 3
    start_s = max(0.0, evals[0] - eval_s)
    fit = int((budget_s - start_s - 11 * eval_s) / per_iter) // 10 * 10
    return {"iters": max(10, fit), "s_per_iter": per_iter, "eval_s": eval_s, "start_s": start_s}


def prepare(checkout: Path, *, work: Path, threads: int) -> dict:
    """Copy nanoGPT's files into ``work``, write our ``input.txt`` and run its ``prepare.py`` there; the
    environment its processes run in (``threads`` OpenMP/MKL threads, our sources importable for scoring)."""
    from attnlab.data.datasets import load_text

    checkout = check_checkout(checkout)
    for name in NEEDED:
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(checkout / name, work / name)
    (work / "data/shakespeare_char/input.txt").write_text(load_text("tinyshakespeare"), encoding="utf-8")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    _run([sys.executable, "prepare.py"], cwd=work / "data/shakespeare_char", env=env)
    return env


def score(work: Path, *, env: dict, fixed_blocks: dict) -> dict:
    """nanoGPT's saved ``out/ckpt.pt`` on our fixed validation blocks (see :data:`SCORE`)."""
    scored = _run([sys.executable, "-c", SCORE, json.dumps(fixed_blocks)], cwd=work, env=env)
    return json.loads(scored.strip().splitlines()[-1])


def _train_steps(lines: list[str]) -> int:
    """Training steps done: nanoGPT logs "iter N: loss …" after step N (0-based; ``--log_interval=1``)."""
    done = [int(m[1]) for line in lines if (m := ITER_LINE.match(line))]
    return done[-1] + 1 if done else 0


def may_be_saving(last_line: str) -> bool:
    """Whether nanoGPT may be writing ``ckpt.pt`` after printing ``last_line``: an evaluation line is followed by
    "saving checkpoint to …" and then the write, with no line until the next iteration's."""
    return last_line.startswith(("step ", "saving checkpoint"))


def follow(cmd: list[str], *, cwd: Path, env: dict, deadline_s: float) -> tuple[list, float, bool, int]:
    """Run ``cmd``, stamping each output line with the seconds since its start; kill it at ``deadline_s``
    (not while a checkpoint is being written). Returns (lines, seconds run, killed, exit status)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append((time.perf_counter() - t0, line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    stopped = False
    try:
        proc.wait(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        grace = time.perf_counter() + 60.0
        while lines and may_be_saving(lines[-1][1]) and proc.poll() is None and time.perf_counter() < grace:
            time.sleep(0.02)
        proc.kill()
        proc.wait()
        stopped = True
    process_s = time.perf_counter() - t0
    reader.join(timeout=30)
    lines = [(min(t, process_s), line) for t, line in lines]  # a line read after the exit was written before it
    return lines, process_s, stopped, proc.returncode

def _run(cmd: list[str], *, cwd: Path, env: dict) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"nanoGPT: {' '.join(cmd[:3])} failed in {cwd}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc.stdout
