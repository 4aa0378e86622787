"""``multi30k-de-en``: a Transformer encoder–decoder translating Multi30k German → English.

Data: Multi30k task 1 (29,000 train / 1,014 val / 1,000 test_2016_flickr pairs). One joint byte-level
BPE vocabulary for both languages is trained on the training split with ``tokenizers`` and saved as
``tokenizer.json`` in the run folder; the source embedding, the target embedding and the output
projection share one matrix ``E`` (``logits = h Eᵀ``). Every sentence is ``<s> tokens </s>``; the decoder
reads ``y[:-1]`` and is trained on ``y[1:]`` with label smoothing ``ε``::

    loss = (1/N) Σ_n [(1 − ε)(−log p(y_n | y_<n, x)) + ε (1/V) Σ_v −log p(v | y_<n, x)]

Training batches are length-bucketed under a padded-token budget (:class:`TokenBucketBatches`),
under bf16 autocast where the CPU computes bf16 natively (``dtype="auto"``), else in fp32. Every
``eval_every`` steps the evaluation is cheap: the teacher-forced val loss (``ε = 0``) and greedy BLEU
on the first ``eval_sentences`` val sentences. The final evaluation averages the parameters of the last
``average_checkpoints`` checkpoints, ``θ̄ = (1/K) Σ_k θ_k``, and decodes val and test_2016_flickr with beam
search (``num_beams``, a finished hypothesis scores ``Σ log p / len^α``, ``α = length_penalty``); BLEU and
chrF are sacreBLEU's, on detokenised, cased text. The test hypotheses are written to
``test_2016_flickr.hyp.en`` so ``attnlab eval --hyp`` can rescore them.
"""
from __future__ import annotations

import copy
import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab._checks import check_int
from attnlab._runtime import check_dtype_name, resolve_dtype
from attnlab.data.batching import TokenBucketBatches, pad_batch
from attnlab.data.datasets import atomic_write, load_parallel
from attnlab.data.tokenizers import TextTokenizer, train_bpe
from attnlab.evaluation.metrics import bleu, chrf, perplexity
from attnlab.models.config import TransformerConfig
from attnlab.models.transformer import Seq2SeqTransformer
from attnlab.training.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from attnlab.training.distributed import DistInfo
from attnlab.training.losses import token_cross_entropy
from attnlab.training.recipes import Built, Recipe, register
from attnlab.training.trainer import DTYPES, TrainConfig

__all__ = ["Multi30kSettings", "PRESETS", "PairBatches", "seq2seq_loss", "translate", "average_checkpoints",
           "score_translation", "run_tokenizer", "make_model", "check_int", "build"]

SPLITS = ("val", "test_2016_flickr")
SCORES = ("loss", "bleu", "chrf")


@dataclass
class Multi30kSettings(TrainConfig):
    """The default preset (1,800 steps: ~20–30 minutes on 2 cores); every :class:`TrainConfig` field is a setting too.

    Data: a joint BPE of ``vocab_size`` ids; training pairs longer than ``max_len`` tokens are dropped
    (``train_pairs``: keep only the first N pairs, for smoke runs); batches hold at most ``max_tokens``
    padded tokens per side. Model: ``dim`` wide, ``num_heads`` heads, ``ffn_dim`` feed-forward,
    ``num_encoder_layers`` + ``num_decoder_layers``; ``dropout`` on embeddings and residual branches,
    ``attn_dropout`` on attention weights, post-norm unless ``norm_first``; attention ``backend`` ``"auto"``
    (training on a CPU at these lengths takes ``short``, explicit products with a hand-written backward: a training
    step of this model measured 0.96× the ``"reference"`` path's time under bf16 on an AVX-512 CPU and 0.95× in
    fp32 as AVX2; it was ``"reference"``, set when that path beat SDPA's slow bf16 backward). Evaluation: greedy
    BLEU on ``eval_sentences`` val sentences during training; the final one averages ``average_checkpoints``
    checkpoints and decodes ``decode_batch`` sentences at a time with ``num_beams`` beams and ``length_penalty``,
    under ``eval_dtype`` (only the first ``final_max_batches`` batches of each split when set: smoke runs).
    Its measured BLEU and time: see docs/performance.md. No wall-clock stop (``max_seconds``): a slower machine takes
    longer for the same model.
    """

    vocab_size: int = 8000
    dim: int = 256
    num_heads: int = 4
    ffn_dim: int = 1024
    num_encoder_layers: int = 3
    num_decoder_layers: int = 3
    dropout: float = 0.1
    attn_dropout: float = 0.0
    activation: str = "relu"
    norm_first: bool = True
    position: str = "sinusoidal"
    backend: str = "auto"
    label_smoothing: float = 0.1
    max_tokens: int = 2048
    max_len: int = 100
    train_pairs: Optional[int] = None
    eval_sentences: int = 200
    final_max_batches: Optional[int] = None
    decode_batch: int = 100
    num_beams: int = 5
    length_penalty: float = 1.0
    average_checkpoints: int = 3
    eval_dtype: str = "auto"
    # trainer defaults for this recipe
    max_steps: int = 1800
    lr: float = 1e-3
    min_lr: float = 1e-5
    schedule: str = "cosine"
    warmup_steps: int = 400
    betas: tuple[float, float] = (0.9, 0.98)
    weight_decay: float = 0.01
    clip: float = 1.0
    dtype: str = "auto"  # bf16 where the CPU computes it natively (and faster), else fp32
    eval_every: int = 250
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    log_every: int = 50
    max_seconds: Optional[float] = None  # no wall-clock stop: a slower CPU takes longer, not a cut-off schedule

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("vocab_size", "dim", "num_heads", "ffn_dim", "num_encoder_layers", "num_decoder_layers",
                     "max_tokens", "max_len", "decode_batch", "num_beams", "average_checkpoints"):
            check_int(name, getattr(self, name), 1)
        check_int("train_pairs", self.train_pairs, 1, optional=True)
        check_int("final_max_batches", self.final_max_batches, 1, optional=True)
        check_int("eval_sentences", self.eval_sentences, 0)
        if self.max_len > self.max_tokens:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be >= max_len ({self.max_len})")
        for name in ("dropout", "attn_dropout", "label_smoothing"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")
        self.eval_dtype = check_dtype_name(self.eval_dtype, name="eval_dtype")
        if self.eval_dtype == "fp16":
            raise ValueError("eval_dtype must be one of auto, fp32, bf16, got 'fp16'")
        if self.average_checkpoints > 1 and (self.checkpoint_every < 1
                                             or self.keep_checkpoints < self.average_checkpoints - 1):
            raise ValueError(f"average_checkpoints={self.average_checkpoints} needs checkpoint_every >= 1 and "
                             f"keep_checkpoints >= {self.average_checkpoints - 1}, got {self.checkpoint_every} "
                             f"and {self.keep_checkpoints}")


PRESETS = {
    "tiny": dict(vocab_size=400, dim=32, num_heads=2, ffn_dim=64, num_encoder_layers=1, num_decoder_layers=1,
                 dropout=0.0, train_pairs=400, max_tokens=600, max_steps=30, lr=3e-3, min_lr=3e-4, warmup_steps=5,
                 eval_every=15, checkpoint_every=10, keep_checkpoints=2, average_checkpoints=2, log_every=10,
                 eval_sentences=16, final_max_batches=1, decode_batch=16, num_beams=2, dtype="fp32", eval_dtype="fp32",
                 max_seconds=None),
}


class PairBatches:
    """Endless ``(src (B, S), tgt (B, T))`` padded id batches of a :class:`TokenBucketBatches` sampler.

    ``state_dict`` is the sampler's position plus the number of batches served (``steps`` =
    served // ``grad_accum``: the optimiser steps taken, which the evaluation reads).
    """

    def __init__(self, src: Sequence[list[int]], tgt: Sequence[list[int]], *, pad_id: int, max_tokens: int,
                 seed: int, rank: int = 0, world_size: int = 1, grad_accum: int = 1) -> None:
        if len(src) != len(tgt):
            raise ValueError(f"src and tgt must pair up, got {len(src)} and {len(tgt)} sequences")
        self.src, self.tgt, self.pad_id, self.grad_accum = src, tgt, pad_id, grad_accum
        self.sampler = TokenBucketBatches([(len(a), len(b)) for a, b in zip(src, tgt)], max_tokens=max_tokens,
                                          seed=seed, rank=rank, world_size=world_size)
        self.served = 0

    def __iter__(self) -> "PairBatches":
        return self

    def __next__(self) -> tuple[Tensor, Tensor]:
        idx = next(self.sampler)
        self.served += 1
        return pad_batch([self.src[i] for i in idx], self.pad_id), pad_batch([self.tgt[i] for i in idx], self.pad_id)

    @property
    def steps(self) -> int:
        return self.served // self.grad_accum

    def state_dict(self) -> dict:
        return {**self.sampler.state_dict(), "served": self.served}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
        self.served = int(state.get("served", 0))


def seq2seq_loss(model: nn.Module, batch: tuple[Tensor, Tensor], *, pad_id: int,
                 label_smoothing: float = 0.0) -> tuple[Tensor, int]:
    """Teacher-forced loss of ``batch = (src (B, S), tgt (B, T))``: predict ``tgt[:, 1:]`` from ``tgt[:, :-1]``.

    Returns:
        ``(mean smoothed cross-entropy over the non-pad target tokens, their count)``.
    """
    src, tgt = batch
    logits = model(src, tgt[:, :-1])  # (B, T-1, V)
    y = tgt[:, 1:].masked_fill(tgt[:, 1:] == pad_id, -100)  # (B, T-1)
    return token_cross_entropy(logits, y, label_smoothing=label_smoothing), int((y != -100).sum())


@torch.no_grad()
def translate(model: Seq2SeqTransformer, tokenizer: TextTokenizer, sentences: Sequence[str], *, num_beams: int = 1,
              length_penalty: float = 1.0, batch_size: int = 64, dtype: str = "fp32") -> list[str]:
    """Detokenised translations of ``sentences`` (greedy when ``num_beams`` is 1), in input order.

    Args:
        model: a :class:`Seq2SeqTransformer` over ``tokenizer``'s ids (call ``eval()`` first).
        tokenizer: gives ``<s>`` (the decoder start), ``</s>`` (the end) and ``<pad>``.
        num_beams, length_penalty: beam search with ``Σ log p / len^α`` (``α = length_penalty``).
        batch_size: sentences decoded together, sorted by length; a batch may add up to ``1.5 · S + 10``
            tokens (``S``: its longest source), within the model's position table.
        dtype: ``"fp32"``, ``"bf16"`` (autocast) or ``"auto"`` (:func:`attnlab._runtime.resolve_dtype`).

    Returns:
        one string per sentence, special tokens removed.

    Raises:
        ValueError: an unknown ``dtype`` or ``batch_size < 1``.
    """
    if dtype not in ("fp32", "bf16", "auto"):
        raise ValueError(f"dtype must be 'fp32', 'bf16' or 'auto', got {dtype!r}")
    check_int("batch_size", batch_size, 1)
    ids = tokenizer.encode_batch(list(sentences), add_special_tokens=True)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    device = next(model.parameters()).device
    dtype = resolve_dtype(dtype, device)[0]
    limit = model.config.max_positions - 1
    out: list[str] = [""] * len(ids)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        src = pad_batch([ids[i] for i in chunk], tokenizer.pad_id).to(device)  # (B, S)
        with torch.autocast(device.type, dtype=DTYPES[dtype], enabled=DTYPES[dtype] is not None):
            gen = model.generate(src, decoder_start_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
                                 max_new_tokens=min(int(1.5 * src.shape[1]) + 10, limit), num_beams=num_beams,
                                 length_penalty=length_penalty)  # (B, 1 + n)
        for i, row in zip(chunk, gen[:, 1:].tolist()):
            out[i] = tokenizer.decode(row).strip()
    return out


@torch.no_grad()
def _teacher_forced_loss(model: nn.Module, src: list[list[int]], tgt: list[list[int]], *, pad_id: int,
                         max_tokens: int) -> float:
    """Mean token cross-entropy (no smoothing, fp32) over every target token of the pairs, in batches of
    about ``max_tokens`` padded tokens (more when one pair is longer)."""
    lengths = [(len(a), len(b)) for a, b in zip(src, tgt)]
    batches = TokenBucketBatches(lengths, max_tokens=max(max_tokens, *map(max, lengths)), shuffle=False)
    nll, n = 0.0, 0
    device = next(model.parameters()).device
    for idx in batches.epoch_batches(0):
        s = pad_batch([src[i] for i in idx], pad_id).to(device)
        t = pad_batch([tgt[i] for i in idx], pad_id).to(device)
        logits = model(s, t[:, :-1]).float()  # (B, T-1, V)
        y = t[:, 1:]
        nll += F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=pad_id, reduction="sum").item()
        n += int((y != pad_id).sum())
    return nll / n


def average_checkpoints(model: nn.Module, paths: Sequence[Path]) -> nn.Module:
    """A copy of ``model`` holding ``θ̄ = (θ_model + Σ_k θ_k) / (1 + K)`` over the checkpoints ``paths``
    (float entries of the state dict, summed in float64); ``model`` itself is untouched."""
    avg = copy.deepcopy(model)
    state = avg.state_dict()
    sums = {k: v.detach().double().clone() for k, v in state.items() if v.is_floating_point()}
    for path in paths:
        theirs = load_checkpoint(path)["model"]
        for k in sums:
            sums[k] += theirs[k].double()
    avg.load_state_dict({k: (sums[k] / (1 + len(paths))).to(v.dtype) if k in sums else v for k, v in state.items()})
    return avg


def score_translation(model: nn.Module, *, tokenizer: TextTokenizer, settings: Multi30kSettings,
                      split: str = "test_2016_flickr", max_batches: Optional[int] = None,
                      metrics: Optional[Sequence[str]] = None, num_beams: Optional[int] = None,
                      length_penalty: Optional[float] = None, hyp_path: Optional[Path] = None) -> dict:
    """Loss and sacreBLEU BLEU/chrF of ``model`` on a Multi30k split (``attnlab eval --checkpoint``).

    Args:
        split: ``"val"`` or ``"test_2016_flickr"``.
        max_batches: decode only the first ``max_batches × decode_batch`` sentences.
        metrics: a subset of ``loss, bleu, chrf`` (default: all).
        num_beams, length_penalty: default: the run's settings (``num_beams=1`` is greedy).
        hyp_path: also write the hypotheses there, one per line.

    Returns:
        ``{"{split}_loss", "{split}_ppl", "bleu", "chrf", signatures, "sentences", "num_beams"}``
        (keys for the requested metrics).

    Raises:
        ValueError: unknown split or metric, ``max_batches < 1``.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    wanted = list(SCORES) if metrics is None else [m.lower() for m in metrics]
    bad = [m for m in wanted if m not in SCORES]
    if bad:
        raise ValueError(f"unknown metric {bad[0]!r}; valid: {', '.join(SCORES)}")
    check_int("max_batches", max_batches, 1, optional=True)
    num_beams = settings.num_beams if num_beams is None else num_beams
    length_penalty = settings.length_penalty if length_penalty is None else length_penalty
    pairs = load_parallel(split)
    if max_batches is not None:
        pairs = pairs[:max_batches * settings.decode_batch]
    out: dict = {"split": split, "sentences": len(pairs)}
    if "loss" in wanted:
        src = tokenizer.encode_batch([p[0] for p in pairs], add_special_tokens=True)
        tgt = tokenizer.encode_batch([p[1] for p in pairs], add_special_tokens=True)
        loss = _teacher_forced_loss(model, src, tgt, pad_id=tokenizer.pad_id, max_tokens=settings.max_tokens)
        out.update({f"{split}_loss": loss, f"{split}_ppl": perplexity(loss)})
    if "bleu" in wanted or "chrf" in wanted:
        hyps = translate(model, tokenizer, [p[0] for p in pairs], num_beams=num_beams, length_penalty=length_penalty,
                         batch_size=settings.decode_batch, dtype=settings.eval_dtype)
        refs = [p[1] for p in pairs]
        out.update(num_beams=num_beams, length_penalty=length_penalty)
        if "bleu" in wanted:
            out["bleu"], out["bleu_signature"] = bleu(hyps, refs)
        if "chrf" in wanted:
            out["chrf"], out["chrf_signature"] = chrf(hyps, refs)
        if hyp_path is not None:
            text = "".join(h + "\n" for h in hyps)
            atomic_write(Path(hyp_path), lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return out


class _Evaluation:
    """The trainer's ``evaluate`` (cheap: val loss, greedy BLEU on a subset) and the recipe's ``finish``
    (once, after training: the last checkpoints averaged, beam search on all of val and test)."""

    def __init__(self, s: Multi30kSettings, tokenizer: TextTokenizer, out: Path, batches: PairBatches) -> None:
        self.s, self.tokenizer, self.out, self.batches = s, tokenizer, out, batches
        val = load_parallel("val")
        self.val_src = tokenizer.encode_batch([p[0] for p in val], add_special_tokens=True)
        self.val_tgt = tokenizer.encode_batch([p[1] for p in val], add_special_tokens=True)
        self.subset = val[:s.eval_sentences]

    def __call__(self, model: nn.Module) -> dict:
        s, t0 = self.s, time.perf_counter()
        loss = _teacher_forced_loss(model, self.val_src, self.val_tgt, pad_id=self.tokenizer.pad_id,
                                    max_tokens=s.max_tokens)
        out = {"val_loss": loss, "val_ppl": perplexity(loss)}
        if self.subset:
            hyps = translate(model, self.tokenizer, [p[0] for p in self.subset], batch_size=s.decode_batch,
                             dtype=s.eval_dtype)
            out["val_greedy_bleu"] = bleu(hyps, [p[1] for p in self.subset]).score
        return {**out, "eval_s": time.perf_counter() - t0}

    def finish(self, model: nn.Module) -> dict:
        s, t0 = self.s, time.perf_counter()
        step, window = self.batches.steps, (s.average_checkpoints - 1) * s.checkpoint_every
        recent = [p for p in list_checkpoints(self.out)
                  if step - window <= int(p.stem.split("-")[1]) < step][-(s.average_checkpoints - 1):] \
            if s.average_checkpoints > 1 else []
        final = average_checkpoints(model, recent).eval() if recent else model
        score = functools.partial(score_translation, final, tokenizer=self.tokenizer, settings=s,
                                  max_batches=s.final_max_batches)
        val = score(split="val")
        test = score(split="test_2016_flickr", hyp_path=self.out / "test_2016_flickr.hyp.en")
        return {"val_loss": val["val_loss"], "val_ppl": val["val_ppl"], "val_bleu": val["bleu"],
                "val_chrf": val["chrf"], "bleu": test["bleu"], "chrf": test["chrf"],
                "test_loss": test["test_2016_flickr_loss"], "bleu_signature": test["bleu_signature"],
                "chrf_signature": test["chrf_signature"], "num_beams": s.num_beams,
                "length_penalty": s.length_penalty, "averaged_checkpoints": 1 + len(recent),
                "final_eval_s": time.perf_counter() - t0}


def run_tokenizer(out: Path, *, fresh: bool, dist: DistInfo, train: Callable[[], TextTokenizer],
                  recipe: str) -> TextTokenizer:
    """The run's ``tokenizer.json``: a fresh run calls ``train()`` (deterministic, so every rank gets the
    same tokenizer) and rank 0 saves it; a resumed run or an evaluation loads the saved one.

    Raises:
        FileNotFoundError: not fresh and ``out`` holds no ``tokenizer.json``.
    """
    path = out / "tokenizer.json"
    if not fresh:
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {out}: not a {recipe} run folder")
        return TextTokenizer.load(path)
    tokenizer = train()
    if dist.is_main:
        tokenizer.save(path)
    return tokenizer


def make_model(s: Multi30kSettings, *, vocab_size: int, pad_id: int) -> Seq2SeqTransformer:
    """The encoder–decoder of the settings; source and target embeddings are one module (joint vocabulary),
    which the output projection shares too (``tie_embeddings``)."""
    config = TransformerConfig(src_vocab_size=vocab_size, dim=s.dim, num_heads=s.num_heads, ffn_dim=s.ffn_dim,
                               num_encoder_layers=s.num_encoder_layers, num_decoder_layers=s.num_decoder_layers,
                               dropout=s.dropout, attn_dropout=s.attn_dropout, activation=s.activation,
                               norm_first=s.norm_first, position=s.position, max_positions=max(256, 2 * s.max_len),
                               tie_embeddings=True, pad_id=pad_id, backend=s.backend)
    model = Seq2SeqTransformer(config)
    model.src_embed = model.tgt_embed  # (V, E), one table for both languages
    return model


def build(s: Multi30kSettings, *, out: Path, dist: DistInfo, training: bool) -> Built:
    """Tokenise Multi30k with a joint BPE, build the model, the bucketed batches, the loss and the evaluations."""
    out = Path(out)
    train = load_parallel("train")
    if s.train_pairs is not None:
        train = train[:s.train_pairs]
    resumed = latest_checkpoint(out) if training else None
    tokenizer = run_tokenizer(out, fresh=training and resumed is None, dist=dist, recipe="multi30k-de-en",
                              train=lambda: train_bpe([text for pair in train for text in pair],
                                                      vocab_size=s.vocab_size))
    model = make_model(s, vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id)
    info = {"parameters": sum(p.numel() for p in model.parameters()), "vocab_size": tokenizer.vocab_size}
    score = functools.partial(score_translation, tokenizer=tokenizer, settings=s)
    loss_fn = functools.partial(seq2seq_loss, pad_id=tokenizer.pad_id, label_smoothing=s.label_smoothing)
    if not training:
        return Built(model=model, train_batches=None, loss_fn=loss_fn, evaluate=score, score=score, info=info)
    src = tokenizer.encode_batch([p[0] for p in train], add_special_tokens=True)
    tgt = tokenizer.encode_batch([p[1] for p in train], add_special_tokens=True)
    keep = [i for i in range(len(src)) if len(src[i]) <= s.max_len and len(tgt[i]) <= s.max_len]
    batches = PairBatches([src[i] for i in keep], [tgt[i] for i in keep], pad_id=tokenizer.pad_id,
                          max_tokens=s.max_tokens, seed=s.seed, rank=dist.rank, world_size=dist.world_size,
                          grad_accum=s.grad_accum)
    info.update(train_pairs=len(keep), batches_per_epoch=len(batches.sampler))
    evaluate = _Evaluation(s, tokenizer, out, batches)
    return Built(model=model, train_batches=batches, loss_fn=loss_fn, evaluate=evaluate, score=score, info=info,
                 finish=evaluate.finish)


register(Recipe(
    name="multi30k-de-en", settings=Multi30kSettings, build=build, presets=PRESETS,
    description="Transformer encoder-decoder, Multi30k German -> English (joint BPE, beam search, sacreBLEU)",
    targets={"default": "sacreBLEU >= 35 on test_2016_flickr within 30 minutes wall on 2 cores",
             "tiny": "a few-second smoke run"},
))
