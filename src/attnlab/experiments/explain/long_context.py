"""Long context on a CPU: does a sliding window replace full attention? Char-level models trained at
contexts up to 2,048 tokens, dense and windowed, on tiny-shakespeare.

Full causal attention costs ``O(L²)`` per sequence; a window of ``w`` keys costs ``O(L·w)``, and the ``tiled``
backend computes only the tiles the band reaches, so training at a long context stays cheap. The question is
what the window gives up. Each model — a 2-layer Llama (rotary positions, so nothing ties it to the length it
was trained at) — sees the same number of training tokens (``steps × batch × L`` fixed: a longer context means
fewer, longer sequences), at contexts ``L`` and windows ``w`` (dense = ``w = L``). The validation loss is
measured on the last 10 % of the text, on fixed blocks of the model's own context (``all positions``), and on
the last quarter of each block only (``late positions``: every one of them has at least ``3L/4`` tokens of
history, so this is where a longer context can pay). Each windowed model is also scored at twice the context
it was trained at (its window still bounds what it reads).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.adapt.deploy import set_window
from attnlab.data.batching import lm_eval_batches
from attnlab.data.datasets import load_text
from attnlab.data.tokenizers import CharTokenizer
from attnlab.experiments.explain._report import check_run_args, finish, plt, train
from attnlab.models.llama import LlamaConfig, LlamaForCausalLM

WIDTH, LAYERS, HEADS = 64, 2, 4


def make_model(vocab: int, max_len: int, window: Optional[int]) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=WIDTH, intermediate_size=3 * WIDTH, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, max_position_embeddings=max_len, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    set_window(model, window)
    return model


def _lm_loss(model, x: Tensor, y: Tensor, *, from_pos: int = 0) -> Tensor:
    logits = model(x).logits[:, from_pos:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[:, from_pos:].reshape(-1))


@torch.no_grad()
def val_loss(model, data: Tensor, *, context: int, tokens: int, seed: int) -> dict:
    """Mean loss over fixed blocks of ``context`` tokens (``tokens`` predicted in all), and over each
    block's last quarter."""
    blocks = lm_eval_batches(data, block_size=context, batch_size=max(1, tokens // context // 4), num_batches=4,
                             seed=seed)
    model.eval()
    total = late = 0.0
    for x, y in blocks:
        total += _lm_loss(model, x, y).item()
        late += _lm_loss(model, x, y, from_pos=3 * context // 4).item()
    return {"all": total / len(blocks), "late": late / len(blocks)}


def _visible(context: int, window: int) -> float:
    """Mean keys a query sees: ``(1/L) Σ_i min(i + 1, w)``."""
    return sum(min(i + 1, window) for i in range(context)) / context


def run(out_dir: Union[str, Path], *, seed: int = 0, quick: bool = False) -> dict:
    """Train every (context, window) at equal training tokens; validation losses and step times."""
    out = check_run_args(out_dir, seed, quick)
    text = load_text("tinyshakespeare")
    tok = CharTokenizer.from_text(text)
    data = tok.encode_tensor(text)  # (N,) int64
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]
    contexts = [64, 256] if quick else [128, 512, 2048]
    windows = [16] if quick else [64, 256]
    steps, tokens = (20, 2048) if quick else (300, 8192)          # training tokens per step
    val_tokens = 4096 if quick else 32768
    runs = [(L, None) for L in contexts] + [(L, w) for L in contexts for w in windows if w < L]
    rows, curves = [], {}
    for L, w in runs:
        torch.manual_seed(seed)
        model = make_model(tok.vocab_size, 2 * L, w)
        batch = tokens // L

        def batch_fn(g, L=L, batch=batch):
            i = torch.randint(len(train_data) - L - 1, (batch,), generator=g)
            x = torch.stack([train_data[j:j + L] for j in i.tolist()])
            return x, torch.stack([train_data[j + 1:j + L + 1] for j in i.tolist()])

        t0 = time.perf_counter()
        key = f"L={L}, " + ("dense" if w is None else f"w={w}")
        curves[key] = train(model, batch_fn, _lm_loss, steps=steps, lr=3e-3, g=torch.Generator().manual_seed(seed),
                            label=key)
        ms = (time.perf_counter() - t0) / steps * 1e3
        v = val_loss(model, val_data, context=L, tokens=val_tokens, seed=seed + 1)
        row = {"context": L, "window": "dense" if w is None else w, "keys per query": _visible(L, w or L),
               "val loss": v["all"], "val loss (late positions)": v["late"], "ms per step": ms}
        if w is not None:  # a window bounds what the model reads: score it at twice its training context
            row["val loss at 2L (late)"] = val_loss(model, val_data, context=2 * L, tokens=val_tokens,
                                                    seed=seed + 1)["late"]
        rows.append(row)
        print(", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    findings = _findings(rows, contexts, windows, steps, tokens)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for w in [None, *windows]:
        pts = [r for r in rows if r["window"] == ("dense" if w is None else w)]
        axes[0].semilogx([r["context"] for r in pts], [r["val loss (late positions)"] for r in pts], "o-",
                         base=2, label="dense" if w is None else f"window {w}")
        axes[1].loglog([r["context"] for r in pts], [r["ms per step"] for r in pts], "o-", base=2,
                       label="dense" if w is None else f"window {w}")
    axes[0].set_xlabel("training context L")
    axes[0].set_ylabel("val loss, last quarter of each block")
    axes[0].legend(fontsize=8)
    axes[0].set_title(f"equal training tokens ({steps} steps x {tokens})")
    axes[1].set_xlabel("training context L")
    axes[1].set_ylabel("ms per training step")
    axes[1].legend(fontsize=8)
    axes[1].set_title("cost of a step (same tokens per step)")
    columns = ["context", "window", "keys per query", "val loss", "val loss (late positions)",
               "val loss at 2L (late)", "ms per step"]
    return finish(out, "long-context", title="Long context: sliding window against full attention",
                  intro=__doc__.split("\n\n", 1)[1].strip(),
                  tables=[(f"{LAYERS}-layer Llama, width {WIDTH}, {HEADS} heads; {steps} steps x {tokens} training "
                           f"tokens each; validation: {val_tokens} tokens per context", rows, columns)],
                  findings=findings, fig=fig,
                  results={"seed": seed, "quick": quick, "steps": steps, "tokens_per_step": tokens, "rows": rows,
                           "train_curves": curves})


def _findings(rows: list[dict], contexts: list[int], windows: list[int], steps: int, tokens: int) -> list[str]:
    def get(L, w):
        return next((r for r in rows if r["context"] == L and r["window"] == w), None)

    L = contexts[-1]
    dense = get(L, "dense")
    out = ["Dense models, late-position val loss by context: "
           + ", ".join(f"L = {c}: {get(c, 'dense')['val loss (late positions)']:.3f}" for c in contexts) + "."]
    for w in windows:
        r = get(L, w)
        if r is None:
            continue
        gap = r["val loss (late positions)"] - dense["val loss (late positions)"]
        out.append(f"At L = {L}, window {w} (each query reads {r['keys per query']:.0f} keys instead of "
                   f"{dense['keys per query']:.0f}): late val loss {r['val loss (late positions)']:.3f} against dense "
                   f"{dense['val loss (late positions)']:.3f} ({gap:+.3f}), at {r['ms per step']:.0f} ms a step against "
                   f"{dense['ms per step']:.0f} ms; scored at 2L = {2 * L}: {r['val loss at 2L (late)']:.3f}.")
    best = min(rows, key=lambda r: r["val loss (late positions)"])
    late = [get(c, "dense")["val loss (late positions)"] for c in contexts]
    falls = all(b < a for a, b in zip(late, late[1:]))
    close = [w for w in windows if get(L, w) is not None
             and get(L, w)["val loss (late positions)"] - dense["val loss (late positions)"] <= 0.05]
    out.append(f"Lowest late val loss: L = {best['context']}, window {best['window']} "
               f"({best['val loss (late positions)']:.3f}).")
    out.append(("With the same training tokens, the dense models' late loss falls as the context grows."
                if falls else
                f"With the same {steps} x {tokens} training tokens, a longer context does not lower the dense models' "
                "late loss here: a longer context means fewer sequences per step, and a model this small, trained "
                "this briefly, uses little of a long history.")
               + (f" Windows of {', '.join(map(str, close))} do no worse than the dense model at L = {L} (late loss at "
                  "most 0.05 above it), for a cost linear in L." if close else
                  f" Every window loses more than 0.05 nats against the dense model at L = {L}."))
    return out
