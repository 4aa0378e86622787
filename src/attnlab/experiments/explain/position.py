"""Why positional encodings, and which: train short, test long; and the permutation test.

Self-attention without positions is permutation-equivariant: ``Attn(P X) = P Attn(X)`` for any
permutation matrix P (every term is a sum over the keys, whatever their order), so "I love you" and
"you love I" give the same vectors, permuted, and the same mean-pooled sentence vector. Measured
on a randomly initialised bidirectional encoder layer in float64, for each encoding.

Length generalisation: a small causal LM (2 pre-norm layers, width 64, 4 heads) learns an
order-2 Markov chain (the next token depends on the last two: the model must find the previous
token, a relative position) on sequences of ``L_train`` tokens, then is tested on longer ones.
Encodings: sinusoidal (added, Vaswani et al.), learned absolute (added; rows past ``L_train`` are
never trained), RoPE (q/k rotated, Su et al.), ALiBi (``−m_h (i − j)`` added to the scores, Press
et al.) and none (the causal mask alone). The oracle loss is the chain's own ``−log p``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.experiments.explain._report import check_run_args, finish, plt, train
from attnlab.nn.block import DecoderLayer, EncoderLayer
from attnlab.nn.positional import ALiBi, LearnedPositionalEmbedding, RotaryEmbedding, SinusoidalPositionalEmbedding

ENCODINGS = ("sinusoidal", "learned", "rope", "alibi", "none")
VOCAB = 12


def _positions(kind: str, dim: int, heads: int, max_len: int, *, causal: bool
               ) -> tuple[Optional[nn.Module], dict]:
    """``(added embedding or None, attention kwargs)`` for one encoding."""
    if kind == "sinusoidal":
        return SinusoidalPositionalEmbedding(dim, max_positions=max_len), {}
    if kind == "learned":
        emb = LearnedPositionalEmbedding(max_len, dim)
        nn.init.normal_(emb.weight, std=1.0)
        return emb, {}
    if kind == "rope":
        return None, {"rotary": RotaryEmbedding(dim // heads, max_positions=max_len)}
    if kind == "alibi":
        return None, {"position_bias": ALiBi(heads, causal=causal)}
    if kind == "none":
        return None, {}
    raise ValueError(f"position must be one of {ENCODINGS}, got {kind!r}")


class TinyLM(nn.Module):
    """``logits = W LN(Decoder(E[x] · sqrt(d) + PE))``, causal, with one of :data:`ENCODINGS`."""

    def __init__(self, position: str, *, dim: int = 64, heads: int = 4, layers: int = 2, max_len: int = 1024):
        super().__init__()
        self.pos, attn_kw = _positions(position, dim, heads, max_len, causal=True)
        self.embed = nn.Embedding(VOCAB, dim)
        nn.init.normal_(self.embed.weight, std=dim ** -0.5)
        self.layers = nn.ModuleList(DecoderLayer(dim, heads, ffn_dim=2 * dim, dropout=0.0, norm_first=True,
                                                 cross_attention=False, **attn_kw) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids) * self.embed.embedding_dim ** 0.5  # (B, L, E)
        if self.pos is not None:
            x = x + self.pos(torch.arange(ids.shape[1]))
        for layer in self.layers:
            x = layer(x, is_causal=True)
        return self.head(self.norm(x))  # (B, L, V)


class MarkovChain:
    """Order-2 chain: ``p(x_t | x_{t-2}, x_{t-1}) = softmax(3 z)``, ``z ~ N(0, 1)`` per context."""

    def __init__(self, g: torch.Generator):
        self.probs = torch.softmax(3 * torch.randn(VOCAB, VOCAB, VOCAB, generator=g), dim=-1)  # (V, V, V)

    def sample(self, n: int, length: int, g: torch.Generator) -> Tensor:
        x = torch.empty(n, length, dtype=torch.long)
        x[:, :2] = torch.randint(VOCAB, (n, 2), generator=g)
        for t in range(2, length):
            x[:, t] = torch.multinomial(self.probs[x[:, t - 2], x[:, t - 1]], 1, generator=g).squeeze(1)
        return x

    def oracle_loss(self, x: Tensor) -> float:
        """Mean ``−log p(x_t | x_{t-2}, x_{t-1})`` over ``t ≥ 2``: the best any model can do."""
        return -self.probs[x[:, :-2], x[:, 1:-1], x[:, 2:]].log().mean().item()


def lm_loss(model: nn.Module, x: Tensor) -> Tensor:
    """Cross-entropy of predicting ``x_t`` for ``t ≥ 2`` (the first two tokens are unpredictable)."""
    logits = model(x[:, :-1])[:, 1:]  # predictions for t = 2 .. L-1
    return F.cross_entropy(logits.flatten(0, 1), x[:, 2:].flatten())


@torch.no_grad()
def permutation_test(seed: int) -> list[dict]:
    """"I love you" vs "you love I" (reversed) and "love I you" (first two swapped) through one random
    bidirectional encoder layer (float64), per encoding: max |out(P x) − P out(x)| and of the mean-pooled vectors."""
    ids = torch.tensor([[0, 1, 2]])  # I love you
    perms = {"you love I": torch.tensor([2, 1, 0]), "love I you": torch.tensor([1, 0, 2])}
    rows = []
    for kind in ENCODINGS:
        torch.manual_seed(seed)
        pos, attn_kw = _positions(kind, 16, 2, 8, causal=False)
        embed = nn.Embedding(3, 16).double()
        layer = EncoderLayer(16, 2, ffn_dim=32, dropout=0.0, norm_first=True, **attn_kw).double().eval()
        if pos is not None:
            pos.double()

        def encode(t: Tensor) -> Tensor:
            x = embed(t)
            return layer(x + pos(torch.arange(3)).double() if pos is not None else x)[0]  # (3, 16)

        a = encode(ids)
        row = {"position": kind}
        for name, perm in perms.items():
            b = encode(ids[:, perm])
            row[f"out diff: {name}"] = (b - a[perm]).abs().max().item()
            row[f"pooled diff: {name}"] = (b.mean(0) - a.mean(0)).abs().max().item()
        row["equivariant"] = all(row[f"out diff: {n}"] < 1e-12 for n in perms)
        rows.append(row)
    return rows


def run(out_dir: Union[str, Path], *, seed: int = 0, quick: bool = False) -> dict:
    """Train one TinyLM per encoding at ``L_train``, evaluate at longer lengths; run the permutation test."""
    out = check_run_args(out_dir, seed, quick)
    train_len, steps = (16, 30) if quick else (32, 500)
    test_lens = [16, 32] if quick else [32, 64, 128, 256, 512]
    g = torch.Generator().manual_seed(seed)
    chain = MarkovChain(g)
    tests = {n: chain.sample(32 if quick else 64, n, torch.Generator().manual_seed(seed + n)) for n in test_lens}
    oracle = {n: chain.oracle_loss(x) for n, x in tests.items()}
    results, curves = {}, {}
    for kind in ENCODINGS:
        torch.manual_seed(seed)
        model = TinyLM(kind, max_len=max(test_lens))
        curves[kind] = train(model, lambda gen: (chain.sample(64, train_len, gen),), lm_loss, steps=steps, lr=3e-3,
                             g=torch.Generator().manual_seed(seed + 1), label=kind)
        with torch.no_grad():
            results[kind] = {n: lm_loss(model, x).item() for n, x in tests.items()}
    rows = [{"test length": n, "oracle": oracle[n], **{k: results[k][n] for k in ENCODINGS}} for n in test_lens]
    perm_rows = permutation_test(seed)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for kind in ENCODINGS:
        axes[0].plot(test_lens, [results[kind][n] for n in test_lens], "o-", label=kind)
    axes[0].plot(test_lens, [oracle[n] for n in test_lens], "k--", label="oracle (the chain's own p)")
    axes[0].axvline(train_len, color="k", ls=":", label=f"trained length {train_len}")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("test sequence length")
    axes[0].set_ylabel("test loss (nats)")
    axes[0].set_title("length generalisation (order-2 Markov chain)")
    axes[0].legend()
    width = 0.4
    for i, name in enumerate(("you love I", "love I you")):
        axes[1].bar([j + (i - 0.5) * width for j in range(len(ENCODINGS))],
                    [max(r[f"out diff: {name}"], 1e-17) for r in perm_rows], width, label=f"'{name}'")
    axes[1].set_xticks(range(len(ENCODINGS)), labels=ENCODINGS)
    axes[1].legend()
    axes[1].set_yscale("log")
    axes[1].set_title("permutation test: max |out(P x) − P out(x)|, x = 'I love you'")

    n0, n1 = test_lens[0], test_lens[-1]
    excess = {k: (results[k][n0] - oracle[n0], results[k][n1] - oracle[n1]) for k in ENCODINGS}
    ranked = sorted(ENCODINGS, key=lambda k: results[k][n1])
    none_row = next(r for r in perm_rows if r["position"] == "none")
    others = [r for r in perm_rows if r["position"] != "none"]
    findings = [
        f"Permutation test: without positions the outputs for 'you love I' and 'love I you' are the permuted "
        f"outputs for 'I love you' to float64 round-off (max difference {none_row['out diff: you love I']:.1e}, "
        f"{none_row['out diff: love I you']:.1e}; mean-pooled {none_row['pooled diff: you love I']:.1e}): attention "
        "alone sees a bag of words. With positions ('you love I' / 'love I you'): "
        + ", ".join(f"{r['position']} {r['out diff: you love I']:.2g} / {r['out diff: love I you']:.2g}"
                    for r in others)
        + ". Bidirectional ALiBi's bias −m|i − j| depends on distances only, which a reversal keeps, so it cannot "
        "tell a sentence from its reverse (difference at round-off) but does see the swap.",
        f"Loss above the oracle at the trained length {n0} → at {n1} (trained on {train_len}): "
        + "; ".join(f"{k} {excess[k][0]:+.3f} → {excess[k][1]:+.3f}" for k in ENCODINGS) + ".",
        f"Ranking at length {n1} (best first): {', '.join(ranked)}; at the trained length {n0}: "
        f"{', '.join(sorted(ENCODINGS, key=lambda k: results[k][n0]))}. How each encoding meets unseen lengths: "
        "ALiBi's penalty grows with distance, so far tokens get almost no weight at any length; RoPE is relative "
        "too, but scores at distances never seen in training are out of distribution; learned positions past "
        "the trained length are untrained vectors; sinusoidal ones are defined everywhere but were never seen; "
        "without positions the model can only infer order from the causal mask.",
    ]
    return finish(out, "position", title="Why positional encodings, and which?",
                  intro=__doc__.split("\n\n", 1)[1].strip(),
                  tables=[(f"Test loss (nats) by length; trained on length {train_len} for {steps} steps", rows,
                           ["test length", "oracle", *ENCODINGS]),
                          ("Permutation test: one random encoder layer, float64; x = 'I love you'", perm_rows,
                           list(perm_rows[0]))],
                  findings=findings, fig=fig,
                  results={"seed": seed, "quick": quick, "train_length": train_len, "steps": steps,
                           "loss_by_length": rows, "permutation": perm_rows,
                           "train_curves": curves})
