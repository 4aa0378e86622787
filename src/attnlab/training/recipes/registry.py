"""The recipe registry: what a recipe is (:class:`Recipe`), what its build returns (:class:`Built`), and the
name -> recipe table, each recipe's module imported when its name is first asked for."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, Optional

from torch import nn

from attnlab.training.trainer import TrainConfig

# recipe name -> the module that registers it (imported on first lookup of that name)
RECIPE_MODULES = {
    "shakespeare-char": "attnlab.training.recipes.shakespeare",
    "multi30k-de-en": "attnlab.training.recipes.multi30k",
    "mlm": "attnlab.training.recipes.mlm",
    "classify": "attnlab.training.recipes.classify",
    "digits-vit": "attnlab.training.recipes.digits",
}
_REGISTRY: dict[str, "Recipe"] = {}

@dataclass
class Built:
    """What a recipe's build function returns.

    Attributes:
        model: the model to train (or to load a checkpoint into).
        train_batches: the training iterator (None when built for evaluation only).
        loss_fn: ``loss_fn(model, batch) -> (mean loss, n_tokens)``.
        evaluate: ``evaluate(model) -> dict`` with ``"val_loss"``, run during training.
        score: ``score(model, **options) -> dict`` for :func:`evaluate_checkpoint` (options such as
            ``split``, ``max_batches``, ``metrics``, ``reliability_png``); default: ``evaluate``.
        info: extra facts recorded in ``metrics.json`` (parameter count, dataset sizes, …).
        finish: ``finish(model) -> dict``, run once on rank 0 after training (eval mode, no grad) and
            merged into ``metrics.json``: the expensive final evaluation (e.g. checkpoint averaging and
            beam search) that the periodic ``evaluate`` should not repeat.
    """

    model: nn.Module
    train_batches: Any
    loss_fn: Callable
    evaluate: Callable[[nn.Module], dict]
    score: Optional[Callable[..., dict]] = None
    info: dict = field(default_factory=dict)
    finish: Optional[Callable[[nn.Module], dict]] = None


@dataclass(frozen=True)
class Recipe:
    """A named way to train: ``settings`` dataclass, ``presets`` (name -> overrides), ``build``.

    ``build(settings, *, out: Path, dist: DistInfo, training: bool) -> Built``; ``targets`` maps a
    preset to the goal it is tuned for (shown in ``--help`` and the benchmark); ``training_shape(settings) ->
    TrainingShape`` gives the sizes a training step's memory follows where the settings' fields do not say them
    (a ViT's patches, a model read from a folder; default :func:`attnlab._limits.training_shape`), checked
    against free memory before anything is read, built or written.
    """

    name: str
    description: str
    settings: type
    build: Callable[..., Built]
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    targets: Mapping[str, str] = field(default_factory=dict)
    training_shape: Optional[Callable[[Any], Any]] = None

    def __post_init__(self) -> None:
        if not (isinstance(self.settings, type) and issubclass(self.settings, TrainConfig)):
            raise TypeError(f"recipe {self.name!r}: settings must be a TrainConfig subclass")
        for preset, overrides in self.presets.items():
            unknown = set(overrides) - {f.name for f in fields(self.settings)}
            if unknown:
                raise ValueError(f"recipe {self.name!r}, preset {preset!r}: unknown settings {sorted(unknown)}")


def register(recipe: Recipe) -> Recipe:
    """Add ``recipe`` to the registry (a name can be registered once)."""
    if recipe.name in _REGISTRY and _REGISTRY[recipe.name] is not recipe:
        raise ValueError(f"a recipe named {recipe.name!r} is already registered")
    _REGISTRY[recipe.name] = recipe
    return recipe


def recipe_names() -> list[str]:
    """Every known recipe name (nothing is imported)."""
    return sorted(set(RECIPE_MODULES) | set(_REGISTRY))


def get_recipe(name: str) -> Recipe:
    """The registered recipe ``name`` (its module imported on first use). Raises ValueError listing the names."""
    if name not in _REGISTRY and name in RECIPE_MODULES:
        importlib.import_module(RECIPE_MODULES[name])
    if name not in _REGISTRY:
        raise ValueError(f"unknown recipe {name!r}; available: {', '.join(recipe_names())}")
    return _REGISTRY[name]
