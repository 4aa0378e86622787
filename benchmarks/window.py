"""Sliding-window attention at deployment on a char-level GPT trained with full attention (tiny-shakespeare).

The model is the ``shakespeare-char`` recipe (``attnlab train``; nanoGPT's CPU preset with a 256-token
context and 600 steps, about 1–2 minutes on 2 cores), trained once and cached in ``--run`` (default
``~/.cache/attnlab/benchmarks/window-char``; pass any ``attnlab train shakespeare-char`` output folder to
use a better model). Each row evaluates the recipe's fixed validation blocks (last 10 % of the text)
with every self-attention limited to the last ``w`` positions (:func:`attnlab.adapt.deploy.sliding_window`):
the val loss in fp32 and the median forward time of one ``eval_batch_size × block_size`` batch, all
windows timed round-robin in one run. ``full`` is the trained configuration (SDPA, causal); windowed
rows run the ``tiled`` backend, which skips key blocks outside the band. ``ratio`` = time / full time.
A second table times one of the model's self-attention layers alone at a long context (4096 tokens,
batch 1; the trained model cannot be *scored* there: its learned position table stops at the block size),
where the O(L·w) band pays off.

Run: ``python benchmarks/window.py [--quick] [--threads 2] [--run DIR] [--out PATH]``
(data: ``$ATTNLAB_DATA_DIR``).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import compare, parser, print_table, setup, write_json  # noqa: E402

from attnlab.adapt.deploy import sliding_window  # noqa: E402
from attnlab.training.checkpoint import latest_checkpoint, load_checkpoint  # noqa: E402
from attnlab.training.distributed import DistInfo  # noqa: E402
from attnlab.training.recipes import get_recipe, resolve_settings, run_recipe  # noqa: E402

DEFAULT_RUN = Path.home() / ".cache" / "attnlab" / "benchmarks" / "window-char"
# nanoGPT's CPU recipe with a longer context, so that windows have room to bite
TRAIN = dict(block_size=256, max_steps=600, warmup_steps=50, max_seconds=None, eval_batches=8, eval_batch_size=16)
QUICK_TRAIN = dict(block_size=64, max_steps=60, max_seconds=None, eval_batches=2, eval_batch_size=8,
                   n_layer=2, n_embd=64, n_head=2)
COLUMNS = ["window", "val_loss", "delta_loss", "ms", "ratio", "backend", "repeat"]


def trained_char_model(run: Path, *, train: Optional[dict] = None):
    """The model of a ``shakespeare-char`` run folder and the recipe's build (``.evaluate`` scores it on
    the fixed validation blocks). With ``train`` (recipe overrides of the nanogpt-cpu preset), the run
    is first trained — or resumed from its latest checkpoint — until it has ``train["max_steps"]`` steps."""
    run = Path(run)
    if train is not None and _steps_done(run) < train["max_steps"]:
        resume = latest_checkpoint(run) is not None
        print(f"{'resuming' if resume else 'training'} shakespeare-char (nanogpt-cpu preset with {train}) "
              f"in {run} ...", flush=True)
        run_recipe("shakespeare-char", out=run, preset="nanogpt-cpu", overrides={**train, "progress": False},
                   resume=resume)
    if latest_checkpoint(run) is None:
        raise FileNotFoundError(f"no checkpoint in {run}: pass an `attnlab train shakespeare-char` output folder")
    saved = json.loads((run / "config.json").read_text(encoding="utf-8"))
    recipe = get_recipe(saved["recipe"])
    settings = resolve_settings(recipe, base=saved["settings"])
    built = recipe.build(settings, out=run, dist=DistInfo(), training=False)
    built.model.load_state_dict(load_checkpoint(latest_checkpoint(run))["model"])
    return built.model.eval(), built, settings


def _steps_done(run: Path) -> int:
    metrics = run / "metrics.json"
    return json.loads(metrics.read_text(encoding="utf-8")).get("steps", 0) if metrics.is_file() else 0


def model_for(args) -> tuple:
    """``--run`` as given, or the cached default run (trained here on first use); also the folder used."""
    if args.run:
        return trained_char_model(Path(args.run)), Path(args.run)
    run = DEFAULT_RUN.with_name(DEFAULT_RUN.name + ("-quick" if args.quick else ""))
    return trained_char_model(run, train=QUICK_TRAIN if args.quick else TRAIN), run


def long_context_timing(model, L: int, windows: list[int], repeat: int) -> list[dict]:
    """Median ms of layer 0's self-attention on ``(1, L, E)``: full causal attention, and each window by
    the ``auto`` choice (``tiled``, skipping blocks) and by SDPA under a dense band mask (the peer)."""
    attn = model.layers[0].self_attn
    h = torch.randn(1, L, attn.embed_dim)
    fns = {}
    for w in [None] + windows:
        for backend in ("auto",) if w is None else ("auto", "sdpa"):
            def run(w=w, backend=backend):
                attn.window, attn.backend = w, backend
                with torch.inference_mode():
                    attn(h, h, h, is_causal=True, need_weights=False)
                attn.window, attn.backend = None, "auto"
            fns[("full", "sdpa (causal)") if w is None else
                (str(w), "tiled (auto)" if backend == "auto" else "sdpa + band mask")] = run
    times = compare(fns, repeat=repeat, warmup=1)
    full = times[("full", "sdpa (causal)")]
    return [{"window": w, "backend": b, "L": L, "ms": t, "ratio": t / full, "repeat": repeat}
            for (w, b), t in times.items()]


def main(argv=None) -> None:
    p = parser(__doc__.splitlines()[0], "window.json")
    p.add_argument("--run", default=None, help=f"an `attnlab train shakespeare-char` folder (default {DEFAULT_RUN})")
    args = p.parse_args(argv)
    setup(args)
    (model, built, settings), run = model_for(args)
    T = settings.block_size
    windows = [None] + [w for w in (128, 64, 32, 16, 8, 4, 2) if w < T]
    x = built.evaluate.keywords["batches"][0][0]  # one (eval_batch_size, T) validation batch
    rows, fns = [], {}
    for w in windows:
        with sliding_window(model, w):
            loss = built.evaluate(model)["val_loss"]

        def forward(w=w):
            with sliding_window(model, w), torch.inference_mode():
                model(x)
        fns["full" if w is None else str(w)] = forward
        rows.append({"window": "full" if w is None else w, "val_loss": loss,
                     "backend": "sdpa (causal)" if w is None else "tiled (band)"})
    repeat = 3 if args.quick else 10
    times = compare(fns, repeat=repeat, warmup=1)
    full_loss, full_ms = rows[0]["val_loss"], times["full"]
    for r in rows:
        key = "full" if r["window"] == "full" else str(r["window"])
        r.update(delta_loss=r["val_loss"] - full_loss, ms=times[key], ratio=times[key] / full_ms, repeat=repeat)
    long_rows = long_context_timing(model, 1024 if args.quick else 4096, windows[1:], repeat)
    print(f"model: {run} (context {T}, {sum(p.numel() for p in model.parameters()):,} parameters); "
          f"validation: {len(built.evaluate.keywords['batches'])} x {tuple(x.shape)} blocks")
    print_table(rows, COLUMNS)
    print(f"one self-attention layer alone, causal, batch 1 x {long_rows[0]['L']} tokens:")
    print_table(long_rows, ["window", "backend", "L", "ms", "ratio", "repeat"])
    write_json(args.out, rows, long_context=long_rows, quick=args.quick, run=str(run), block_size=T,
               settings={k: getattr(settings, k) for k in ("n_layer", "n_head", "n_embd", "block_size", "max_steps")})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
