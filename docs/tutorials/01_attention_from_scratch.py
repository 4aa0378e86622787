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
# # Attention from scratch
#
# Scaled dot-product attention is a handful of tensor operations. In this chapter we write it in plain torch,
# check it against `attnlab.attention` and against PyTorch's fused kernel, and look at the three details that
# decide whether it works: the scale $\kappa = 1/\sqrt{d}$, the masks, and a softmax that does not overflow.
#
# For queries $Q \in \mathbb{R}^{L_q \times d}$, keys $K \in \mathbb{R}^{L_k \times d}$ and values
# $V \in \mathbb{R}^{L_k \times d_v}$:
#
# $$S = \kappa\, Q K^\top + M, \qquad W = \operatorname{softmax}_{\text{rows}}(S), \qquad O = W V,$$
#
# where the mask $M_{ij}$ is $0$ where query $i$ may look at key $j$ and $-\infty$ where it may not.
# Row $i$ of $O$ is a weighted average of the values, with weights $W_{ij} \ge 0$, $\sum_j W_{ij} = 1$.

# %%
import math
import os

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm                                            # a progress bar for the longer loops

import attnlab

QUICK = os.environ.get("ATTNLAB_TUTORIAL_QUICK") == "1"
_ = torch.manual_seed(0)  # (it returns the generator: `_ =` keeps its repr out of the output)

# %% [markdown]
# ## The formula in torch
#
# Tensors are heads-first, `(B, H, L, D)`: batch, heads, positions, features. The mask is boolean,
# `True` = may attend (SDPA's convention). A row with no visible key would be $0/0$; we return zeros there,
# as the library does.

# %%
def attention_by_hand(q, k, v, allowed=None, scale=None):
    """softmax(κ Q Kᵀ + M) V with M = -inf where `allowed` is False."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = scale * q @ k.transpose(-2, -1)                        # (B, H, Lq, Lk)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    row_max = scores.amax(-1, keepdim=True).clamp(min=torch.finfo(scores.dtype).min)  # stable: see below
    e = torch.exp(scores - row_max)                                  # every entry in [0, 1]
    weights = e / e.sum(-1, keepdim=True).clamp(min=torch.finfo(e.dtype).tiny)
    return weights @ v, weights


B, H, L, D = 2, 4, 12, 16
q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
out, w = attention_by_hand(q, k, v)

ours = attnlab.attention(q, k, v, backend="reference")
fused = F.scaled_dot_product_attention(q, k, v)
torch.testing.assert_close(out, ours)   # float32 tolerances: rtol 1.3e-6, atol 1e-5
torch.testing.assert_close(out, fused)
print("max |by hand - attnlab|:", (out - ours).abs().max().item())
print("max |by hand - SDPA|:   ", (out - fused).abs().max().item())
assert torch.allclose(w.sum(-1), torch.ones(B, H, L))

# %% [markdown]
# ## Masks: causal, padding, window
#
# A mask says which keys each query may see:
#
# * **causal** (a decoder): $j \le i$, so no position reads the future;
# * **padding** (a batch of sentences of different lengths $n_b$): $j < n_b$, so no query reads a pad token;
# * **sliding window** of width $w$: $|i - j| < w$ (or $0 \le i - j < w$ when causal too): each position
#   sees only its neighbourhood, $O(L w)$ work instead of $O(L^2)$ (chapter 4).
#
# `attnlab.attention` takes them as `causal=True`, a boolean `mask=` and `window=`; each must equal the
# formula above with the same mask written out.

# %%
i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
lengths = torch.tensor([L, 7])                                      # the 2nd sequence has 5 pads
window = 3
causal = j <= i                                                     # (L, L)
padding = (torch.arange(L)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, L)
sliding = (i - j).abs() < window

for name, allowed, kwargs in [("causal", causal, dict(causal=True)),
                              ("padding", padding, dict(mask=padding)),
                              ("window", sliding, dict(window=window))]:
    expected, _ = attention_by_hand(q, k, v, allowed)
    torch.testing.assert_close(attnlab.attention(q, k, v, **kwargs), expected)
    torch.testing.assert_close(attnlab.attention(q, k, v, **kwargs, backend="reference"), expected)
    print(f"{name:8s} mask: attnlab equals the formula")

fig, axes = plt.subplots(1, 3, figsize=(10, 3.4))
for ax, (name, m) in zip(axes, [("causal", causal), ("padding (2nd sequence)", padding[1, 0].expand(L, L)),
                                (f"window w={window}", sliding)]):
    ax.imshow(m, cmap="Blues")
    ax.set(title=name, xlabel="key j", ylabel="query i")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## A softmax that does not overflow
#
# $\operatorname{softmax}(s)_j = e^{s_j} / \sum_l e^{s_l}$ is unchanged when a constant is subtracted from every
# $s_j$. The naive formula overflows: in float32 $e^{x} = \infty$ for $x > \ln(3.4 \cdot 10^{38}) \approx 88.7$,
# and $\infty/\infty$ is NaN. Subtracting the row maximum $m = \max_l s_l$ first,
#
# $$\operatorname{softmax}(s)_j = \frac{e^{s_j - m}}{\sum_l e^{s_l - m}},$$
#
# puts every exponent in $[0, 1]$ and the largest term at exactly $1$, so the sum is at least $1$.

# %%
s = torch.tensor([10.0, 50.0, 100.0, 90.0])                          # scores of one row, float32
naive = torch.exp(s) / torch.exp(s).sum()
stable = torch.exp(s - s.max()) / torch.exp(s - s.max()).sum()
print("exp(s):  ", torch.exp(s).tolist())
print("naive:   ", naive.tolist())
print("stable:  ", stable.tolist())
assert torch.isnan(naive).any()
torch.testing.assert_close(stable, torch.softmax(s.double(), -1).float())  # against a float64 softmax

big = 30 * torch.randn(1, 1, 4, 8)                                   # scores of size ~1000 after κ QKᵀ
out_big = attnlab.attention(big, big, big, backend="reference")
assert torch.isfinite(out_big).all()
# float32 scores of size |s| ~ 1e3 carry an error ~|s|·ε ~ 1e-4 in the exponent: relative 1e-4 on the output
exact = attention_by_hand(big.double(), big.double(), big.double())[0].float()
torch.testing.assert_close(out_big, exact, rtol=1e-4, atol=1e-4 * big.abs().max().item())

# %% [markdown]
# ## Why divide by $\sqrt{d}$?
#
# If the components of $q$ and $k$ are independent with mean 0 and variance 1, then
# $q \cdot k = \sum_{i=1}^{d} q_i k_i$ is a sum of $d$ independent terms of variance 1, so
# $\operatorname{Var}(q \cdot k) = d$. Unscaled scores spread as $\sqrt{d}$: for large $d$ each softmax row
# puts almost all its weight on one key, and the softmax's Jacobian $\operatorname{diag}(p) - p p^\top$
# vanishes, so almost no gradient reaches the scores. With $\kappa = 1/\sqrt{d}$ the variance is 1 at any $d$.

# %%
dims = [4, 16, 64, 256] if QUICK else [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
n = 2_000 if QUICK else 20_000
var_raw, var_scaled, top_raw, top_scaled = [], [], [], []
for d in tqdm(dims, desc="d"):
    qd, kd = torch.randn(n, d, dtype=torch.float64), torch.randn(64, d, dtype=torch.float64)
    raw = qd @ kd.T                                                  # (n, 64): each query against 64 keys
    pairs = (qd * torch.randn(n, d, dtype=torch.float64)).sum(-1)   # n independent products q·k
    var_raw.append(pairs.var().item())
    var_scaled.append((pairs / math.sqrt(d)).var().item())
    top_raw.append(torch.softmax(raw, -1).amax(-1).mean().item())  # average largest weight of a row
    top_scaled.append(torch.softmax(raw / math.sqrt(d), -1).amax(-1).mean().item())

fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
a1.loglog(dims, var_raw, "o-", label="Var(q·k)")
a1.loglog(dims, var_scaled, "s-", label="Var(κ q·k), κ = 1/√d")
a1.loglog(dims, dims, "k--", lw=0.8, label="d")
a1.set(xlabel="d", ylabel="variance", title="score variance")
a1.legend()
a2.semilogx(dims, top_raw, "o-", label="unscaled")
a2.semilogx(dims, top_scaled, "s-", label="scaled")
a2.set(xlabel="d", ylabel="mean of max_j W_ij", title="largest weight of a row (64 keys)", ylim=(0, 1.05))
a2.legend()
plt.tight_layout()
plt.show()

# the sample variance of n products has relative standard error sqrt((2 + 6/d) / n) <= 0.05: allow 5 of them
tol = 5 * math.sqrt((2 + 6 / min(dims)) / n)
assert all(abs(vr / d - 1) < tol and abs(vs - 1) < tol for vr, vs, d in zip(var_raw, var_scaled, dims))
assert top_raw[-1] > 0.8 and top_scaled[-1] < 0.3

# %% [markdown]
# The same question, measured more thoroughly (entropy, saturated rows, the gradient that reaches the
# scores), is `attnlab explain scaling`. Its quick version runs in seconds:

# %%
from IPython.display import Image, display

from attnlab.experiments.explain import run_experiment

report = run_experiment("scaling", "explain_scaling", quick=QUICK)
assert report["max_rel_error"] < 0.25      # Var(q·k)/d within 25 % of 1 at every d measured
display(Image(filename=report["files"]["plot"]))

# %% [markdown]
# ## Looking at the weights
#
# The weights $W$ are the attention *map*: row $i$ shows where query $i$ reads from. Here is one head of
# causal attention over 12 positions, returned by `attnlab.attention(..., return_weights=True)`;
# everything above the diagonal is exactly 0.

# %%
out_c, w_c = attnlab.attention(q, k, v, causal=True, return_weights=True)
torch.testing.assert_close(w_c, attention_by_hand(q, k, v, causal)[1])
assert (w_c[..., ~causal] == 0).all()

plt.figure(figsize=(4.2, 3.6))
plt.imshow(w_c[0, 0], cmap="viridis")
plt.colorbar(label="W_ij")
plt.xlabel("key j")
plt.ylabel("query i")
plt.title("causal attention weights, head 0")
plt.show()

# %% [markdown]
# ## Attention is addressing by content
#
# The weights are not fixed: they are computed from the query and the keys, so the same layer reads from
# different places for different inputs. Make one key equal to the query, scaled up, and the weight moves to
# it; change the query and it moves elsewhere: a soft lookup table, $O \approx v_{j^*}$ with
# $j^* = \arg\max_j q \cdot k_j$.

# %%
keys = torch.randn(1, 1, 8, D)
values = torch.eye(8)[None, None]                                   # value j = one-hot j: O reads off W
for target in (2, 5):
    query = 4 * keys[:, :, target:target + 1]                      # query ∝ key `target`
    out_t, w_t = attnlab.attention(query, keys, values, return_weights=True)
    print(f"query ~ key {target}: weights {[round(x, 3) for x in w_t[0, 0, 0].tolist()]}")
    assert w_t[0, 0, 0].argmax().item() == target and w_t[0, 0, 0, target] > 0.9
    torch.testing.assert_close(out_t, w_t)                          # one-hot values: the output is the weights

# %% [markdown]
# `attnlab explain addressing` measures this misconception ("attention is a fixed weighted average of the
# inputs") on a trained model, and `attnlab explain limits` what one attention layer cannot express. Both
# take a minute or two on two cores:
#
# ```bash
# attnlab explain addressing --out runs/addressing   # add --quick for a few-second version
# attnlab explain limits --out runs/limits
# ```
