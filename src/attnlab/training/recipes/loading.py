"""A run folder read back: its model at a checkpoint (:func:`load_run`), a checkpoint scored with its recipe's
evaluation (:func:`evaluate_checkpoint`), and the folder reader that lets ``from_pretrained`` open run folders."""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
from torch import nn

from attnlab._checks import stored_dtype
from attnlab._io import read_input_json
from attnlab.models.hub import register_folder_reader
from attnlab.training.checkpoint import latest_intact_checkpoint, load_checkpoint
from attnlab.training.distributed import DistInfo
from attnlab.training.recipes.registry import Built, Recipe, get_recipe
from attnlab.training.recipes.settings import resolve_settings

PathLike = Union[str, os.PathLike]


def _read_config(out: Path) -> Optional[dict]:
    path = out / "config.json"
    if not path.is_file():
        return None
    return read_input_json("", path, "config")


def load_weights_checked(model: nn.Module, weights: Mapping[str, torch.Tensor], *, source: PathLike) -> None:
    """``model.load_state_dict(weights)``, with a mismatch reported as one ValueError naming the tensors
    (at most 5 listed) and, for a size mismatch, both shapes."""
    own = model.state_dict()
    missing = [k for k in own if k not in weights]
    unexpected = [k for k in weights if k not in own]
    shapes = [f"{k} {tuple(weights[k].shape)} vs {tuple(own[k].shape)}" for k in own
              if k in weights and tuple(weights[k].shape) != tuple(own[k].shape)]

    def listed(items: list[str]) -> str:
        return ", ".join(items[:5]) + (f", ... ({len(items) - 5} more)" if len(items) > 5 else "")

    problems = []
    if shapes:
        problems.append(f"{len(shapes)} tensor(s) of another size (checkpoint vs model): {listed(shapes)}")
    if missing:
        problems.append(f"{len(missing)} missing: {listed(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected: {listed(unexpected)}")
    if problems:
        raise ValueError(f"{source} does not fit the model its settings build: " + "; ".join(problems))
    for k, t in own.items():
        stored_dtype(f"{k} of {source}", weights[k], t)
    model.load_state_dict(weights)


@dataclass
class LoadedRun:
    """A run's model at one checkpoint (eval mode, on ``device``), with its recipe, settings and build."""

    recipe: Recipe
    settings: Any
    built: Built
    model: nn.Module
    checkpoint: Path
    step: Optional[int]


def load_run(directory: PathLike, *, checkpoint: Optional[PathLike] = None, device: str = "cpu") -> LoadedRun:
    """The model of a ``run_recipe`` output folder, built from the settings the checkpoint carries (or
    ``config.json``), with the weights of ``checkpoint`` (default: the newest intact one; a torn or empty newer
    one is skipped with a warning).

    Raises:
        FileNotFoundError: no settings or no checkpoint.
        ValueError: ``directory`` is a file, or the checkpoint holds no weights or weights of another model.
    """
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{directory} is a file: give the run's output folder")
    if checkpoint is not None:
        path, state = Path(checkpoint), load_checkpoint(checkpoint, map_location=device)
    else:
        path, state = latest_intact_checkpoint(directory, map_location=device)
    saved = state.get("run") if state is not None and isinstance(state.get("run"), dict) else _read_config(directory)
    if saved is None or saved.get("recipe") is None:
        what = "no config.json" if saved is None else "a config.json that names no recipe"
        raise FileNotFoundError(f"{what} in {directory}: not an `attnlab train` output folder")
    recipe = get_recipe(saved["recipe"])
    settings = resolve_settings(recipe, base=saved.get("settings", {}))
    if path is None:
        raise FileNotFoundError(f"no checkpoint (ckpt-*.pt) in {directory}")
    if "model" not in state:
        raise ValueError(f"{path} holds no model weights")
    built = recipe.build(settings, out=directory, dist=DistInfo(), training=False)
    model = built.model.to(device)
    load_weights_checked(model, state["model"], source=path)
    return LoadedRun(recipe, settings, built, model.eval(), path, state.get("step"))


def evaluate_checkpoint(directory: PathLike, *, checkpoint: Optional[PathLike] = None, device: str = "cpu",
                        **options) -> dict:
    """Score a checkpoint of a ``run_recipe`` output folder with its recipe's evaluation.

    Args:
        directory: the run's output folder (holds ``config.json`` and ``ckpt-*.pt``).
        checkpoint: a checkpoint file (default: the latest in ``directory``).
        device: where to evaluate.
        **options: passed to the recipe's ``score`` (language models: ``split``, ``max_batches``,
            ``metrics``, ``reliability_png``).

    Returns:
        ``{"recipe", "checkpoint", "step", **scores}``.

    Raises:
        FileNotFoundError: no ``config.json`` or no checkpoint.
        ValueError: an option the recipe's evaluation does not take, or a bad value.
    """
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"--checkpoint {directory} is a file: give the run's output folder")
    run = load_run(directory, checkpoint=checkpoint, device=device)
    score = run.built.score or run.built.evaluate
    accepted = inspect.signature(score).parameters
    bad = [k for k in options if k not in accepted]
    if bad:
        raise ValueError(f"recipe {run.recipe.name} does not take evaluation option(s) {bad}")
    with torch.no_grad():
        scores = score(run.model, **options)
    return {"recipe": run.recipe.name, "checkpoint": str(run.checkpoint), "step": run.step, **scores}


def read_run_folder(path: PathLike, *, dtype: Optional[torch.dtype] = None) -> Optional[nn.Module]:
    """The model of a ``run_recipe`` output folder at its newest intact checkpoint (:func:`load_run`), cast to
    ``dtype`` when given; None when ``path`` is no run folder (no ``config.json`` naming a ``recipe``). Registered
    with :func:`attnlab.models.hub.register_folder_reader`, so ``from_pretrained`` (and ``attnlab viz``,
    ``analyze``, ``export``, ``predict``) read run folders as they read HF-format ones."""
    raw = _read_config(Path(path)) if Path(path).is_dir() else None
    if not isinstance(raw, dict) or not isinstance(raw.get("recipe"), str) or "model_type" in raw:
        return None
    model = load_run(path).model
    return (model if dtype is None else model.to(dtype)).eval()


register_folder_reader(read_run_folder)
