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

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch

from attnlab._limits import check_training_memory
from attnlab.training.checkpoint import latest_checkpoint, latest_intact_checkpoint
from attnlab.training.distributed import broadcast_object, dist_info_from_env, distributed
# the registry, the settings and the reading of run folders, importable from here as before
from attnlab.training.recipes.loading import (LoadedRun, PathLike, _read_config, evaluate_checkpoint,  # noqa: F401
                                              load_run, load_weights_checked, read_run_folder)
from attnlab.training.recipes.registry import (RECIPE_MODULES, Built, Recipe, get_recipe,  # noqa: F401
                                               recipe_names, register)
from attnlab.training.recipes.settings import NANOGPT_NAMES, parse_set, resolve_settings, setting_name  # noqa: F401
from attnlab.training.reporting import write_json
from attnlab.training.run_dir import check_not_file, check_out, open_run
from attnlab.training.trainer import TrainConfig, Trainer

__all__ = ["Recipe", "Built", "RECIPE_MODULES", "RESUME_SETTINGS", "register", "get_recipe", "recipe_names",
           "resolve_settings", "parse_set", "run_recipe", "evaluate_checkpoint", "load_weights_checked"]

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
    if saved is not None and saved.get("recipe") is None:
        raise ValueError(f"--resume: --out {out} is not a training run (its config.json names no recipe)")
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
    # a batch beyond memory: refused by name before anything is read or built
    check_training_memory(settings, recipe.training_shape(settings) if recipe.training_shape else None)
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
