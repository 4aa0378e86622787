"""Is multi-head attention an ensemble of heads? Heads trained together vs heads trained apart.

The task is :mod:`~attnlab.experiments.explain.heads`' (random tokens; at every position output the
tokens 1, 3, 5 and 7 back: four fields read the same vector) and so is the model (embedding, one
causal attention with RoPE, residual, LayerNorm, four linear read-outs). Two ways to spend H = 4
heads of width d = 16:

* joint: one model, ``Concat(head_1, …, head_4) W_O`` (E = 64), trained as a whole;
* ensemble: four one-head models (each: E = 64, one head of d = 16), trained independently from
  different seeds, combined as an ensemble is, by averaging the members' predicted probabilities,
  ``p(y) = (1/H) Σ_h p_h(y)``.

The heads' q/k/v/output maps have the same sizes in both; each member also has its own embedding
and read-outs, so the ensemble has more parameters (it is favoured). Then each head (joint: its
output zeroed before ``W_O``) or member (left out of the average) is removed alone, and the accuracy
drop of every field is measured: the per-field drop matrix. And the heads' attention patterns are
compared by Jensen–Shannon divergence, ``JS(a‖b) = ½ KL(a‖m) + ½ KL(b‖m)``, ``m = (a + b)/2``, in
bits (0 = the same weights, 1 = disjoint), averaged over query rows and pairs of heads.
"""
from __future__ import annotations

from pathlib import Path
from typing import Union

import torch
from torch import Tensor

from attnlab.evaluation.analysis import head_mask, head_similarity
from attnlab.experiments.explain._report import check_run_args, finish, plt, train
from attnlab.experiments.explain.heads import FIELDS, OFFSETS, VOCAB, FieldsModel, _loss, make_batch
from attnlab.modules.multihead import MultiheadAttention
from attnlab.nn.positional import RotaryEmbedding

DIM, HEADS = 64, 4
HEAD_DIM = DIM // HEADS


def member(dim: int = DIM, head_dim: int = HEAD_DIM) -> FieldsModel:
    """A one-head :class:`FieldsModel` of width ``dim`` whose head is ``head_dim`` wide."""
    model = FieldsModel(dim=dim, num_heads=1)
    model.attn = MultiheadAttention(dim, 1, head_dim=head_dim, rotary=RotaryEmbedding(head_dim))
    return model


@torch.no_grad()
def field_accuracy(probs: Tensor, tgt: Tensor) -> Tensor:
    """Accuracy per field ``(F,)`` of ``probs (B, L, F, V)`` on the positions where every field is defined."""
    rows = slice(max(OFFSETS), None)
    return (probs[:, rows].argmax(-1) == tgt[:, rows]).float().mean((0, 1))


def js_divergence(maps: Tensor) -> Tensor:
    """Mean JS divergence in bits between the heads' patterns ``maps (B, N, L, L)``: ``(N, N)``, 0 on the diagonal."""
    return 1 - head_similarity([maps.double()], metric="js")


def mean_offdiag(m: Tensor) -> float:
    n = m.shape[0]
    return float((m.sum() - m.diagonal().sum()) / (n * (n - 1)))


def specialisation(drops: Tensor) -> float:
    """How much each removed head hurts one field more than the others: mean over rows of
    ``max_f drop − mean of the other fields' drops`` (0 when a row's drops are all equal)."""
    top = drops.max(1).values
    rest = (drops.sum(1) - top) / (drops.shape[1] - 1)
    return float((top - rest).mean())


def run(out_dir: Union[str, Path], *, seed: int = 0, quick: bool = False) -> dict:
    """Train the joint model and the four members; compare accuracy, per-head ablations and patterns."""
    out = check_run_args(out_dir, seed, quick)
    steps = 25 if quick else 800
    ids, tgt = make_batch(128 if quick else 2048, torch.Generator().manual_seed(seed + 99))

    def fit(model: FieldsModel, s: int) -> list[float]:
        return train(model, lambda g: make_batch(64, g), _loss, steps=steps, lr=3e-3,
                     g=torch.Generator().manual_seed(s))

    torch.manual_seed(seed)
    joint = FieldsModel(dim=DIM, num_heads=HEADS)
    curves = {"joint": fit(joint, seed)}
    members = []
    for h in range(HEADS):
        torch.manual_seed(seed + 1000 * (h + 1))
        members.append(member())
        curves[f"member {h}"] = fit(members[-1], seed + 1000 * (h + 1))

    with torch.no_grad():
        p_joint = joint(ids).softmax(-1)
        p_members = torch.stack([m(ids).softmax(-1) for m in members])  # (H, B, L, F, V)
        acc = {"joint": field_accuracy(p_joint, tgt), "ensemble": field_accuracy(p_members.mean(0), tgt)}
        member_acc = [field_accuracy(p, tgt) for p in p_members]
        drops = {"joint": torch.zeros(HEADS, FIELDS), "ensemble": torch.zeros(HEADS, FIELDS)}
        for h in range(HEADS):
            mask = torch.ones(1, HEADS)
            mask[0, h] = 0.0
            with head_mask(joint, mask, modules=[joint.attn]):
                drops["joint"][h] = acc["joint"] - field_accuracy(joint(ids).softmax(-1), tgt)
            keep = [g for g in range(HEADS) if g != h]
            drops["ensemble"][h] = acc["ensemble"] - field_accuracy(p_members[keep].mean(0), tgt)
        maps = {"joint": joint.weights(ids), "ensemble": torch.cat([m.weights(ids) for m in members], dim=1)}
    js = {k: js_divergence(v) for k, v in maps.items()}
    L = ids.shape[1]
    by_offset = {k: torch.stack([v[:, :, t, t - max(OFFSETS) - 2: t + 1].flip(-1) for t in range(max(OFFSETS) + 2, L)],
                                dim=2).mean((0, 2)) for k, v in maps.items()}  # (H, offsets 0..max+2)

    def field_str(a: Tensor) -> str:
        return ", ".join(f"{x:.2f}" for x in a.tolist())

    rows = []
    for kind in ("joint", "ensemble"):
        a = acc[kind]
        rows.append({"model": kind, **{f"acc_{o}": float(a[f]) for f, o in enumerate(OFFSETS)},
                     "mean field acc": float(a.mean()), "specialisation": specialisation(drops[kind]),
                     "max drop": float(drops[kind].max()), "mean JS (bits)": mean_offdiag(js[kind]),
                     "heads: top offset": ", ".join(f"{int(p.argmax())}" for p in by_offset[kind])})
    drop_rows = [{"removed": f"{kind} {'head' if kind == 'joint' else 'member'} {h}",
                  **{f"Δacc_{o}": -float(drops[kind][h, f]) for f, o in enumerate(OFFSETS)}}
                 for kind in ("joint", "ensemble") for h in range(HEADS)]
    member_rows = [{"member": h, **{f"acc_{o}": float(a[f]) for f, o in enumerate(OFFSETS)},
                    "top offset": int(by_offset["ensemble"][h].argmax())} for h, a in enumerate(member_acc)]
    rj, re_ = rows
    owner = drops["joint"].argmax(0)  # the head whose removal hurts each field most
    distinct = len(set(owner.tolist()))
    findings = [
        f"Accuracy per field (offsets {', '.join(map(str, OFFSETS))}): joint heads {field_str(acc['joint'])}; "
        f"ensemble of {HEADS} one-head models {field_str(acc['ensemble'])} (chance {1 / VOCAB:.3f}); each member "
        "alone: " + "; ".join(field_str(a) for a in member_acc) + ".",
        f"Removing one head of the joint model: the largest drop per removed head is "
        + ", ".join(f"head {h} → field {OFFSETS[int(drops['joint'][h].argmax())]} "
                    f"({float(drops['joint'][h].max()):.2f})" for h in range(HEADS))
        + f"; the {FIELDS} fields' worst removals are {distinct} different heads. Specialisation "
        f"(max field drop − mean of the others, averaged over heads): joint {rj['specialisation']:.3f}, "
        f"ensemble {re_['specialisation']:.3f}; largest single drop: joint {rj['max drop']:.2f}, ensemble "
        f"{re_['max drop']:.2f}.",
        f"Patterns: mean JS divergence between two heads {rj['mean JS (bits)']:.3f} bits in the joint model "
        f"(top offsets {rj['heads: top offset']}), {re_['mean JS (bits)']:.3f} bits between the members "
        f"(top offsets {re_['heads: top offset']}).",
    ]
    divided = rj["mean field acc"] > re_["mean field acc"] and rj["specialisation"] > re_["specialisation"]
    findings.append(
        ("So the heads of one model are not an ensemble: trained together, they divide the fields among "
         "themselves (each removal costs specific fields), while independently trained heads have no reason to "
         "differ and the average of their predictions does not add up to the missing fields.") if divided else
        ("Here the measurement does not separate the two cleanly (the joint model is not both more accurate and "
         "more specialised); see the drop matrix."))
    fig, axes = plt.subplots(1, 4, figsize=(18, 4), gridspec_kw={"width_ratios": [1.2, 1, 1, 1.3]})
    for kind, c in curves.items():
        axes[0].plot(torch.linspace(0, steps, len(c)), c, label=kind, lw=2 if kind == "joint" else 1)
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("training loss")
    axes[0].legend(fontsize=7)
    for ax, kind in zip(axes[1:3], ("joint", "ensemble")):
        im = ax.imshow(-drops[kind].numpy(), cmap="magma", vmin=-1, vmax=0, aspect="auto")
        ax.set_xticks(range(FIELDS), [str(o) for o in OFFSETS])
        ax.set_yticks(range(HEADS))
        ax.set_xlabel("field (offset back)")
        ax.set_ylabel("head removed" if kind == "joint" else "member removed")
        ax.set_title(f"{kind}: Δ accuracy when removed", fontsize=10)
        for h in range(HEADS):
            for f in range(FIELDS):
                d = float(drops[kind][h, f])
                ax.text(f, h, f"{-d:.2f}", ha="center", va="center", fontsize=8, color="w" if d > 0.5 else "k")
    fig.colorbar(im, ax=axes[2], fraction=0.046, pad=0.04)
    pat = torch.cat([by_offset["joint"], by_offset["ensemble"]])
    axes[3].imshow(pat.numpy(), cmap="viridis", vmin=0, vmax=1, aspect="auto")
    axes[3].set_yticks(range(2 * HEADS), [f"joint h{h}" for h in range(HEADS)] + [f"member {h}" for h in range(HEADS)])
    axes[3].set_xlabel("offset back (t − s)")
    axes[3].set_title("mean attention weight by offset", fontsize=10)
    cols = ["model", *[f"acc_{o}" for o in OFFSETS], "mean field acc", "specialisation", "max drop", "mean JS (bits)",
            "heads: top offset"]
    return finish(out, "ensemble", title="Is multi-head attention an ensemble of heads?",
                  intro=__doc__.split("\n\n", 1)[1].strip(),
                  tables=[(f"Held-out accuracy per field, {len(ids)} sequences of {ids.shape[1]} tokens, "
                           f"{steps} steps each", rows, cols),
                          ("Each member alone", member_rows, list(member_rows[0])),
                          ("Accuracy change when one head / member is removed", drop_rows, list(drop_rows[0]))],
                  findings=findings, fig=fig,
                  results={"seed": seed, "quick": quick, "steps": steps, "rows": rows, "members": member_rows,
                           "drops": {k: v.tolist() for k, v in drops.items()},
                           "js_bits": {k: v.tolist() for k, v in js.items()},
                           "attention_by_offset": {k: v.tolist() for k, v in by_offset.items()}})
