"""``mlm``: BERT masked-language-model (+ next-segment) pre-training on the English side of Multi30k.

Data: the English captions of Multi30k (29,000 train / 1,014 val), a WordPiece vocabulary trained on
the training captions with ``tokenizers`` (``tokenizer.json`` in the run folder). Masking as BERT
(Devlin et al. 2019): every non-special token is chosen with probability ``mask_prob`` (15 %); a
chosen token becomes ``[MASK]`` 80 % of the time, a random token 10 %, stays 10 %, and the model
predicts the original at the chosen positions only::

    L_MLM = −(1/|M|) Σ_{i∈M} log p(x_i | x̃),   ppl = exp(L_MLM),   accuracy = mean_{i∈M} [argmax p_i = x_i]

Next-sentence prediction (``nsp``, BertForPreTraining's head): Multi30k captions describe unrelated
images, so consecutive captions are no sentence pairs; instead each caption is cut at a random
word piece into segments A and B, and half of the time B is replaced by the tail of a random other
caption: ``[CLS] A [SEP] B [SEP]`` with token types 0/1, label 0 = B continues A, 1 = random
(HF's convention); the loss adds ``L_NSP`` (cross-entropy of the two classes).

Masks and pairs are drawn afresh every step (dynamic masking) from the batches' own generator, so
a resumed run sees exactly the batches of an uninterrupted one. The validation batches are drawn
once with a fixed seed; the evaluation reports ``val_loss`` (= ``L_MLM``), ``val_ppl``,
``val_accuracy`` and, with NSP, ``val_nsp_loss`` and ``val_nsp_accuracy``, in fp32.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab._checks import check_int
from attnlab.data.batching import GeneratorState, pad_batch
from attnlab.data.datasets import load_sentences
from attnlab.data.tokenizers import TextTokenizer, train_wordpiece
from attnlab.evaluation.metrics import perplexity
from attnlab.models.bert import BertConfig, BertForMaskedLM, BertForPreTraining
from attnlab.training.checkpoint import latest_checkpoint
from attnlab.training.distributed import DistInfo
from attnlab.training.losses import token_cross_entropy
from attnlab.training.recipes import Built, Recipe, register
from attnlab.training.recipes.multi30k import run_tokenizer
from attnlab.training.trainer import TrainConfig

__all__ = ["MLMSettings", "PRESETS", "MLMBatches", "mask_tokens", "mlm_loss", "evaluate_mlm", "build"]


@dataclass
class MLMSettings(TrainConfig):
    """The default preset (1,500 steps: ~11 minutes on 2 cores in fp32; see docs/performance.md); every
    :class:`TrainConfig` field is a setting too.

    Data: a WordPiece vocabulary of ``vocab_size`` (lower-cased when ``lowercase``), sequences cut to
    ``max_len`` pieces, ``batch_size`` sequences per step (the global batch under DDP);
    ``train_sentences`` keeps only the first N captions (smoke runs); ``eval_batches`` fixed val batches.
    Model: BERT with ``num_layers`` × (``num_heads`` heads, ``hidden_size`` wide, ``intermediate_size``
    feed-forward), ``dropout`` on hidden states and attention weights; ``nsp`` adds the next-segment head.
    No wall-clock stop (``max_seconds``): a stop mid-schedule leaves the learning rate mid-cosine and the model worse;
    a slower machine takes longer for the same model.
    """

    vocab_size: int = 6000
    lowercase: bool = True
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 1024
    dropout: float = 0.1
    max_len: int = 64
    batch_size: int = 64
    mask_prob: float = 0.15
    nsp: bool = True
    train_sentences: Optional[int] = None
    eval_batches: int = 16
    # trainer defaults for this recipe
    max_steps: int = 1500
    lr: float = 1e-3
    min_lr: float = 1e-5
    warmup_steps: int = 150
    betas: tuple[float, float] = (0.9, 0.98)
    weight_decay: float = 0.01
    clip: float = 1.0
    dtype: str = "auto"  # bf16 where the CPU computes it natively (and faster), else fp32
    eval_every: int = 250
    checkpoint_every: int = 500
    log_every: int = 50
    max_seconds: Optional[float] = None  # no wall-clock stop: a slower CPU takes longer, not a cut-off schedule

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size", "batch_size",
                     "eval_batches"):
            check_int(name, getattr(self, name), 1)
        check_int("max_len", self.max_len, 5)  # room for [CLS] A [SEP] B [SEP]
        check_int("train_sentences", self.train_sentences, 2, optional=True)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if not 0.0 < self.mask_prob < 1.0:
            raise ValueError(f"mask_prob must be in (0, 1), got {self.mask_prob!r}")


PRESETS = {
    "tiny": dict(vocab_size=300, hidden_size=64, num_layers=1, num_heads=2, intermediate_size=128, dropout=0.0,
                 max_len=32, batch_size=64, train_sentences=2000, eval_batches=4, max_steps=150, lr=2e-3,
                 min_lr=2e-4, warmup_steps=10, dtype="fp32", eval_every=50, checkpoint_every=50, log_every=25,
                 max_seconds=None),
}


def mask_tokens(ids: Tensor, *, special: Tensor, mask_id: int, vocab_size: int, first_normal: int,
                mask_prob: float, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """BERT's 80/10/10 masking of ``ids (B, L)``; positions where ``special (B, L)`` is True are never chosen.

    Returns:
        ``(inputs (B, L), labels (B, L))``: labels hold the original id at the chosen positions, -100 elsewhere;
        random replacements are drawn from the ordinary ids ``[first_normal, vocab_size)``.
    """
    u = torch.rand(ids.shape, generator=generator)  # one uniform draw decides choice and treatment
    chosen = (u < mask_prob) & ~special
    labels = ids.masked_fill(~chosen, -100)
    r = u / mask_prob  # uniform in [0, 1) on the chosen positions
    to_mask, to_random = chosen & (r < 0.8), chosen & (r >= 0.8) & (r < 0.9)
    random_ids = torch.randint(first_normal, vocab_size, ids.shape, generator=generator)
    inputs = torch.where(to_mask, torch.full_like(ids, mask_id), torch.where(to_random, random_ids, ids))
    return inputs, labels


class MLMBatches(GeneratorState):
    """Endless masked batches ``{"input_ids", "attention_mask", "token_type_ids", "labels"[, "nsp_labels"]}``.

    Each step draws the *global* batch of ``batch_size`` captions (and, with ``nsp``, cut points and
    partner captions) and its masks from the sampler's own generator; rank ``r`` keeps rows
    ``[r·b, (r+1)·b)``, ``b = batch_size // world_size``. ``state_dict`` holds the generator state.

    Args:
        captions: word-piece ids of each caption, without special tokens (captions of < 2 pieces are skipped
            for NSP cuts).
        tokenizer: gives the ``[PAD]``, ``[CLS]``, ``[SEP]``, ``[MASK]`` ids.
    """

    def __init__(self, captions: Sequence[list[int]], tokenizer: TextTokenizer, *, batch_size: int, max_len: int,
                 mask_prob: float, nsp: bool, seed: int, rank: int = 0, world_size: int = 1) -> None:
        if batch_size % world_size:
            raise ValueError(f"batch_size ({batch_size}) must be divisible by world_size ({world_size})")
        self.captions = [c for c in captions if len(c) >= 2] if nsp else [c for c in captions if c]
        if len(self.captions) < 2:
            raise ValueError("need at least two captions of >= 2 word pieces")
        self.tok, self.batch_size, self.max_len, self.mask_prob, self.nsp = tokenizer, batch_size, max_len, mask_prob, nsp
        self.rank, self.local = rank, batch_size // world_size
        self.first_normal = 1 + max(i for i in (tokenizer.pad_id, tokenizer.unk_id, tokenizer.cls_id,
                                                tokenizer.sep_id, tokenizer.mask_id) if i is not None)
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self) -> "MLMBatches":
        return self

    def _sequence(self, i: int, g: torch.Generator) -> tuple[list[int], list[int], int]:
        """Ids, token types and NSP label (0 = continuation, 1 = random) of example ``i``."""
        cls, sep, room = self.tok.cls_id, self.tok.sep_id, self.max_len
        words = self.captions[i]
        if not self.nsp:
            words = words[:room - 2]
            return [cls, *words, sep], [0] * (len(words) + 2), 0
        cut = int(torch.randint(1, len(words), (1,), generator=g))
        a, b, label = words[:cut], words[cut:], 0
        if bool(torch.rand((), generator=g) < 0.5):
            j = int(torch.randint(len(self.captions) - 1, (1,), generator=g))
            other = self.captions[j + (j >= i)]  # any caption but this one
            b, label = other[int(torch.randint(1, len(other), (1,), generator=g)):], 1
        a = a[:max(1, room - 3 - len(b))]
        b = b[:room - 3 - len(a)]
        return [cls, *a, sep, *b, sep], [0] * (len(a) + 2) + [1] * (len(b) + 1), label

    def __next__(self) -> dict[str, Tensor]:
        g = self.generator  # the global batch (every rank's rows), then this rank's slice
        rows = torch.randint(len(self.captions), (self.batch_size,), generator=g).tolist()
        seqs, types, nsp = zip(*(self._sequence(i, g) for i in rows))
        ids = pad_batch(seqs, self.tok.pad_id)  # (B, L)
        special = (ids == self.tok.pad_id) | (ids == self.tok.cls_id) | (ids == self.tok.sep_id)
        inputs, labels = mask_tokens(ids, special=special, mask_id=self.tok.mask_id, vocab_size=self.tok.vocab_size,
                                     first_normal=self.first_normal, mask_prob=self.mask_prob, generator=g)
        batch = {"input_ids": inputs, "attention_mask": (ids != self.tok.pad_id).long(),
                 "token_type_ids": pad_batch(types, 0), "labels": labels}
        if self.nsp:
            batch["nsp_labels"] = torch.tensor(nsp)
        lo = self.rank * self.local
        return {k: v[lo:lo + self.local] for k, v in batch.items()}



def _forward(model: nn.Module, batch: dict[str, Tensor]):
    return model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])


def mlm_loss(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, int]:
    """``L_MLM (+ L_NSP)`` of a batch; returns ``(loss, number of input tokens)`` (the trainer's tokens/s
    counts every token the model reads, not only the ~15 % it predicts)."""
    out = _forward(model, batch)
    loss = token_cross_entropy(out.logits, batch["labels"])
    if "nsp_labels" in batch:
        loss = loss + F.cross_entropy(out.seq_relationship_logits.float(), batch["nsp_labels"])
    return loss, int(batch["attention_mask"].sum())


@torch.no_grad()
def evaluate_mlm(model: nn.Module, *, batches: Sequence[dict[str, Tensor]], max_batches: Optional[int] = None,
                 split: str = "val") -> dict:
    """Masked-token loss, perplexity and accuracy (and NSP loss/accuracy) over fixed val batches, in fp32.

    Raises:
        ValueError: a split other than ``"val"``, or ``max_batches < 1``.
    """
    if split != "val":
        raise ValueError(f"split must be 'val' for mlm (the Multi30k val captions), got {split!r}")
    check_int("max_batches", max_batches, 1, optional=True)
    batches = batches[:max_batches] if max_batches is not None else batches
    device = next(model.parameters()).device
    nll = correct = n = nsp_nll = nsp_correct = pairs = 0.0
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = _forward(model, batch)
        keep = batch["labels"] != -100
        logits, y = out.logits[keep].float(), batch["labels"][keep]  # (M, V), (M,)
        nll += F.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(-1) == y).sum().item()
        n += y.numel()
        if "nsp_labels" in batch:
            z = out.seq_relationship_logits.float()
            nsp_nll += F.cross_entropy(z, batch["nsp_labels"], reduction="sum").item()
            nsp_correct += (z.argmax(-1) == batch["nsp_labels"]).sum().item()
            pairs += z.shape[0]
    result = {"val_loss": nll / n, "val_ppl": perplexity(nll / n), "val_accuracy": correct / n,
              "val_masked_tokens": int(n)}
    if pairs:
        result.update(val_nsp_loss=nsp_nll / pairs, val_nsp_accuracy=nsp_correct / pairs)
    return result


def build(s: MLMSettings, *, out: Path, dist: DistInfo, training: bool) -> Built:
    """Train (or load) the WordPiece vocabulary, build BERT, the masked batches and the evaluation."""
    out = Path(out)
    train = load_sentences("train", lang="en")
    if s.train_sentences is not None:
        train = train[:s.train_sentences]
    fresh = training and latest_checkpoint(out) is None
    tokenizer = run_tokenizer(out, fresh=fresh, dist=dist, recipe="mlm",
                              train=lambda: train_wordpiece(train, vocab_size=s.vocab_size, lowercase=s.lowercase))
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=s.hidden_size, num_hidden_layers=s.num_layers,
                        num_attention_heads=s.num_heads, intermediate_size=s.intermediate_size,
                        hidden_dropout_prob=s.dropout, attention_probs_dropout_prob=s.dropout,
                        max_position_embeddings=s.max_len, pad_token_id=tokenizer.pad_id)
    model = (BertForPreTraining if s.nsp else BertForMaskedLM)(config)
    kw = dict(batch_size=s.batch_size, max_len=s.max_len, mask_prob=s.mask_prob, nsp=s.nsp)
    val = MLMBatches(tokenizer.encode_batch(load_sentences("val", lang="en")), tokenizer, seed=s.seed + 1, **kw)
    evaluate = functools.partial(evaluate_mlm, batches=[next(val) for _ in range(s.eval_batches)])
    batches = MLMBatches(tokenizer.encode_batch(train), tokenizer, seed=s.seed, rank=dist.rank,
                         world_size=dist.world_size, **kw) if training else None
    info = {"parameters": sum(p.numel() for p in model.parameters()), "vocab_size": tokenizer.vocab_size,
            "train_sentences": len(train), "nsp": s.nsp}
    return Built(model=model, train_batches=batches, loss_fn=mlm_loss, evaluate=evaluate, score=evaluate, info=info)


register(Recipe(
    name="mlm", settings=MLMSettings, build=build, presets=PRESETS,
    description="BERT masked-LM + next-segment prediction on the English side of Multi30k (WordPiece)",
    targets={"default": "masked-token accuracy and perplexity on val, improving; ~11 minutes on 2 cores in fp32",
             "tiny": "a few-second smoke run"},
))
