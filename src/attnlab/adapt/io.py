"""Save and load only the adapter weights — LoRA, bottleneck adapters, soft prompts, prefixes —
and put them back onto a base checkpoint.

An adapter directory holds two files, each written atomically:

- ``adapter_model.safetensors``: the adapter tensors only, under their names in the adapted model;
- ``adapter_config.json``: ``{"format": 1, "adapters": {kind: settings}, "base_shapes": {name: shape}}``
  where ``kind`` is ``lora`` (r, alpha, dropout, targets), ``houlsby`` (bottleneck, activation,
  sublayers), ``prompt`` or ``prefix`` (num_tokens), and ``base_shapes`` is the fingerprint of the base
  model: the shape of every base parameter, so an adapter is never put on a base of another shape.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Union

import torch
from torch import Tensor, nn

from attnlab._checks import stored_dtype
from attnlab.adapt.adapters import (
    BottleneckAdapter,
    adapter_layers,
    adapters_config,
    apply_adapters_config,
    remove_adapters,
)
from attnlab.adapt.lora import LoRALinear, apply_lora_config, lora_config, lora_layers, unload_lora
from attnlab.adapt.prompt import PROMPT_KINDS, _VirtualTokensLM

PathLike = Union[str, os.PathLike]
CONFIG_FILE, WEIGHTS_FILE, FORMAT = "adapter_config.json", "adapter_model.safetensors", 1


def _adapter_param_ids(model: nn.Module) -> set[int]:
    ids: set[int] = set()
    for m in model.modules():
        if isinstance(m, (LoRALinear, _VirtualTokensLM)):
            ids |= {id(p) for _, p in m.adapter_named_parameters()}
        elif isinstance(m, BottleneckAdapter):
            ids |= {id(p) for p in m.parameters()}
    return ids


def adapter_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Every adapter tensor of ``model`` (LoRA ``A``/``B``, adapters, prompts, prefixes), detached."""
    ids = _adapter_param_ids(model)
    return {n: p.detach() for n, p in model.named_parameters() if id(p) in ids}


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter counts (tied parameters counted once; the total includes adapters)."""
    params = list(model.parameters())  # de-duplicated by nn.Module
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def _base(model: nn.Module) -> nn.Module:
    return model.model if isinstance(model, _VirtualTokensLM) else model


def base_shapes(model: nn.Module) -> dict[str, list[int]]:
    """``{parameter name: shape}`` of the base model under ``model``'s adapters (its fingerprint):
    adapter parameters are left out and LoRA's ``<layer>.base.`` is read as ``<layer>.``."""
    base = _base(model)
    skip = _adapter_param_ids(base)
    lora = [f"{n}.base." for n in lora_layers(base)]
    out = {}
    for name, p in base.named_parameters():
        if id(p) in skip:
            continue
        for prefix in lora:
            if name.startswith(prefix):
                name = prefix[:-len("base.")] + name[len(prefix):]
                break
        out[name] = list(p.shape)
    return out


def adapter_config(model: nn.Module) -> dict:
    """``{"format", "adapters": {kind: settings}, "base_shapes"}`` of an adapted model.

    Raises:
        ValueError: the model has no adapters.
    """
    base = _base(model)
    kinds = {}
    if isinstance(model, _VirtualTokensLM):
        kinds[model.kind] = model.adapter_config()
    if (cfg := lora_config(base)) is not None:
        kinds["lora"] = cfg
    if (cfg := adapters_config(base)) is not None:
        kinds["houlsby"] = cfg
    if not kinds:
        raise ValueError(f"model ({type(model).__name__}) has no adapters (LoRA, bottleneck adapters, "
                         "soft prompt or prefix) to save")
    return {"format": FORMAT, "adapters": kinds, "base_shapes": base_shapes(model)}


def save_adapter(model: nn.Module, path: PathLike) -> None:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into the directory ``path``.

    Raises:
        ValueError: the model has no adapters.
    """
    from safetensors.torch import save_file

    from attnlab._io import atomic_write

    config = adapter_config(model)
    tensors = {k: v.contiguous().cpu() for k, v in adapter_state_dict(model).items()}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    atomic_write(path / WEIGHTS_FILE, lambda f: save_file(tensors, f, metadata={"format": "pt"}))
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    atomic_write(path / CONFIG_FILE, lambda f: Path(f).write_text(text, encoding="utf-8"))


def read_adapter_config(path: PathLike) -> dict:
    """The validated ``adapter_config.json`` of an adapter directory.

    Raises:
        FileNotFoundError: ``path`` or its files are missing.
        ValueError: the JSON is invalid, of another format, or names an unknown adapter kind.
    """
    path = Path(path)
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / f).exists():
            raise FileNotFoundError(f"no {f} in adapter directory {str(path)!r}")
    from attnlab._io import read_input_json

    cfg = read_input_json("", path / CONFIG_FILE, "config")
    if not isinstance(cfg, dict) or cfg.get("format") != FORMAT or not isinstance(cfg.get("adapters"), dict) \
            or not isinstance(cfg.get("base_shapes"), dict):
        raise ValueError(f"{str(path / CONFIG_FILE)!r} is not an attnlab adapter config (format {FORMAT})")
    unknown = set(cfg["adapters"]) - {"lora", "houlsby", *PROMPT_KINDS}
    if unknown or len(set(cfg["adapters"]) & set(PROMPT_KINDS)) > 1:
        raise ValueError(f"{str(path / CONFIG_FILE)!r} has unknown or conflicting adapter kinds "
                         f"{sorted(cfg['adapters'])}")
    return cfg


def check_base(model: nn.Module, expected: dict[str, list[int]]) -> None:
    """Raise ValueError naming the first parameter whose shape (or presence) differs from ``expected``."""
    have = base_shapes(model)
    for name in sorted(set(have) | set(expected)):
        if name not in have:
            raise ValueError(f"the adapter's base model has a parameter {name!r} {tuple(expected[name])} "
                             f"that this {type(model).__name__} lacks: it was trained on another base model")
        if name not in expected:
            raise ValueError(f"this {type(model).__name__} has a parameter {name!r} {tuple(have[name])} that the "
                             "adapter's base model lacks: it was trained on another base model")
        if list(have[name]) != list(expected[name]):
            raise ValueError(f"parameter {name!r} has shape {tuple(have[name])} in this {type(model).__name__} but "
                             f"{tuple(expected[name])} in the adapter's base model: it was trained on another base")


def load_adapter(model: nn.Module, path: PathLike) -> nn.Module:
    """Put a saved adapter onto a base model (one without adapters, e.g. fresh from ``from_pretrained``).

    LoRA and bottleneck adapters are added in place; a soft prompt or prefix wraps the model in
    :class:`~attnlab.adapt.prompt.PromptTuningLM` / ``PrefixTuningLM``. Use the returned model.

    Returns:
        The adapted model, its base frozen, with the saved adapter weights.

    Raises:
        FileNotFoundError: the directory or one of its files is missing.
        ValueError: the model already has adapters; the base differs in shape from the adapter's base
            (the message names the parameter); the saved tensors do not match the config; an integer or bool
            tensor for a floating-point parameter (named, with both dtypes).
    """
    from safetensors.torch import load_file

    cfg = read_adapter_config(path)
    if lora_layers(model) or adapter_layers(model) or isinstance(model, _VirtualTokensLM):
        raise ValueError("load_adapter needs a base model without adapters; this one already has some")
    check_base(model, cfg["base_shapes"])
    from attnlab._io import check_input_file

    check_input_file("", Path(path) / WEIGHTS_FILE, "weights")
    try:
        saved = load_file(str(Path(path) / WEIGHTS_FILE))
    except Exception as e:  # safetensors raises SafetensorError / OSError on a corrupt file
        raise ValueError(f"cannot read {str(Path(path) / WEIGHTS_FILE)!r} (corrupt or truncated): {e}") from e
    base, kinds = model, cfg["adapters"]
    flags = [(p, p.requires_grad) for p in base.parameters()]
    if "lora" in kinds:
        apply_lora_config(model, kinds["lora"])
    if "houlsby" in kinds:
        apply_adapters_config(model, kinds["houlsby"])
    for kind, cls in PROMPT_KINDS.items():
        if kind in kinds:
            model = cls(model, num_tokens=kinds[kind]["num_tokens"])
    expected = adapter_state_dict(model)
    missing, unexpected = sorted(expected.keys() - saved.keys()), sorted(saved.keys() - expected.keys())
    wrong = [n for n in sorted(expected.keys() & saved.keys()) if saved[n].shape != expected[n].shape]
    try:
        if missing or unexpected or wrong:
            raise ValueError(f"{str(Path(path) / WEIGHTS_FILE)!r} does not match its config: missing tensors "
                             f"{missing[:5]}, unexpected tensors {unexpected[:5]}, wrong shapes {wrong[:5]}")
        for name in sorted(saved):
            stored_dtype(f"{name!r} of {str(Path(path) / WEIGHTS_FILE)!r}", saved[name], expected[name])
    except ValueError:
        if lora_layers(base):  # leave the caller's model as it came
            unload_lora(base, merge=False)
        if adapter_layers(base):
            remove_adapters(base)
        for p, flag in flags:
            p.requires_grad_(flag)
        raise
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in saved.items():
            params[name].copy_(t)
    return model
