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
# # Building and training a Transformer
#
# The original Transformer (Vaswani et al. 2017) is an encoder–decoder. The encoder reads the source tokens with
# self-attention; the decoder writes the target one token at a time, with causal self-attention over what it has
# written and *cross-attention* over the encoder's output (the "memory"):
#
# $$x^{src}_0 = E_{src}[s]\sqrt{d} + PE, \qquad M = \operatorname{Encoder}(x^{src}_0), \qquad
# \text{logits} = W_{out}\, \operatorname{Decoder}(x^{tgt}_0, M),$$
#
# $$\operatorname{CrossAttn}(Y, M) = \operatorname{softmax}\!\Big(\tfrac{(Y W_Q)(M W_K)^\top}{\sqrt{d_h}}\Big) M W_V
# \quad\text{(queries from the target, keys and values from the source).}$$
#
# This chapter builds `attnlab.models.Seq2SeqTransformer` from a config, follows the shapes through one step,
# writes out label smoothing, trains the `multi30k-de-en` recipe (German → English), decodes greedily and with
# beam search, scores BLEU with sacreBLEU, and looks at the cross-attention alignment.

# %%
import json
import os

import matplotlib.pyplot as plt
import torch
from tqdm.auto import tqdm                                            # a progress bar for the longer loops

import attnlab
from attnlab.models.config import TransformerConfig
from attnlab.models.transformer import Seq2SeqTransformer

QUICK = os.environ.get("ATTNLAB_TUTORIAL_QUICK") == "1"
torch.manual_seed(0)
print("attnlab from", attnlab.__file__)

# %% [markdown]
# ## A model from a config, and the shapes through one step
#
# A `TransformerConfig` names the sizes; the model adds embeddings, positions (sinusoidal here) and the output
# projection. Teacher forcing feeds the decoder the target shifted right: it reads $y_{<t}$ and predicts $y_t$.

# %%
cfg = TransformerConfig(src_vocab_size=50, tgt_vocab_size=60, dim=32, num_heads=4, ffn_dim=64,
                        num_encoder_layers=2, num_decoder_layers=2, dropout=0.0, pad_id=0)
model = Seq2SeqTransformer(cfg).eval()
src = torch.randint(1, 50, (2, 7))                      # (B, S)
tgt = torch.randint(1, 60, (2, 5))                      # (B, T)
src[1, 5:] = 0                                          # the 2nd source is padded: pad_id masks it out

memory = model.encode(src)                              # (B, S, E)
logits = model(src, tgt)                                # (B, T, V_tgt)
print("src", tuple(src.shape), "-> memory", tuple(memory.shape), "; tgt", tuple(tgt.shape),
      "-> logits", tuple(logits.shape), ";", sum(p.numel() for p in model.parameters()), "parameters")

# the generation path (encode once, then decode) computes the same logits
torch.testing.assert_close(model.decode(tgt, memory, attention_mask=(src != 0).long()), logits)
# causal: changing the last target token leaves the logits of the earlier positions unchanged
tgt2 = tgt.clone()
tgt2[:, -1] = 1
torch.testing.assert_close(model(src, tgt2)[:, :-1], logits[:, :-1])
# padding: changing a padded source token changes nothing
src2 = src.clone()
src2[1, 6] = 7
torch.testing.assert_close(model(src2, tgt, src_key_padding_mask=src == 0)[1], logits[1])

# %% [markdown]
# With `output_attentions=True` the model returns every weight map: encoder self-attention `(B, H, S, S)`, decoder
# self-attention `(B, H, T, T)` (lower triangular) and cross-attention `(B, H, T, S)`; each row is a distribution.

# %%
out = model(src, tgt, output_attentions=True)
for name in ("encoder_attentions", "decoder_attentions", "cross_attentions"):
    print(f"{name:19s}", len(getattr(out, name)), "layers of", tuple(getattr(out, name)[0].shape))
cross = out.cross_attentions[0]
torch.testing.assert_close(cross.sum(-1), torch.ones(cross.shape[:-1]))
assert (cross[1, :, :, 5:] == 0).all()                 # no weight on the padded source positions
assert (torch.triu(out.decoder_attentions[0], diagonal=1) == 0).all()

# %% [markdown]
# ## Label smoothing
#
# Cross-entropy pushes $p(y_t)$ to 1, i.e. the logits to infinity. Label smoothing (Szegedy et al. 2016) trains
# against a target that keeps a share $\varepsilon$ spread evenly over the $V$ classes:
#
# $$\mathcal{L} = (1-\varepsilon)\,(-\log p_{y}) + \varepsilon\,\frac{1}{V}\sum_{c=1}^{V} (-\log p_c).$$
#
# The recipe uses $\varepsilon = 0.1$ (`attnlab.training.losses.token_cross_entropy`). We check it against the formula
# written out, then plot the loss of one token as a function of the probability the model gives the right class
# (the rest spread evenly): without smoothing the minimum is at $p = 1$; with it, at
# $p = 1 - \varepsilon + \varepsilon/V$.

# %%
from attnlab.training.losses import token_cross_entropy

eps, V = 0.1, 60
y = tgt[:, 1:]
logp = torch.log_softmax(logits[:, :-1], dim=-1)        # (B, T-1, V)
by_hand = ((1 - eps) * -logp.gather(-1, y[..., None])[..., 0] + eps * -logp.mean(-1)).mean()
torch.testing.assert_close(token_cross_entropy(logits[:, :-1], y, label_smoothing=eps), by_hand)

p = torch.linspace(0.05, 0.999, 400)
logp_right, logp_other = p.log(), ((1 - p) / (V - 1)).log()
for e in (0.0, 0.1):
    loss = (1 - e) * -logp_right + e * -(logp_right + (V - 1) * logp_other) / V
    plt.plot(p, loss, label=f"ε = {e}: minimum at p = {p[loss.argmin()]:.3f}")
plt.xlabel("p(right token)")
plt.ylabel("loss of one token (nats)")
plt.legend()
plt.title(f"label smoothing, V = {V}")
plt.show()

# %% [markdown]
# ## Training the translation recipe
#
# `multi30k-de-en` trains a 3+3-layer pre-norm Transformer (width 256, 4 heads) on Multi30k (29,000 German–English
# image captions) with one joint BPE vocabulary, token-bucketed batches, AdamW with warmup and cosine decay and
# label smoothing; at the end it averages the last checkpoints and decodes val and test with beam search
# (sacreBLEU on detokenised, cased text). From the command line:
#
# ```bash
# attnlab train multi30k-de-en --out runs/m30k                 # the default recipe: ~30 minutes on 2 cores
# attnlab train multi30k-de-en --preset tiny --out runs/tiny   # seconds
# attnlab train multi30k-de-en --help                          # every setting (--set key=value)
# ```
#
# Here we call the same thing from Python. The data comes from `ATTNLAB_DATA_DIR` or is downloaded.
# **Quick mode** trains the `tiny` preset (a 34k-parameter model, 400 sentence pairs, 30 steps): it learns the
# most frequent tokens and nothing more, so its BLEU is about 0. **Full mode** trains the default model for
# 300 steps (5–10 minutes on 2 cores; a sixth of the default recipe's 1,800 steps). One such run, measured here:
# sacreBLEU 13.7 on the first 300 test_2016_flickr sentences (beam 5, averaged checkpoints), and on 200 val
# sentences 14.4 greedy / 19.1 with 4 beams below. The default recipe itself targets sacreBLEU ≥ 35 on
# test_2016_flickr within 30 minutes on 2 cores (the target it is registered with, printed below); run it from
# the command line above for the full result. Steps, not the clock, decide the model.

# %%
from attnlab.training.recipes import get_recipe, load_run, run_recipe

print("the default recipe's target:", get_recipe("multi30k-de-en").targets["default"])

run_dir = "m30k_run"
if QUICK:
    metrics = run_recipe("multi30k-de-en", out=run_dir, preset="tiny", overrides=dict(progress=False))
else:
    metrics = run_recipe("multi30k-de-en", out=run_dir, overrides=dict(
        max_steps=300, warmup_steps=100, max_seconds=None, eval_every=100, checkpoint_every=100,
        final_max_batches=3))  # minutes: the progress bar shows the steps
print({k: metrics[k] for k in ("steps", "parameters", "train_pairs", "val_loss", "bleu", "chrf", "num_beams")})

# %%
records = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
train = [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
val = [(r["step"], r["val_loss"]) for r in records if r["kind"] == "eval"]
plt.plot(*zip(*train), label="train loss (smoothed targets)")
plt.plot(*zip(*val), "o-", label="val loss (no smoothing)")
plt.xlabel("step")
plt.ylabel("cross-entropy (nats/token)")
plt.legend()
plt.show()
assert val[-1][1] < val[0][1] or len(val) == 1 and train[-1][1] < train[0][1]

# %% [markdown]
# ## Decoding: greedy and beam search
#
# Greedy decoding takes $\arg\max_v p(v \mid y_{<t}, x)$ at every step. Beam search keeps the $k$ best prefixes by
# total log-probability and ranks finished ones by $\sum_t \log p(y_t \mid y_{<t}, x) / |y|^{\alpha}$ (length penalty
# $\alpha$). Both run on the KV cache (`Seq2SeqTransformer.generate`); `translate` tokenises, batches and detokenises.

# %%
from attnlab.data.datasets import load_parallel
from attnlab.data.tokenizers import TextTokenizer
from attnlab.evaluation.metrics import bleu, chrf
from attnlab.training.recipes.multi30k import translate

run = load_run(run_dir)
tok = TextTokenizer.load(f"{run_dir}/tokenizer.json")
pairs = load_parallel("val")[: 16 if QUICK else 200]
german = [de for de, _ in pairs]
greedy, beam = [], []
for i in tqdm(range(0, len(german), 50), desc="translating, 50 sentences a step"):
    greedy += translate(run.model, tok, german[i:i + 50], num_beams=1)
    beam += translate(run.model, tok, german[i:i + 50], num_beams=4)
for de, en, g, b in list(zip(german, [en for _, en in pairs], greedy, beam))[:3]:
    print(f"DE     {de}\nREF    {en}\ngreedy {g[:100]}\nbeam 4 {b[:100]}\n")

# %% [markdown]
# BLEU (Papineni et al. 2002) is the geometric mean of the clipped $n$-gram precisions $p_1..p_4$ pooled over the
# corpus, times a brevity penalty: $\text{BLEU} = \min(1, e^{1 - r/c}) \cdot \exp(\tfrac14 \sum_n \log p_n)$.
# `attnlab.evaluation.metrics.bleu` is sacreBLEU's, whose signature records the tokeniser and settings, so the
# score can be compared with published ones. A hypothesis equal to its reference scores 100.

# %%
refs = [en for _, en in pairs]
for name, hyps in (("greedy", greedy), ("beam 4", beam)):
    print(f"{name}: BLEU {bleu(hyps, refs).score:5.2f}  chrF {chrf(hyps, refs).score:5.2f}  ({len(refs)} sentences)")
print(bleu(refs, refs))
assert abs(bleu(refs, refs).score - 100.0) < 1e-9                # exp(mean log 1) in float64

# %% [markdown]
# ## Where the decoder looks: the cross-attention alignment
#
# Each decoder position's cross-attention row is a distribution over the source tokens. Averaged over heads,
# a trained translation model shows a rough alignment (English words looking at the German words they translate);
# in quick mode the model is too small and too briefly trained for that, and the map is nearly uniform.

# %%
de, en = pairs[0]
s_ids = torch.tensor([tok.encode(de, add_special_tokens=True)])
t_ids = torch.tensor([tok.encode(en, add_special_tokens=True)])[:, :-1]     # decoder input: <s> y_1 .. y_{T-1}
with torch.no_grad():
    res = run.model(s_ids, t_ids, output_attentions=True)
src_tokens = [tok.id_to_token(i) for i in s_ids[0].tolist()]
tgt_tokens = [tok.id_to_token(i) for i in t_ids[0].tolist()]
A = res.cross_attentions[-1][0].mean(0)                                      # last layer, mean of heads: (T, S)
plt.figure(figsize=(7, 5))
plt.imshow(A, cmap="Blues")
plt.xticks(range(len(src_tokens)), src_tokens, rotation=90)
plt.yticks(range(len(tgt_tokens)), tgt_tokens)
plt.xlabel("source (German)")
plt.ylabel("decoder input (English)")
plt.title("cross-attention, last layer, mean over heads")
plt.colorbar()
plt.show()

# %% [markdown]
# The same maps in the interactive view: the cross-attention tab draws one line per head from each target token
# to the source tokens it reads.

# %%
from attnlab.viz import head_view

head_view(encoder_attentions=res.encoder_attentions, decoder_attentions=res.decoder_attentions,
          cross_attentions=res.cross_attentions, encoder_tokens=src_tokens, decoder_tokens=tgt_tokens)

# %% [markdown]
# ## Measured questions for this chapter
#
# * `attnlab explain cross-lengths`: how cross-attention joins two sequences of different lengths — each target
#   position gets one distribution over however many source positions there are, and the output length is the
#   target's.
# * `attnlab explain parallel`: why attention replaced recurrence although it does $O(n^2)$ work to an RNN's
#   $O(n)$ — in training, all positions of a sequence are computed at once instead of one after another.
#
# Each prints a short report and writes a plot (`--quick` runs in seconds).
