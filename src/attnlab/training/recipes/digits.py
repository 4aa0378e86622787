"""``digits-vit``: a small Vision Transformer trained from scratch on scikit-learn's handwritten digits.

The data is ``sklearn.datasets.load_digits`` (bundled with scikit-learn, no download): 1,797 grey 8×8
images of the digits 0–9, pixel values 0…16, scaled to ``x = (v / 16 − ½) / ½ ∈ [−1, 1]``. A fixed
``val_fraction`` of them (shuffled with ``split_seed``, independent of the training ``seed``) is held out.

The model is :class:`~attnlab.models.vit.ViTForImageClassification`: ``patch_size``² patches (8×8 in 2×2:
``N = 16`` patches + [CLS]), a pre-norm encoder, ``logits = W_c LN(hᴸ)_[CLS] + b_c``, trained on
``L = CE(logits, digit)`` with batches drawn with replacement. On the held-out split::

    accuracy = mean [argmax logits = y]

At the end the model is written as an HF-format folder ``OUT/model`` (``config.json`` with the labels "0"…"9",
``model.safetensors``) that ``transformers.ViTForImageClassification`` loads, and the attention of
``attention_examples`` held-out digits is drawn by :func:`attnlab.viz.image.image_view` (attention rollout
and the last layer's per-head [CLS]→patch maps) into ``OUT/attention/digit-K.png``.

The default preset reaches a held-out accuracy ≥ 0.95 with ``--threads 1`` in about a minute of CPU time; its
matrices are so small that a second thread costs more than it gives.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab._checks import check_int
from attnlab._limits import TrainingShape, estimated_parameters, model_sizes
from attnlab.data.batching import GeneratorState
from attnlab.models.vit import ViTConfig, ViTForImageClassification
from attnlab.training.distributed import DistInfo
from attnlab.training.recipes import Built, Recipe, register
from attnlab.training.trainer import TrainConfig

__all__ = ["DigitsSettings", "DigitsSplit", "load_digits_split", "DigitsBatches", "evaluate_digits", "build"]


@dataclass
class DigitsSettings(TrainConfig):
    """Every :class:`TrainConfig` field is a setting too.

    The ViT's size (``patch_size``, ``hidden_size``, ``num_layers``, ``num_heads``, ``intermediate_size``,
    ``dropout`` on the hidden states and attention weights), ``batch_size``, the held-out ``val_fraction``
    and its ``split_seed``, and ``attention_examples``: how many held-out digits get an attention figure.
    """

    patch_size: int = 2
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 128
    dropout: float = 0.1
    batch_size: int = 64
    val_fraction: float = 0.2
    split_seed: int = 0
    attention_examples: int = 4
    # trainer defaults for this task
    max_steps: int = 1500
    lr: float = 2e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.05
    eval_every: int = 500
    checkpoint_every: int = 0
    log_every: int = 100

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("patch_size", "hidden_size", "num_layers", "num_heads", "intermediate_size", "batch_size"):
            check_int(name, getattr(self, name), 1)
        check_int("split_seed", self.split_seed, 0)
        check_int("attention_examples", self.attention_examples, 0)
        if 8 % self.patch_size:
            raise ValueError(f"patch_size must divide the 8×8 digit images (1, 2, 4 or 8), got {self.patch_size}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")


@dataclass
class DigitsSplit:
    """``train_x``/``val_x`` ``(n, 1, 8, 8)`` float32 in [−1, 1], ``train_y``/``val_y`` ``(n,)`` int64 digits;
    ``val_index``: the held-out rows' indices in ``load_digits()``."""

    train_x: Tensor
    train_y: Tensor
    val_x: Tensor
    val_y: Tensor
    val_index: Tensor


def load_digits_split(val_fraction: float = 0.2, split_seed: int = 0) -> DigitsSplit:
    """The 1,797 digits, scaled to [−1, 1] and split: the first ``round(val_fraction · n)`` rows of a
    permutation drawn with ``split_seed`` are held out.

    Raises:
        ModuleNotFoundError: scikit-learn is not installed (the message says how to install it).
    """
    try:
        from sklearn.datasets import load_digits
    except ModuleNotFoundError:
        raise ModuleNotFoundError("the digits-vit recipe reads sklearn.datasets.load_digits: "
                                  "pip install scikit-learn") from None
    d = load_digits()
    x = torch.from_numpy(d.images).float().div(16.0).sub(0.5).div(0.5).unsqueeze(1)  # (n, 1, 8, 8)
    y = torch.from_numpy(d.target).long()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(split_seed))
    n_val = round(val_fraction * len(y))
    val, train = order[:n_val], order[n_val:]
    return DigitsSplit(x[train], y[train], x[val], y[val], val)


class DigitsBatches(GeneratorState):
    """Endless training batches ``{"pixel_values", "labels"}`` of ``batch_size`` images drawn with replacement
    from the sampler's own generator (``state_dict``: its state). Under DDP each rank draws the global batch
    and keeps its rows ``[r·b, (r+1)·b)``."""

    def __init__(self, x: Tensor, y: Tensor, *, batch_size: int, seed: int, rank: int = 0,
                 world_size: int = 1) -> None:
        if batch_size % world_size:
            raise ValueError(f"batch_size ({batch_size}) must be divisible by world_size ({world_size})")
        self.x, self.y, self.batch_size = x, y, batch_size
        self.rank, self.local = rank, batch_size // world_size
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self) -> "DigitsBatches":
        return self

    def __next__(self) -> dict[str, Tensor]:
        rows = torch.randint(len(self.y), (self.batch_size,), generator=self.generator)
        rows = rows[self.rank * self.local:(self.rank + 1) * self.local]
        return {"pixel_values": self.x[rows], "labels": self.y[rows]}


def digits_loss(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, int]:
    """``(mean cross-entropy of the batch, its number of images)``."""
    logits = model(batch["pixel_values"]).logits
    return F.cross_entropy(logits.float(), batch["labels"]), int(batch["labels"].numel())


@torch.no_grad()
def evaluate_digits(model: nn.Module, x: Tensor, y: Tensor, *, batch_size: int = 512) -> dict:
    """``val_loss`` (mean cross-entropy), ``val_accuracy`` (``mean [argmax logits = y]``), ``val_examples``."""
    device = next(model.parameters()).device
    logits = torch.cat([model(x[i:i + batch_size].to(device)).logits.float().cpu()
                        for i in range(0, len(y), batch_size)])
    accuracy = (logits.argmax(-1) == y).double().mean()
    return {"val_loss": float(F.cross_entropy(logits, y)), "val_accuracy": float(accuracy),
            "val_examples": int(y.numel())}


def save_attention_figures(model: ViTForImageClassification, x: Tensor, y: Tensor, folder: Path) -> list[str]:
    """One figure per image of ``x`` (rollout + the last layer's heads, :func:`attnlab.viz.image.image_view`),
    titled with the true and predicted digit, written as ``folder/digit-K.png``; returns the paths."""
    from attnlab.viz.image import image_view

    folder.mkdir(parents=True, exist_ok=True)
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model(x.to(device), output_attentions=True)
    pred = out.logits.argmax(-1).cpu()
    paths = []
    for k in range(len(y)):
        picture = (x[k, 0] + 1) / 2  # back to [0, 1]
        view = image_view(out.attentions, picture, batch_index=k,
                          title=f"held-out digit {int(y[k])} (predicted {int(pred[k])})")
        paths.append(str(view.save(folder / f"digit-{k}.png")))
    return paths


def build(s: DigitsSettings, *, out: Path, dist: DistInfo, training: bool) -> Built:
    """Split the digits, build the ViT, batch, evaluate; ``finish`` saves the model and the attention figures."""
    split = load_digits_split(s.val_fraction, s.split_seed)
    config = ViTConfig(image_size=8, patch_size=s.patch_size, num_channels=1, hidden_size=s.hidden_size,
                       num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads,
                       intermediate_size=s.intermediate_size, hidden_dropout_prob=s.dropout,
                       attention_probs_dropout_prob=s.dropout, layer_norm_eps=1e-6, num_labels=10,
                       id2label={i: str(i) for i in range(10)})
    model = ViTForImageClassification(config)

    def evaluate(m: nn.Module) -> dict:
        return evaluate_digits(m, split.val_x, split.val_y)

    def finish(m: nn.Module) -> dict:
        """Write ``OUT/model`` (HF format) and ``OUT/attention/digit-K.png``; the final held-out scores."""
        target = Path(out) / "model"
        m.float().save_pretrained(target)
        k = min(s.attention_examples, len(split.val_y))
        figures = save_attention_figures(m, split.val_x[:k], split.val_y[:k], Path(out) / "attention")
        return {**evaluate(m), "model_dir": str(target), "attention_figures": figures}

    batches = DigitsBatches(split.train_x, split.train_y, batch_size=s.batch_size, seed=s.seed, rank=dist.rank,
                            world_size=dist.world_size) if training else None
    info = {"parameters": sum(p.numel() for p in model.parameters()), "train_examples": len(split.train_y),
            "val_examples": len(split.val_y)}
    return Built(model=model, train_batches=batches, loss_fn=digits_loss, evaluate=evaluate, score=evaluate,
                 info=info, finish=finish)


def training_shape(s: DigitsSettings) -> TrainingShape:
    """The sizes of a training step: ``batch_size`` images of ``(8 / patch_size)²`` patches and [CLS]."""
    patches = (8 // s.patch_size) ** 2
    words, width, heads, layers = model_sizes(vars(s))
    return TrainingShape(f"--set batch_size={s.batch_size} with patch_size={s.patch_size} ({patches} patches an "
                         f"image), {words}", batch=s.batch_size, seq=patches + 1, width=width, heads=heads,
                         layers=layers, outputs=10, parameters=estimated_parameters(vars(s)))


PRESETS = {
    "tiny": dict(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, dropout=0.0, max_steps=20,
                 warmup_steps=2, eval_every=0, log_every=10, attention_examples=2),
}

register(Recipe(
    name="digits-vit", settings=DigitsSettings, build=build, presets=PRESETS, training_shape=training_shape,
    description="train a small ViT from scratch on scikit-learn's bundled 8×8 handwritten digits (no download); "
                "held-out accuracy, attention maps of held-out digits; saves an HF-format ViTForImageClassification",
    targets={"default": "held-out accuracy ≥ 0.95 (measured 0.975) in about a minute on one CPU thread "
                        "(--threads 1)",
             "tiny": "a few-second smoke run"},
))
