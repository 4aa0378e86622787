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
# # Efficient attention
#
# Exact attention over $L$ tokens computes $L^2$ scores, and the textbook implementation stores the
# $L \times L$ weight matrix, for every head and layer. There are three ways out, and this chapter tries each:
#
# 1. **compute fewer scores**: a sparse mask (sliding window, strided, BigBird) keeps $O(L\,w)$ of them;
# 2. **change the kernel**: linear attention replaces $e^{q \cdot k}$ by $\phi(q) \cdot \phi(k)$ and never forms the
#    matrix, $O(L)$ time and memory, but it is another model (or an approximation);
# 3. **keep the exact formula but never store the matrix**: the `tiled` backend (FlashAttention's online softmax)
#    computes the same numbers block by block in $O(L)$ memory.

# %%
import math
import os
import time

import matplotlib.pyplot as plt
import torch
from tqdm.auto import tqdm                                            # a progress bar for the longer loops

import attnlab
from attnlab import bigbird_mod, favor_projection, fixed_mod, linear_attention, sliding_window_mod, strided_mod
from attnlab.functional.masks import evaluate_mask_mod

QUICK = os.environ.get("ATTNLAB_TUTORIAL_QUICK") == "1"
_ = torch.manual_seed(0)  # (it returns the generator: `_ =` keeps its repr out of the output)

# %% [markdown]
# ## Sparse masks: which scores to compute
#
# A mask with $n$ visible pairs costs $O(n)$ work on a backend that skips what the mask empties (`tiled` and
# `flex` skip whole blocks). Patterns from the literature, as FlexAttention-style `mask_mod(b, h, q_idx, kv_idx)`:
#
# * **sliding window** $w$ (Longformer, Mistral): $0 \le i - j < w$;
# * **strided** (Sparse Transformer, Child et al. 2019), stride $\ell$: the previous $\ell$ positions, plus every
#   $\ell$-th one before: $0 \le i - j \le \ell$ or $(i - j) \bmod \ell = 0$;
# * **fixed** (same paper), block $\ell$: the query's own block plus the last cell of every block;
# * **BigBird** (Zaheer et al. 2020), by blocks: a few global blocks that see and are seen by all, a window of
#   neighbouring blocks, and a few random blocks per row.

# %%
L, block = 128, 8
patterns = {
    "sliding window (w=8)": sliding_window_mod(8, causal=True),
    "strided (ℓ=8)": strided_mod(8),
    "fixed (ℓ=8)": fixed_mod(8),
    "BigBird (block 8)": bigbird_mod(block, seq_len=L, num_global_blocks=1, window_blocks=3, num_random_blocks=1),
}
fig, axes = plt.subplots(1, 4, figsize=(14, 3.6))
for ax, (name, mod) in zip(axes, patterns.items()):
    allowed = evaluate_mask_mod(mod, 1, 1, L, L, None)[0, 0]          # (L, L) bool, True = computed
    ax.imshow(allowed, cmap="Blues")
    ax.set(title=f"{name}\n{allowed.float().mean():.0%} of the scores", xlabel="key j", ylabel="query i")
plt.tight_layout()
plt.show()

# %% [markdown]
# Whatever the pattern, the result must be softmax attention with that mask. We check every pattern against the
# readable `reference` backend given the same mask as a dense boolean matrix:

# %%
q, k, v = (torch.randn(2, 4, L, 16) for _ in range(3))
for name, mod in patterns.items():
    dense = evaluate_mask_mod(mod, 1, 1, L, L, None)
    fast = attnlab.attention(q, k, v, mask_mod=mod)                  # auto: the tiled backend, block-sparse
    torch.testing.assert_close(fast, attnlab.attention(q, k, v, mask=dense, backend="reference"))
w = 8
torch.testing.assert_close(attnlab.attention(q, k, v, window=w, causal=True),
                           attnlab.attention(q, k, v, mask_mod=patterns["sliding window (w=8)"]))
print("every sparse pattern equals the reference with the same dense mask")

# %% [markdown]
# ## Linear attention: change the kernel
#
# Softmax attention weighs value $j$ by $\operatorname{sim}(q_i, k_j) = e^{\kappa\, q_i \cdot k_j}$. With a kernel
# $\operatorname{sim}(q, k) = \phi(q)^\top \phi(k)$ for a feature map $\phi \ge 0$ (Katharopoulos et al. 2020), the sums
# can be reordered:
#
# $$o_i = \frac{\sum_j \phi(q_i)^\top \phi(k_j)\, v_j}{\sum_j \phi(q_i)^\top \phi(k_j)}
#       = \frac{\phi(q_i)^\top S}{\phi(q_i)^\top z}, \qquad S = \sum_j \phi(k_j) v_j^\top,\quad z = \sum_j \phi(k_j).$$
#
# $S$ is $D \times D_v$, whatever $L$: $O(L)$ time and memory. With $\phi(x) = \operatorname{elu}(x) + 1$ it is a
# different model, not an approximation of softmax. We write the formula out and check `linear_attention`:

# %%
phi = lambda x: torch.nn.functional.elu(x) + 1                       # noqa: E731
S = phi(k).transpose(-2, -1) @ v                                      # (B, H, D, Dv): no L × L anywhere
z = phi(k).sum(-2, keepdim=True)                                      # (B, H, 1, D)
by_hand = (phi(q) @ S) / (phi(q) * z).sum(-1, keepdim=True)
torch.testing.assert_close(linear_attention(q, k, v, feature_map="elu"), by_hand)
exact = attnlab.attention(q, k, v)
print("relative difference elu-linear vs softmax:", ((by_hand - exact).norm() / exact.norm()).item())

# %% [markdown]
# **FAVOR+** (Performer, Choromanski et al. 2021) picks random features whose expectation *is* the softmax kernel:
# $\phi(x) = e^{W x' - \|x'\|^2/2} / \sqrt{m}$, $x' = x\, D^{-1/4}$, with $m$ orthogonal Gaussian rows in $W$, so
# $\mathbb{E}[\phi(q)^\top \phi(k)] = e^{q \cdot k / \sqrt{D}}$. It is an unbiased estimate of each score, and the
# output's error falls like $1/\sqrt{m}$ (averaged here over a few draws of $W$):

# %%
qs, ks = 0.5 * q, 0.5 * k                                             # moderate scores: the regime FAVOR+ targets
exact = attnlab.attention(qs, ks, v)
features = [8, 32, 128, 512] if QUICK else [8, 16, 32, 64, 128, 256, 512, 1024, 2048]
draws = 3 if QUICK else 10
errors = []
for m in tqdm(features, desc="random features m"):
    errs = [((linear_attention(qs, ks, v, feature_map="favor+",
                               projection=favor_projection(m, 16, generator=torch.Generator().manual_seed(s)))
              - exact).norm() / exact.norm()).item() for s in range(draws)]
    errors.append(sum(errs) / draws)

plt.figure(figsize=(5, 3.3))
plt.loglog(features, errors, "o-", label="FAVOR+")
plt.loglog(features, [errors[0] * math.sqrt(features[0] / m) for m in features], "k--", lw=0.8, label="∝ 1/√m")
plt.xlabel("random features m")
plt.ylabel("‖out − exact‖ / ‖exact‖")
plt.legend()
plt.title("FAVOR+ approaches softmax attention")
plt.show()
print({m: round(e, 3) for m, e in zip(features, errors)})
assert all(a > b for a, b in zip(errors, errors[1:])) and errors[-1] < errors[0] / 4

# %% [markdown]
# ## Exact, in O(L) memory: the tiled backend
#
# The softmax of a row can be computed in one pass over blocks of keys, keeping a running maximum $m$, a running
# sum $\ell$ and a running output (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022). For each key block
# with scores $s$:
#
# $$m' = \max(m, \max_j s_j), \quad \ell \leftarrow e^{m - m'}\ell + \sum_j e^{s_j - m'}, \quad
#   \text{acc} \leftarrow e^{m - m'}\,\text{acc} + \sum_j e^{s_j - m'} v_j, \quad m \leftarrow m'.$$
#
# At the end $o = \text{acc} / \ell$ exactly, and $\text{LSE} = m + \log \ell$ is kept so the backward pass can
# recompute each block's weights $e^{s - \text{LSE}}$ instead of storing them. Same numbers as `reference`,
# values and gradients:

# %%
L2 = 512 if QUICK else 2048
q2, k2, v2 = (torch.randn(1, 4, L2, 32, dtype=torch.float64, requires_grad=True) for _ in range(3))
grads = {}
for backend in tqdm(("reference", "tiled"), desc="backend"):
    out = attnlab.attention(q2, k2, v2, causal=True, backend=backend)
    grads[backend] = (out, *torch.autograd.grad(out.square().sum(), (q2, k2, v2)))
for a, b in zip(grads["reference"], grads["tiled"]):
    torch.testing.assert_close(a, b)                                  # float64 tolerances

out, lse = attnlab.attention(q2.detach(), k2.detach(), v2.detach(), causal=True, return_lse=True)
rows = attnlab.attention_weights(q2.detach(), k2.detach(), lse=lse, rows=[0, L2 // 2, L2 - 1], causal=True)
print("weights of 3 rows recovered from the log-sum-exp:", tuple(rows.shape), "row sums", rows.sum(-1)[0, 0].tolist())

# %% [markdown]
# ### What it saves, and what it costs (this machine)
#
# Training keeps what the backward pass needs. We count the bytes autograd saves for one causal attention call,
# and time the forward pass, as the sequence grows. Memory is a property of the algorithm (the same on any
# machine): `reference` keeps the $L \times L$ weights, so 4× per doubling; `tiled` and `sdpa` keep $O(L)$ (their
# lines coincide: both save $q, k, v$, the output and the log-sum-exp).
# The times are measured on whatever machine runs this notebook, a few repeats each: read the slopes, not the
# numbers. `sdpa` is PyTorch's fused kernel; `tiled` is the same algorithm, in C++ for the masks and mods it
# knows (causal, windows, documents, BigBird blocks, ALiBi, softcap: `src/attnlab/csrc/flash_*.cpp`) and in readable
# PyTorch for any other `mask_mod`/`score_mod`.

# %%
def saved_mib(fn):
    """MiB of the distinct tensors autograd saves for the backward of fn()."""
    sizes = {}

    def pack(t):
        sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(sizes.values()) / 2 ** 20


def forward_ms(fn, repeat=5):
    """The fastest of `repeat` timed calls after a warm-up: the one least disturbed by other work."""
    with torch.no_grad():
        fn()
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return 1e3 * min(times)


lengths = [256, 512, 1024] if QUICK else [256, 512, 1024, 2048, 4096]
methods = {
    "reference": lambda q, k, v: attnlab.attention(q, k, v, causal=True, backend="reference"),
    "tiled": lambda q, k, v: attnlab.attention(q, k, v, causal=True, backend="tiled"),
    "sdpa": lambda q, k, v: attnlab.attention(q, k, v, causal=True, backend="sdpa"),
    "linear (elu)": lambda q, k, v: linear_attention(q, k, v, causal=True),
}
memory = {name: [] for name in methods}
speed = {name: [] for name in methods}
for n in tqdm(lengths, desc="sequence length"):
    x = [torch.randn(1, 4, n, 32, requires_grad=True) for _ in range(3)]
    for name, f in methods.items():
        memory[name].append(saved_mib(lambda: f(*x)))
        speed[name].append(forward_ms(lambda: f(*x)))

fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.6))
for name in methods:
    a1.loglog(lengths, memory[name], "o-", label=name)
    a2.loglog(lengths, speed[name], "o-", label=name)
a1.set(xlabel="sequence length L", ylabel="MiB saved for backward", title="memory (4 heads, d = 32)")
a2.set(xlabel="sequence length L", ylabel="forward ms (best of 5)", title="time on this machine")
a1.legend()
plt.tight_layout()
plt.show()

growth = {name: memory[name][-1] / memory[name][-2] for name in methods}
print("memory growth per doubling of L:", {n: round(g, 2) for n, g in growth.items()})
assert growth["reference"] > 3.5 and growth["tiled"] < 2.5 and growth["sdpa"] < 2.5

# %% [markdown]
# Two questions of this chapter are measured by `attnlab explain` (a minute or two each; `--quick` in seconds):
#
# * `attnlab explain linear`: time and memory of exact attention, linear attention and a GRU as the sequence
#   grows, and where they cross;
# * `attnlab explain parallel`: why attention replaced recurrence although it does $O(L^2)$ work to an RNN's
#   $O(L)$: every position is computed at once, while a recurrence must take $L$ steps one after another.
