"""A recipe's settings: ``--set key=value`` parsing, each value converted to its dataclass field's type, nanoGPT's
names of the same settings, and the resolution defaults -> preset or saved settings -> overrides."""
from __future__ import annotations

import types
import typing
from dataclasses import fields
from typing import Any, Mapping, Optional, Sequence, Union

from attnlab._limits import check_settings
from attnlab.training.recipes.registry import Recipe


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
