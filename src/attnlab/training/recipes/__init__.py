"""Training recipes: a name -> :class:`Recipe` registry, ``--set key=value`` parsing, run and evaluate.

A recipe is a settings dataclass (a subclass of :class:`~attnlab.training.trainer.TrainConfig`,
so every trainer field — ``max_steps``, ``eval_every``, ``checkpoint_every``, ``seed``, … — is a
setting too, plus the recipe's own: model size, batch, data), named presets (overrides of the
dataclass defaults) and a build function that turns settings into a model, batches, a loss and an
evaluation. Adding a recipe = one module that calls :func:`register`, one entry in
:data:`RECIPE_MODULES` (recipe name -> module, imported only when that recipe is asked for).

:func:`run_recipe` writes the resolved ``config.json`` into the output folder, builds, trains
(under ``torchrun`` too) and writes ``metrics.json``; :func:`evaluate_checkpoint` rebuilds a
run's model from its ``config.json`` and scores a checkpoint (``attnlab eval --checkpoint``).
"""
from __future__ import annotations

import importlib
import inspect
import json
import os
import time
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from attnlab._checks import stored_dtype
from attnlab._io import read_input_json
from attnlab._limits import check_settings, check_training_memory
from attnlab.models.hub import register_folder_reader
from attnlab.training.checkpoint import latest_checkpoint, latest_intact_checkpoint, load_checkpoint
from attnlab.training.distributed import DistInfo, broadcast_object, dist_info_from_env, distributed
from attnlab.training.reporting import write_json
from attnlab.training.run_dir import check_not_file, check_out, open_run
from attnlab.training.trainer import TrainConfig, Trainer

__all__ = ["Recipe", "Built", "RECIPE_MODULES", "RESUME_SETTINGS", "register", "get_recipe", "recipe_names",
           "resolve_settings", "parse_set", "run_recipe", "evaluate_checkpoint", "load_weights_checked"]

# recipe name -> the module that registers it (imported on first lookup of that name)
RECIPE_MODULES = {
    "shakespeare-char": "attnlab.training.recipes.shakespeare",
    "multi30k-de-en": "attnlab.training.recipes.multi30k",
    "mlm": "attnlab.training.recipes.mlm",
    "classify": "attnlab.training.recipes.classify",
    "digits-vit": "attnlab.training.recipes.digits",
}
_REGISTRY: dict[str, "Recipe"] = {}
PathLike = Union[str, os.PathLike]


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
    preset to the goal it is tuned for (shown in ``--help`` and the benchmark).
    """

    name: str
    description: str
    settings: type
    build: Callable[..., Built]
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    targets: Mapping[str, str] = field(default_factory=dict)

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


def parse_set(items: Sequence[str]) -> dict[str, str]:
    """``["key=value", …]`` (the CLI's ``--set``) -> ``{key: value}``; the last of a repeated key wins."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set expects key=value, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def _convert(key: str, raw: str, tp) -> Any:
    """Text -> the dataclass field type ``tp`` (int, float, bool, str, Optional[...], tuple[...])."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType) and type(None) in args:
        if raw.lower() in ("none", "null", ""):
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(key, raw, inner)
    try:
        if origin is tuple:
            parts = [p for p in raw.replace("(", "").replace(")", "").split(",") if p.strip()]
            item_types = args if args and args[-1] is not Ellipsis else [args[0]] * len(parts)
            if len(parts) != len(item_types):
                raise ValueError
            return tuple(_convert(key, p.strip(), t) for p, t in zip(parts, item_types))
        if tp is bool:
            low = raw.lower()
            if low not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                raise ValueError
            return low in ("true", "1", "yes", "on")
        if tp is int:
            return int(raw)
        if tp is float:
            return float(raw)
        if tp is str:
            return raw
    except ValueError:
        pass
    else:
        raise ValueError(f"setting {key!r} has an unsupported type {tp!r}")
    name = tp.__name__ if origin is None and hasattr(tp, "__name__") else str(tp)
    if origin is tuple:
        name += " (comma-separated)"
    raise ValueError(f"--set {key}={raw!r}: expected {name}")


# nanoGPT's names (its train.py config) -> ours, accepted in --set where the recipe has ours; the names the two
# share (n_layer, n_head, n_embd, block_size, batch_size, dropout, weight_decay, min_lr, bias, compile, dtype, ...)
# need no entry
NANOGPT_NAMES = {"max_iters": "max_steps", "learning_rate": "lr", "eval_interval": "eval_every",
                 "eval_iters": "eval_batches", "warmup_iters": "warmup_steps", "grad_clip": "clip",
                 "gradient_accumulation_steps": "grad_accum", "log_interval": "log_every"}


def setting_name(recipe: Recipe, key: str) -> str:
    """``key`` as a setting of ``recipe``: itself, or ours for a nanoGPT name (:data:`NANOGPT_NAMES`).

    Raises:
        ValueError: no such setting; the message lists the valid ones, a close name first if there is one.
    """
    names = [f.name for f in fields(recipe.settings)]
    if key in names:
        return key
    if NANOGPT_NAMES.get(key) in names:
        return NANOGPT_NAMES[key]
    import difflib

    close = difflib.get_close_matches(key, names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ValueError(f"unknown setting {key!r} for recipe {recipe.name}; {hint}valid settings: {', '.join(names)}")


def resolve_settings(recipe: Recipe, *, preset: Optional[str] = None, overrides: Optional[Mapping[str, Any]] = None,
                     base: Optional[Mapping[str, Any]] = None):
    """Settings = dataclass defaults, then ``base`` (a saved config) or the ``preset``, then ``overrides``.

    String override values are converted to the field's type; other values are used as given. An override may
    use nanoGPT's name of a setting (:data:`NANOGPT_NAMES`: ``max_iters`` is ``max_steps``, ...).

    Raises:
        ValueError: unknown preset, unknown setting (the message lists the valid ones), bad value.
    """
    names = [f.name for f in fields(recipe.settings)]
    hints = typing.get_type_hints(recipe.settings)
    if preset is not None and preset not in recipe.presets and preset != "default":
        raise ValueError(f"unknown preset {preset!r} for recipe {recipe.name}; available: "
                         f"{', '.join(['default', *recipe.presets])}")
    if base is not None and preset is not None:
        raise ValueError("give a preset or saved settings (base), not both")
    values: dict[str, Any] = dict(base) if base is not None else dict(recipe.presets.get(preset or "default", {}))
    given: dict[str, str] = {}  # our name -> the name it was given as
    for key, value in (overrides or {}).items():
        name = setting_name(recipe, key)
        if name in given:
            raise ValueError(f"--set {given[name]} and --set {key} are the same setting ({name}): give one of them")
        given[name] = key
        values[name] = _convert(key, value, hints[name]) if isinstance(value, str) else value
    unknown = set(values) - set(names)
    if unknown:
        raise ValueError(f"saved settings {sorted(unknown)} are not settings of recipe {recipe.name}")
    settings = recipe.settings(**values)
    check_settings(settings)  # the bounds config.json has: no 100,000-layer model from a --set
    return settings


def _read_config(out: Path) -> Optional[dict]:
    path = out / "config.json"
    if not path.is_file():
        return None
    return read_input_json("", path, "config")


# Settings that name what a run reads (a run to start from, a teacher, a base model, a data file): --out may not
# be, lie inside or hold any of them.
INPUT_SETTINGS = ("init", "teacher", "model", "data")

# Settings a --resume may change (each applied with one line); any other change is refused: it would make
# the resumed run a different run than the checkpoint's (another model shape, data, seed or optimiser).
RESUME_SETTINGS = ("max_steps", "time_budget", "max_seconds", "eval_every", "checkpoint_every", "keep_checkpoints",
                   "log_every", "progress", "device", "dtype", "compile", "eval_batches", "eval_batch_size")


def _saved_run(out: Path) -> Optional[dict]:
    """``{"recipe", "preset", "settings"}`` of a run folder: from its newest intact checkpoint (the settings
    it was made with), else from ``config.json`` (a run from before checkpoints carried them, or none yet)."""
    if not out.is_dir():
        return None
    _, state = latest_intact_checkpoint(out, warn=lambda line: None)  # the trainer warns when it loads
    if state is not None and isinstance(state.get("run"), dict) and "settings" in state["run"]:
        return state["run"]
    return _read_config(out)


def _resume_settings(recipe: Recipe, saved: dict, overrides: Mapping[str, Any], out: Path, say: Callable[[str], None]):
    """The saved settings with the allowed ``overrides`` applied (one line each); any other change refused."""
    old = resolve_settings(recipe, base=saved.get("settings", {}))
    new = resolve_settings(recipe, base=saved.get("settings", {}), overrides=overrides)
    a, b = asdict(old), asdict(new)
    changed = [k for k in a if a[k] != b[k]]
    refused = [k for k in changed if k not in RESUME_SETTINGS]
    if refused:
        k = refused[0]
        raise ValueError(f"--resume {out}: --set {k}={b[k]!r} would change the run (its checkpoint has {k}={a[k]!r}); "
                         f"settings a resume may change: {', '.join(RESUME_SETTINGS)}. Start a new run with "
                         f"--init {out} to fine-tune from it")
    for k in changed:
        say(f"resume: {k} {a[k]!r} -> {b[k]!r}")
    return new


def _dtype_source(recipe: Recipe, preset: Optional[str], overrides: Mapping[str, Any], *, resumed: bool) -> str:
    """Where the run's ``dtype`` setting came from: the words of its dtype line."""
    if "dtype" in overrides:
        return "asked for"
    if resumed:
        return "the run's saved setting"
    if "dtype" in recipe.presets.get(preset or "default", {}):
        return f"preset {preset}'s default"
    return "recipe default"


def run_recipe(name: str, *, out: PathLike, preset: Optional[str] = None,
               overrides: Optional[Mapping[str, Any]] = None, resume: bool = False) -> dict:
    """Check everything, then lock ``out``, build, write ``out/config.json``, train, write ``out/metrics.json``.

    Nothing is written until the settings, the output folder and (with ``resume``) the compatibility
    with the checkpoint are checked (:mod:`attnlab.training.run_dir`: ``out`` must be new, empty or one
    of our runs, not an input of this command, and not locked by another process). With ``resume`` the
    settings saved in the newest intact checkpoint are the base (``preset``, if given, must be the
    saved one); ``overrides`` may change only :data:`RESUME_SETTINGS`, each with one line. Under
    ``torchrun`` every rank runs this; rank 0 locks and writes.

    Raises:
        ValueError: unknown recipe/preset/setting; ``out`` is not a folder we may write; ``out`` holds
            checkpoints and ``resume`` is False; a resume that would change the run; another process
            holds ``out``.
        FileNotFoundError: the recipe's data is missing (offline: names ``ATTNLAB_DATA_DIR``).
        TrainingDivergedError: the loss became NaN/inf.
    """
    import sys

    t0 = time.perf_counter()
    recipe = get_recipe(name)
    out = Path(out)
    check_not_file(out)  # a file, or under a file: refused before anything is read from it
    main_rank = dist_info_from_env().is_main
    say = (lambda line: print(line, file=sys.stderr)) if main_rank else (lambda line: None)
    saved = _saved_run(out) if resume else None
    if resume and saved is None:
        what = "does not exist" if not out.exists() else "holds no checkpoint or config.json of a run"
        raise ValueError(f"--resume: --out {out} {what}, so there is nothing to resume; drop --resume to start a new run")
    if saved is not None and saved.get("recipe") != name:
        raise ValueError(f"{out} holds a {saved.get('recipe')!r} run, not {name!r}")
    if saved is not None:
        if preset is not None and preset != (saved.get("preset") or "default"):
            raise ValueError(f"{out} was trained with preset {saved.get('preset') or 'default'!r}, not {preset!r}: "
                             "resume it without --preset (use --set to change a setting)")
        preset = saved.get("preset")
        settings = _resume_settings(recipe, saved, overrides or {}, out, say)
    else:
        settings = resolve_settings(recipe, preset=preset, overrides=overrides)
    from attnlab.data.datasets import dataset_files

    check_out(out, inputs=[(f"--set {k}", getattr(settings, k, None)) for k in INPUT_SETTINGS] + dataset_files())
    check_training_memory(settings)  # a batch beyond memory: refused by name before anything is read or built
    latest = latest_checkpoint(out) if out.is_dir() else None
    if latest is not None and not resume:
        raise ValueError(f"{out} already holds checkpoints (latest {latest.name}): resume to continue, or choose "
                         "a new output folder")
    run_info = {"recipe": name, "preset": preset, "settings": asdict(settings)}
    with distributed(settings.device) as dist, \
            open_run(out, recipe=name, write=dist.is_main, share=broadcast_object):  # a refusal reaches every rank
        torch.manual_seed(settings.seed)  # the same initial weights on every rank and every run
        built = recipe.build(settings, out=out, dist=dist, training=True)  # missing data fails here
        if dist.is_main:
            write_json(out / "config.json", {**run_info, "world_size": dist.world_size, "torch": torch.__version__})
        train_cfg = TrainConfig.of(settings)
        trainer = Trainer(built.model, train_cfg, train_batches=built.train_batches, loss_fn=built.loss_fn,
                          evaluate=built.evaluate, out_dir=out, run_info=run_info,
                          dtype_source=_dtype_source(recipe, preset, overrides or {}, resumed=saved is not None))
        metrics = trainer.fit(resume=resume)
        if built.finish is not None and dist.is_main:
            built.model.eval()
            with torch.no_grad():
                metrics.update(built.finish(built.model))
        metrics = {"recipe": name, "preset": preset or "default", **metrics, **built.info,
                   "world_size": dist.world_size, "total_wall_s": time.perf_counter() - t0}
        if dist.is_main:
            write_json(out / "metrics.json", metrics)
    return metrics


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
    if saved is None:
        raise FileNotFoundError(f"no config.json in {directory}: not an `attnlab train` output folder")
    recipe = get_recipe(saved.get("recipe", "?"))
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
