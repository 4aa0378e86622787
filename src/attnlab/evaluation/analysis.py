"""Attention analysis: what each head does, and what it is worth.

Per head, over the valid query rows ``i`` of a set of texts (``a_ij`` = attention weight, rows
pooled over texts):

* entropy ``H = −Σ_j a_ij log a_ij`` (nats; ``log n`` for a uniform row over n keys, 0 for one key);
* mean attention distance ``Σ_j a_ij |i − j|`` (tokens; 0 for the identity map);
* attention to sinks: ``Σ_{j=0} a_ij`` (the first token) and ``Σ_{j∈special} a_ij`` ([CLS], [SEP], BOS…);
* redundancy: pairwise similarity of head patterns (cosine of the flattened maps, or
  ``1 − JS/ln 2`` of the rows), averaged over texts;
* the loss change when one head is pruned (Michel et al. 2019): that head's output is zeroed
  before the output projection, ``MHA(X) = Concat(m_1 head_1, …, m_H head_H) W_O`` with ``m_h = 0``.
  Pruning is a forward pre-hook on each self-attention's ``out_proj`` (:func:`head_mask`), so no
  model file changes. The loss: next-token cross-entropy for decoder-only LMs (GPT-2, Llama),
  masked-LM cross-entropy on a fixed 15 % mask for ``BertForMaskedLM``, and for an encoder
  without an LM head (``BertModel``, e.g. all-MiniLM-L6-v2) the sentence-embedding change
  ``1 − cos(e_pruned, e)`` of the mean-pooled last hidden state (MiniLM's own pooling).

Encoder–decoders (T5, BART, a ``Seq2SeqTransformer``) are analysed on their encoder's self-attention over the
texts. T5 and BART run whole when a head is pruned: an LM's loss is the cross-entropy of reproducing the text
(the decoder fed it shifted right, teacher-forced), a task head's the KL divergence of its outputs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab._checks import one_of
# the metrics and the pruning, importable from here as before
from attnlab.evaluation.head_metrics import (SIMILARITIES, head_entropy, head_similarity,  # noqa: F401
                                             mean_attention_distance, sink_attention)
from attnlab.evaluation.head_pruning import head_mask, prune_heads, pruning_effect, self_attention_modules  # noqa: F401


# ---- models, texts and losses ---------------------------------------------------------------

@dataclass
class Batch:
    """Encoded texts ``(B, L)``: ``input_ids``, ``attention_mask`` (1 = token, 0 = padding) and
    ``special_tokens_mask`` (True at [CLS], [SEP], BOS…); :func:`attnlab.evaluation.analyze_cli.encode_texts`
    makes one from strings."""

    input_ids: Tensor
    attention_mask: Tensor
    special_tokens_mask: Tensor


def _is_causal_lm(model: nn.Module) -> bool:
    from attnlab.models.causal_lm import DecoderOnlyLM
    return isinstance(model, DecoderOnlyLM)


def _is_bert(model: nn.Module) -> bool:
    from attnlab.models.bert import BertForMaskedLM, BertModel
    return isinstance(model, (BertModel, BertForMaskedLM, _SourceEncoder))


class _SourceEncoder(nn.Module):
    """The encoder stack of a :class:`~attnlab.models.transformer.Seq2SeqTransformer` (a ``multi30k-de-en`` run) seen
    as a BERT-style encoder: ``(input_ids, attention_mask=, output_attentions=)`` -> ``last_hidden_state`` and the
    self-attention weights. Its only submodule is the model's encoder (the decoder's heads are not listed, and
    pruning a head prunes it in the model itself); the embedding is the model's, called as it is."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.encoder = model.encoder
        self.embed_source = model.embed_source  # a bound method: the model is not registered as a submodule

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None, output_attentions: bool = False):
        from types import SimpleNamespace

        pad = None if attention_mask is None else attention_mask == 0  # True = padding
        h, weights = self.encoder(self.embed_source(input_ids), key_padding_mask=pad, need_weights=True)
        return SimpleNamespace(last_hidden_state=h,
                               attentions=tuple(w.self_attn for w in weights) if output_attentions else None)


class _EncoderDecoder(nn.Module):
    """T5 or BART (the LM or a task head) seen through its encoder's self-attention: ``output_attentions`` returns
    the encoder's weights, and the encoder is the only submodule (its heads are the ones listed and pruned, in the
    model itself); the forward runs the whole model: a task head's outputs, or the LM's logits of the text fed to
    the decoder shifted right."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.encoder = model.encoder
        self.whole = [model]  # in a list: not registered, so its decoder's heads are not listed
        self.is_head = hasattr(model.config, "num_labels")

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None, output_attentions: bool = False):
        from types import SimpleNamespace

        from attnlab.models.bart import shift_tokens_right

        model = self.whole[0]
        if output_attentions:
            return SimpleNamespace(attentions=model._encode(input_ids, attention_mask, True)[1])
        if self.is_head:
            return model(input_ids, attention_mask=attention_mask)
        shifted = (model.shift_right(input_ids) if hasattr(model, "shift_right")
                   else shift_tokens_right(input_ids, model.config.decoder_start_token_id))
        return model(input_ids, attention_mask=attention_mask, decoder_input_ids=shifted)


def _is_classifier(model: nn.Module) -> bool:
    """A task head (``.config.num_labels``): on BERT, GPT-2 or Llama (one self-attention stack), or on T5 / BART
    seen through :class:`_EncoderDecoder`."""
    from attnlab.models.heads import _BertHead
    from attnlab.models.seq2seq_heads import _Seq2SeqHead

    if isinstance(model, _EncoderDecoder):
        return model.is_head
    return (isinstance(model, _BertHead) or _is_causal_lm(model) and hasattr(model.config, "num_labels")) \
        and not isinstance(model, _Seq2SeqHead)


def _unsupported(model: nn.Module) -> ValueError:
    return ValueError(f"model must be a BERT-style encoder, a decoder-only LM (GPT-2, Llama), T5, BART or a "
                      f"Seq2SeqTransformer, or a task head on one, got {type(model).__name__}")


def _forward(model: nn.Module, batch: Batch, *, output_attentions: bool = False):
    if _is_causal_lm(model) or _is_bert(model) or _is_classifier(model) or isinstance(model, _EncoderDecoder):
        return model(batch.input_ids, attention_mask=batch.attention_mask, output_attentions=output_attentions)
    raise _unsupported(model)


@torch.no_grad()
def attention_maps(model: nn.Module, batch: Batch) -> list[Tensor]:
    """Each layer's self-attention weights ``(B, H, L, L)`` (padding keys get 0)."""
    return list(_forward(model, batch, output_attentions=True).attentions)


def make_loss(model: nn.Module, batch: Batch, *, mask_token_id: Optional[int] = None, mask_prob: float = 0.15,
              seed: int = 0) -> tuple[str, Callable[[], float]]:
    """``(name, loss())``: the loss whose change measures a head's worth (see the module docstring).

    Raises:
        ValueError: an MLM model without ``mask_token_id``, or an unsupported model.
    """
    from attnlab.models.bert import BertForMaskedLM

    valid = batch.attention_mask.bool()
    if _is_classifier(model):  # how far pruning moves the head's outputs (class distribution, span or tag logits)
        def log_probs() -> list[Tensor]:
            out = _forward(model, batch)
            logits = [out.logits] if hasattr(out, "logits") else [out.start_logits, out.end_logits]
            return [F.log_softmax(x.double(), -1) for x in logits]
        with torch.no_grad():
            ref = log_probs()

        def kl_loss() -> float:
            return sum(F.kl_div(lp, r, log_target=True, reduction="batchmean").item()
                       for lp, r in zip(log_probs(), ref))
        return "KL(unpruned ‖ pruned output distribution) (nats)", torch.no_grad()(kl_loss)
    if _is_causal_lm(model):
        target = batch.input_ids[:, 1:].masked_fill(~valid[:, 1:], -100)

        def lm_loss() -> float:
            logits = _forward(model, batch).logits[:, :-1]  # (B, L-1, V)
            return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100).item()
        return "next-token cross-entropy (nats)", torch.no_grad()(lm_loss)
    if isinstance(model, _EncoderDecoder):  # the LM reproducing the text, teacher-forced
        target = batch.input_ids.masked_fill(~valid, -100)

        def reconstruction_loss() -> float:
            logits = _forward(model, batch).logits  # (B, L, V)
            return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=-100).item()
        return "cross-entropy of reproducing the text (nats, teacher-forced)", torch.no_grad()(reconstruction_loss)
    if isinstance(model, BertForMaskedLM):
        if mask_token_id is None:
            raise ValueError("mask_token_id is required for a masked-LM model (the tokenizer's [MASK] id)")
        g = torch.Generator().manual_seed(seed)
        maskable = valid & ~batch.special_tokens_mask.bool()
        noise = torch.rand(batch.input_ids.shape, generator=g).masked_fill(~maskable, 2.0)
        pick = (noise < mask_prob) | (noise == noise.min(1, keepdim=True).values) & maskable  # ≥ 1 per text
        masked = Batch(batch.input_ids.masked_fill(pick, mask_token_id), batch.attention_mask,
                       batch.special_tokens_mask)
        target = batch.input_ids.masked_fill(~pick, -100)

        def mlm_loss() -> float:
            logits = _forward(model, masked).logits
            return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100).item()
        return "masked-LM cross-entropy (nats, 15 % of tokens)", torch.no_grad()(mlm_loss)
    if _is_bert(model):
        w = valid.unsqueeze(-1).float()

        def embed() -> Tensor:
            h = _forward(model, batch).last_hidden_state  # (B, L, E)
            return (h * w).sum(1) / w.sum(1)  # (B, E) mean pooling
        with torch.no_grad():
            ref = embed()

        def emb_loss() -> float:
            return (1 - F.cosine_similarity(embed().double(), ref.double(), dim=-1)).mean().item()
        return "1 − cos(mean-pooled embedding, unpruned)", torch.no_grad()(emb_loss)
    raise _unsupported(model)


# ---- the whole analysis ---------------------------------------------------------------------

@dataclass
class AttentionAnalysis:
    """Per-head statistics, each ``(layers, H)`` (float64), and the head-similarity matrix.

    Attributes:
        entropy: mean row entropy (nats). distance: mean attention distance (tokens).
        first_token / special_tokens: mean weight on position 0 / on special tokens.
        similarity: ``(N, N)`` pairwise head similarity, ``N = layers · H`` (layer-major).
        similarity_metric: ``"cosine"`` or ``"js"``.
        prune_delta: loss change when each head alone is pruned (None when not measured).
        base_loss, loss_name: the unpruned loss and what it is.
        num_texts, num_tokens: the texts analysed and their (non-padding) tokens.
    """

    entropy: Tensor
    distance: Tensor
    first_token: Tensor
    special_tokens: Tensor
    similarity: Tensor
    similarity_metric: str
    prune_delta: Optional[Tensor] = None
    base_loss: Optional[float] = None
    loss_name: Optional[str] = None
    num_texts: int = 0
    num_tokens: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.entropy.shape)

    def most_similar(self) -> tuple[Tensor, Tensor]:
        """Per head, the most similar *other* head of the same layer: ``(index, similarity)`` (layers, H)."""
        Ly, H = self.shape
        sim = self.similarity.view(Ly, H, Ly, H).diagonal(dim1=0, dim2=2).permute(2, 0, 1).clone()  # (Ly, H, H)
        sim.diagonal(dim1=1, dim2=2).fill_(-math.inf)
        best = sim.max(-1)
        return best.indices, best.values

    def rows(self) -> list[dict]:
        """One dict per head: layer, head, entropy, distance, first, special, similar_head, similarity, prune_delta."""
        idx, val = self.most_similar()
        Ly, H = self.shape
        out = []
        for l in range(Ly):
            for h in range(H):
                row = {"layer": l, "head": h, "entropy": float(self.entropy[l, h]),
                       "distance": float(self.distance[l, h]), "first": float(self.first_token[l, h]),
                       "special": float(self.special_tokens[l, h]),
                       "similar_head": int(idx[l, h]) if H > 1 else None,
                       "similarity": float(val[l, h]) if H > 1 else None}
                if self.prune_delta is not None:
                    row["prune_delta"] = float(self.prune_delta[l, h])
                out.append(row)
        return out

    def to_dict(self) -> dict:
        """JSON-ready: the per-head rows, the similarity matrix and the metadata."""
        return {"layers": self.shape[0], "heads": self.shape[1], "num_texts": self.num_texts,
                "num_tokens": self.num_tokens, "similarity_metric": self.similarity_metric,
                "loss_name": self.loss_name, "base_loss": self.base_loss, "rows": self.rows(),
                "similarity": self.similarity.tolist()}


def analyze(model: nn.Module, batch: Batch, *, similarity: str = "cosine", prune: bool = True,
            mask_token_id: Optional[int] = None, seed: int = 0) -> AttentionAnalysis:
    """Analyse every self-attention head of ``model`` on the encoded texts ``batch``.

    Args:
        model: a BERT-style encoder (``BertModel``, ``BertForMaskedLM``), a decoder-only LM, a classification /
            QA head on either (pruning measured by the KL divergence of its outputs), T5 or BART or a task head on
            one (the encoder's self-attention; see the module docstring), or a ``Seq2SeqTransformer`` (its
            encoder's self-attention, pruning measured on the mean-pooled encoder output).
        batch: the encoded texts (:class:`Batch`).
        similarity: ``"cosine"`` or ``"js"`` (see :func:`head_similarity`).
        prune: also measure the loss change of pruning each head (``layers · H`` forward passes).
        mask_token_id: the [MASK] id, for a masked-LM model's loss.
        seed: seed of the masked-LM mask.

    Raises:
        ValueError: unsupported model, bad ``similarity`` or inputs.
    """
    one_of("similarity", similarity, SIMILARITIES)
    if not isinstance(batch, Batch):
        raise TypeError(f"batch must be an attnlab.evaluation.analysis.Batch, got {type(batch).__name__}")
    from attnlab.models.seq2seq_heads import t5_or_bart
    from attnlab.models.transformer import Seq2SeqTransformer

    whole, was_training = model, model.training
    whole.eval()
    if isinstance(model, Seq2SeqTransformer):  # its source side: the encoder's self-attention
        model = _SourceEncoder(model)
    elif t5_or_bart(model):
        model = _EncoderDecoder(model)
    try:
        maps = [a.double() for a in attention_maps(model, batch)]  # layers × (B, H, L, L)
        qm, special = batch.attention_mask.bool(), batch.special_tokens_mask.bool()
        stack = lambda f: torch.stack([f(a) for a in maps])  # noqa: E731  (layers, H)
        result = AttentionAnalysis(
            entropy=stack(lambda a: head_entropy(a, qm)), distance=stack(lambda a: mean_attention_distance(a, qm)),
            first_token=stack(lambda a: sink_attention(a, None, qm)),
            special_tokens=stack(lambda a: sink_attention(a, special, qm)),
            similarity=head_similarity(maps, qm, metric=similarity), similarity_metric=similarity,
            num_texts=int(batch.input_ids.shape[0]), num_tokens=int(qm.sum()))
        if prune:
            result.loss_name, loss = make_loss(model, batch, mask_token_id=mask_token_id, seed=seed)
            result.base_loss, result.prune_delta = pruning_effect(model, loss)
    finally:
        whole.train(was_training)
    return result


def plot_analysis(result: AttentionAnalysis, path, *, title: str = "") -> Path:
    """Heatmaps (layers × heads) of every statistic and the head-similarity matrix, one PNG (atomic write)."""
    from matplotlib.figure import Figure  # no pyplot: a notebook's backend is left alone

    from attnlab._io import atomic_write

    panels = [("entropy (nats)", result.entropy), ("mean distance (tokens)", result.distance),
              ("weight on first token", result.first_token), ("weight on special tokens", result.special_tokens)]
    if result.prune_delta is not None:
        panels.append((f"Δ loss when pruned\n{result.loss_name}", result.prune_delta))
    fig = Figure(figsize=(15, 8.5))
    axes = fig.subplots(2, 3)
    for ax, (name, t) in zip(axes.flat, panels):
        im = ax.imshow(t.float().numpy(), cmap="viridis", aspect="auto")
        ax.set_title(name, fontsize=10)
        ax.set_xticks(range(0, t.shape[1], max(1, t.shape[1] // 12)))
        ax.set_yticks(range(0, t.shape[0], max(1, t.shape[0] // 12)))
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    for ax in list(axes.flat)[len(panels):5]:
        ax.axis("off")
    ax = axes.flat[5]
    im = ax.imshow(result.similarity.float().numpy(), cmap="magma", vmin=0, vmax=1)
    ax.set_title(f"head similarity ({result.similarity_metric}), layer-major", fontsize=10)
    H = result.shape[1]
    ticks = list(range(0, result.similarity.shape[0], H))
    ax.set_xticks(ticks, labels=[f"L{t // H}" for t in ticks])
    ax.set_yticks(ticks, labels=[f"L{t // H}" for t in ticks])
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    return path
