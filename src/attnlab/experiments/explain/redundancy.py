"""Are all heads needed? Prune the heads of a trained model and measure the loss (Michel et al. 2019).

A small GPT-2 (:class:`attnlab.GPT2LMHeadModel`: 2 layers × 4 heads, width 64, learned positions)
learns to repeat: each sequence is ``n`` random tokens followed by the same ``n`` tokens, and the
loss is the next-token cross-entropy on the second half (the first half is unpredictable). Then,
with :mod:`attnlab.evaluation.analysis`:

* each head alone is pruned (its output zeroed before the output projection,
  ``Concat(…, 0 · head_h, …) W_O``, through :func:`~attnlab.evaluation.analysis.head_mask`) and the
  loss change measured;
* heads are pruned cumulatively, least important first (by the single-head loss change), and the
  loss and copy accuracy measured after each;
* per head: entropy, mean attention distance, the weight on the copy source (``n − 1`` back) and
  the pairwise similarity of the heads' patterns.
"""
from __future__ import annotations

from pathlib import Path
from typing import Union

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.evaluation.analysis import (head_entropy, head_mask, head_similarity, mean_attention_distance,
                                         pruning_effect)
from attnlab.experiments.explain._report import check_run_args, finish, plt, train
from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel

VOCAB = 16


def repeat_batch(n_seq: int, half: int, g: torch.Generator) -> Tensor:
    """``(n_seq, 2 · half)``: ``half`` random tokens, then the same tokens again."""
    x = torch.randint(VOCAB, (n_seq, half), generator=g)
    return torch.cat([x, x], dim=1)


def copy_loss(model: GPT2LMHeadModel, ids: Tensor) -> tuple[Tensor, Tensor]:
    """Next-token cross-entropy and accuracy on the second half (positions ``half .. 2·half − 1``)."""
    half = ids.shape[1] // 2
    logits = model(ids[:, :-1]).logits[:, half - 1:]  # predictions of ids[:, half:]
    target = ids[:, half:]
    return F.cross_entropy(logits.flatten(0, 1), target.flatten()), (logits.argmax(-1) == target).float().mean()


def run(out_dir: Union[str, Path], *, seed: int = 0, quick: bool = False) -> dict:
    """Train the small GPT-2, prune its heads one at a time and cumulatively; report."""
    out = check_run_args(out_dir, seed, quick)
    half, steps = (6, 30) if quick else (12, 600)
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=2 * half, n_embd=64, n_layer=2, n_head=4,
                     embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    model = GPT2LMHeadModel(cfg)
    curve = train(model, lambda g: (repeat_batch(64, half, g),), lambda m, x: copy_loss(m, x)[0], steps=steps,
                  lr=3e-3, g=torch.Generator().manual_seed(seed))
    test = repeat_batch(256 if quick else 1024, half, torch.Generator().manual_seed(seed + 7))
    with torch.no_grad():
        evaluate = lambda: [v.item() for v in copy_loss(model, test)]  # noqa: E731
        base_loss, base_acc = evaluate()
        _, delta = pruning_effect(model, lambda: evaluate()[0])
        maps = [a.double() for a in model(test[:, :-1], output_attentions=True).attentions]  # (B, H, L, L) each
    layers, heads = delta.shape
    order = sorted(((l, h) for l in range(layers) for h in range(heads)), key=lambda lh: float(delta[lh]))
    cumulative = []
    mask = torch.ones(layers, heads)
    for k in range(len(order) + 1):
        if k:
            mask[order[k - 1]] = 0.0
        with torch.no_grad(), head_mask(model, mask):
            loss, acc = evaluate()
        cumulative.append({"pruned": k, "last pruned": "-" if not k else f"L{order[k - 1][0]}H{order[k - 1][1]}",
                           "loss": loss, "accuracy": acc})

    L = test.shape[1] - 1
    src = torch.arange(L)[:, None] - (half - 1)  # the copy source of query t: t − (half − 1)
    copy_w = torch.zeros(L, L, dtype=torch.float64)
    rows_q = torch.arange(half - 1, L)
    copy_w[rows_q, src[half - 1:, 0]] = 1.0  # (L, L) indicator of (query, source) pairs
    sim = head_similarity(maps, metric="cosine").view(layers, heads, layers, heads)
    head_rows = []
    for l, a in enumerate(maps):
        ent, dist = head_entropy(a), mean_attention_distance(a)
        on_src = (a * copy_w).sum((-1, -2)).mean(0) / len(rows_q)  # (H,): mean weight on the copy source
        for h in range(heads):
            others = [float(sim[l, h, l, g]) for g in range(heads) if g != h]
            head_rows.append({"head": f"L{l}H{h}", "Δloss pruned": float(delta[l, h]), "entropy": float(ent[h]),
                              "distance": float(dist[h]), "weight on copy source": float(on_src[h]),
                              "max similarity in layer": max(others) if others else None})
    needed = next((r for r in cumulative if r["accuracy"] < 0.9 * base_acc), None)
    top = max(head_rows, key=lambda r: r["Δloss pruned"])
    copy_heads = [i for i, r in enumerate(head_rows) if r["weight on copy source"] > 0.5]
    findings = [
        f"Trained model: copy loss {base_loss:.4f} nats, accuracy {base_acc:.3f} (chance {1 / VOCAB:.3f}) after "
        f"{steps} steps.",
        f"Pruning one head: the largest loss increase is {top['head']} ({top['Δloss pruned']:+.4f} nats); "
        f"{sum(1 for r in head_rows if r['Δloss pruned'] < 0.01)} of {len(head_rows)} heads change the loss by less "
        "than 0.01 nats.",
        (f"Pruning cumulatively (least important first), accuracy stays ≥ 90 % of the unpruned {base_acc:.3f} until "
         f"{needed['pruned']} heads are gone ({needed['last pruned']} last, accuracy {needed['accuracy']:.3f}): the "
         f"last {len(order) - needed['pruned'] + 1} head(s) alone keep the task." if needed else
         "Pruning cumulatively never drops the accuracy below 90 % of the unpruned value."),
    ]
    if len(copy_heads) > 1:
        mask = torch.ones(layers, heads)
        for i in copy_heads:
            mask[i // heads, i % heads] = 0.0
        with torch.no_grad(), head_mask(model, mask):
            _, acc_without = evaluate()
        names = [head_rows[i]["head"] for i in copy_heads]
        pair_sims = [float(sim[i // heads, i % heads, j // heads, j % heads]) for i in copy_heads for j in copy_heads
                     if i < j]
        findings.append(
            f"{len(copy_heads)} heads ({', '.join(names)}) put more than half their weight on the copy source; their "
            f"patterns have pairwise cosine similarity {min(pair_sims):.2f}–{max(pair_sims):.2f}. Each duplicates "
            f"the others, so pruning any one alone costs at most "
            f"{max(head_rows[i]['Δloss pruned'] for i in copy_heads):.4f} nats, while pruning all of them drops the "
            f"accuracy to {acc_without:.3f}: single-head pruning scores miss redundancy.")
    prunable = needed["pruned"] - 1 if needed else len(order)
    findings.append(f"{prunable} of {len(order)} heads can be pruned together at ≥ 90 % of the unpruned accuracy"
                    + ("; Michel et al. (2019) found the same redundancy in trained BERT and translation models."
                       if 2 * prunable >= len(order) else
                       "; fewer than half, unlike the redundancy Michel et al. (2019) found in trained BERT and "
                       "translation models."))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    im = axes[0].imshow(delta.numpy(), cmap="viridis", aspect="auto")
    axes[0].set_xticks(range(heads))
    axes[0].set_yticks(range(layers))
    axes[0].set_xlabel("head")
    axes[0].set_ylabel("layer")
    axes[0].set_title("Δ loss when this head alone is pruned")
    fig.colorbar(im, ax=axes[0], fraction=0.046, pad=0.04)
    axes[1].plot([r["pruned"] for r in cumulative], [r["accuracy"] for r in cumulative], "o-", label="accuracy")
    axes[1].plot([r["pruned"] for r in cumulative], [r["loss"] for r in cumulative], "s-", label="loss (nats)")
    axes[1].set_xlabel("heads pruned (least important first)")
    axes[1].set_title("cumulative pruning")
    axes[1].legend()
    top_i = head_rows.index(top)
    axes[2].imshow(maps[top_i // heads][:, top_i % heads].mean(0).numpy(), cmap="viridis")
    axes[2].set_title(f"{top['head']} (most important), mean over texts")
    axes[2].set_xlabel("key")
    axes[2].set_ylabel("query")
    return finish(out, "redundancy", title="Are all heads needed? Pruning a trained model",
                  intro=__doc__.split("\n\n", 1)[1].strip(),
                  tables=[(f"Per head ({len(test)} test sequences of 2 × {half} tokens)", head_rows,
                           list(head_rows[0])),
                          ("Cumulative pruning", cumulative, ["pruned", "last pruned", "loss", "accuracy"])],
                  findings=findings, fig=fig,
                  results={"seed": seed, "quick": quick, "steps": steps, "base_loss": base_loss,
                           "base_accuracy": base_acc, "heads": head_rows, "cumulative": cumulative,
                           "train_curve": curve})
