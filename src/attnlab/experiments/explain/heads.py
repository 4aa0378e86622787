"""Why several heads: one wide head vs several narrow heads vs heads summed instead of concatenated.

The task needs four positions at once: tokens are random; at every position ``t`` the model must
output the tokens 1, 3, 5 and 7 places back (four classifiers read the same vector). The model is
one causal attention layer (RoPE on q and k, no feed-forward), a residual, LayerNorm and the four
linear read-outs, so whatever the attention mixes, the read-outs cannot unmix. Three attentions of the same width E:

* one head: ``softmax(q kᵀ/sqrt(E)) V W_O``, ``d_head = E``;
* H heads concatenated: ``Concat(head_1, …, head_H) W_O``, ``d_head = E/H`` (Vaswani et al.);
* H heads summed: ``(Σ_h head_h) W_O'``, same heads, but all write into one ``E/H``-wide space.

One head must spread its weights over the positions and returns their weighted average, in which
which-token-came-from-where is lost (Vaswani et al.: "with a single attention head, averaging
inhibits this"); concatenated heads can each attend to one position and keep their outputs apart.
Summed heads are concatenated heads with tied output blocks (``Σ_h head_h W_O' =
Concat(head_h) [W_O'; …; W_O']``): each head keeps its own ``W_V^h``, but all of them share one
``E/H``-wide output space (rank ``≤ E/H`` instead of ``E``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.modules.multihead import MultiheadAttention
from attnlab.experiments.explain._report import check_run_args, finish, plt, train
from attnlab.backends.dispatch import attention
from attnlab.nn.positional import RotaryEmbedding

VOCAB, LENGTH, OFFSETS = 16, 24, (1, 3, 5, 7)
FIELDS = len(OFFSETS)


class SummedHeads(nn.Module):
    """``(Σ_h softmax(q_h k_hᵀ/sqrt(d)) V_h) W_O'``: H heads of width d whose outputs are added."""

    def __init__(self, dim: int, num_heads: int, *, rotary: nn.Module):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.in_proj = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(self.head_dim, dim)
        self.rotary = rotary

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, L, _ = x.shape
        q, k, v = (t.view(B, L, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, L, d)
                   for t in self.in_proj(x).chunk(3, dim=-1))
        pos = torch.arange(L, device=x.device)
        return self.rotary(q, pos), self.rotary(k, pos), v

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self._qkv(x)
        return self.out_proj(attention(q, k, v, causal=True).sum(1))  # (B, L, d) -> (B, L, E)

    @torch.no_grad()
    def weights(self, x: Tensor) -> Tensor:
        q, k, v = self._qkv(x)
        return attention(q, k, v, causal=True, return_weights=True)[1]  # (B, H, L, L)


class FieldsModel(nn.Module):
    """Embedding → causal attention (residual) → LayerNorm → one linear read-out per field."""

    def __init__(self, *, dim: int, num_heads: int, combine: str = "concat"):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        rotary = RotaryEmbedding(dim // num_heads)
        self.attn = (SummedHeads(dim, num_heads, rotary=rotary) if combine == "sum"
                     else MultiheadAttention(dim, num_heads, rotary=rotary))
        self.norm = nn.LayerNorm(dim)
        self.read = nn.Linear(dim, FIELDS * VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids)  # (B, L, E)
        if isinstance(self.attn, SummedHeads):
            mixed = self.attn(x)
        else:
            mixed = self.attn(x, need_weights=False, is_causal=True)[0]
        return self.read(self.norm(x + mixed)).view(*ids.shape, FIELDS, VOCAB)  # (B, L, F, V)

    def weights(self, ids: Tensor) -> Tensor:
        x = self.embed(ids)
        if isinstance(self.attn, SummedHeads):
            return self.attn.weights(x)
        with torch.no_grad():  # recovered from the rows' log-sum-exp, the forward on its fast backend
            return self.attn(x, is_causal=True, need_weights=True, average_attn_weights=False)[1]  # (B, H, L, L)


def make_batch(n: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """``ids (n, L)`` and targets ``(n, L, F)`` = the tokens ``OFFSETS`` back (-100 where undefined)."""
    ids = torch.randint(VOCAB, (n, LENGTH), generator=g)
    tgt = torch.full((n, LENGTH, FIELDS), -100, dtype=torch.long)
    for f, off in enumerate(OFFSETS):
        tgt[:, off:, f] = ids[:, :-off]
    return ids, tgt


def _loss(model: nn.Module, ids: Tensor, tgt: Tensor) -> Tensor:
    return F.cross_entropy(model(ids).flatten(0, 2), tgt.flatten(), ignore_index=-100)


@torch.no_grad()
def evaluate(model: FieldsModel, ids: Tensor, tgt: Tensor) -> dict:
    """Accuracy per field and of all fields together, and each head's mean weight by offset."""
    pred = model(ids).argmax(-1)  # (B, L, F)
    rows = slice(max(OFFSETS), None)
    ok = pred[:, rows] == tgt[:, rows]
    w = model.weights(ids)  # (B, H, L, L)
    L = ids.shape[1]
    by_offset = torch.stack([w[:, :, t, t - max(OFFSETS) - 2: t + 1].flip(-1) for t in range(max(OFFSETS) + 2, L)],
                            dim=2).mean((0, 2))  # (H, offsets 0..max+2)
    per_field = {f"acc_{off}": ok[..., f].float().mean().item() for f, off in enumerate(OFFSETS)}
    return {**per_field, "acc_all": ok.all(-1).float().mean().item(), "by_offset": by_offset}


def run(out_dir: Union[str, Path], *, seed: int = 0, quick: bool = False) -> dict:
    """Train the three attentions on the field-copying task; compare accuracy and attention patterns."""
    out = check_run_args(out_dir, seed, quick)
    dim, num_heads = 64, 4
    steps = 40 if quick else 1000
    setups = {"one head": (1, "concat"), f"{num_heads} heads concatenated": (num_heads, "concat"),
              "heads summed": (num_heads, "sum")}
    kinds = list(setups)
    test = make_batch(256 if quick else 2048, torch.Generator().manual_seed(seed + 99))
    rows, curves, patterns = [], {}, {}
    for kind in kinds:
        torch.manual_seed(seed)
        model = FieldsModel(dim=dim, num_heads=setups[kind][0], combine=setups[kind][1])
        curves[kind] = train(model, lambda g: make_batch(64, g), _loss, steps=steps, lr=3e-3,
                             g=torch.Generator().manual_seed(seed), label=kind)
        ev = evaluate(model, *test)
        patterns[kind] = ev.pop("by_offset")
        heads = [f"h{h}→{int(p.argmax())} ({float(p.max()):.2f})" for h, p in enumerate(patterns[kind])]
        rows.append({"attention": kind, "d_head": dim // setups[kind][0],
                     "params": sum(p.numel() for p in model.parameters()), **ev,
                     "final_loss": curves[kind][-1], "heads: top offset (weight)": ", ".join(heads)})
    r1, rc, rs = rows
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8), gridspec_kw={"width_ratios": [1.3, 1, 1, 1]})
    for kind in kinds:
        axes[0].plot(torch.linspace(0, steps, len(curves[kind])), curves[kind], label=kind)
    axes[0].set_xlabel("step")
    axes[0].set_ylabel(f"training loss ({FIELDS} fields)")
    axes[0].legend()
    for ax, kind in zip(axes[1:], kinds):
        p = patterns[kind]
        im = ax.imshow(p.numpy(), cmap="viridis", vmin=0, vmax=1, aspect="auto")
        ax.set_xlabel("offset back (t − s)")
        ax.set_ylabel("head")
        ax.set_yticks(range(p.shape[0]))
        ax.set_title(f"{kind}: all fields {rows[kinds.index(kind)]['acc_all']:.2f}", fontsize=10)
        for off in OFFSETS:
            ax.axvline(off, color="w", ls=":", lw=0.8)
    fig.colorbar(im, ax=axes[-1], fraction=0.046, pad=0.04)
    solved = {r["attention"]: [off for off in OFFSETS if r[f"acc_{off}"] > 0.9] for r in rows}
    field_acc = lambda r: ", ".join(f"{r[f'acc_{off}']:.2f}" for off in OFFSETS)  # noqa: E731
    findings = [
        f"All {FIELDS} fields right: one head {r1['acc_all']:.3f}, {num_heads} concatenated heads "
        f"{rc['acc_all']:.3f}, {num_heads} summed heads {rs['acc_all']:.3f} (chance per field {1 / VOCAB:.4f}). "
        f"Per field (offsets {', '.join(map(str, OFFSETS))}): one head {field_acc(r1)}; concatenated "
        f"{field_acc(rc)}; summed {field_acc(rs)}.",
        f"Fields solved (> 90 %): one head {solved[kinds[0]] or 'none'}, concatenated {solved[kinds[1]] or 'none'}, "
        f"summed {solved[kinds[2]] or 'none'}. One head attends where its one softmax puts the weight "
        f"({r1['heads: top offset (weight)']}) and averages the rest; the linear read-outs cannot unmix an average.",
        f"What the heads attend to (offset with the most weight): concatenated: {rc['heads: top offset (weight)']}; "
        f"summed: {rs['heads: top offset (weight)']}.",
        f"Summed minus concatenated, all-fields accuracy: {rs['acc_all'] - rc['acc_all']:+.3f}. Summed heads can "
        f"attend exactly as concatenated ones, but their outputs share one {dim // num_heads}-wide space (the "
        f"output map has rank at most {dim // num_heads} instead of {dim}), in which {FIELDS} fields of {VOCAB} "
        "tokens each must fit side by side.",
    ]
    cols = ["attention", "d_head", "params", *[f"acc_{off}" for off in OFFSETS], "acc_all", "final_loss"]
    return finish(out, "heads", title="Why several heads?", intro=__doc__.split("\n\n", 1)[1].strip(),
                  tables=[(f"Held-out accuracy, {len(test[0])} sequences of {LENGTH} tokens, vocabulary {VOCAB}, "
                           f"fields at offsets {OFFSETS}, {steps} steps", rows, cols),
                          ("Heads: the offset each head weights most (mean weight)", rows,
                           ["attention", "heads: top offset (weight)"])],
                  findings=findings, fig=fig,
                  results={"seed": seed, "quick": quick, "steps": steps, "rows": rows,
                           "attention_by_offset": {k: v.tolist() for k, v in patterns.items()}})
