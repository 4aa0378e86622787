"""Reading a Hugging Face format folder's files: the weights (``model.safetensors``, its shards, or
``pytorch_model.bin`` through ``weights_only`` unpickling) and the checks of ``config.json``'s sizes against
:mod:`attnlab._limits` and against the weights, made before a model is built
(:func:`attnlab.models.hub.from_pretrained` is the entry that uses them)."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from attnlab._io import check_input_file, read_input_json
from attnlab._limits import FFN, HEADS, HIDDEN, LAYERS, POSITIONS, SIZE_LIMITS, check_size, estimated_parameters
from attnlab.models.hub_id import SAFETENSORS_NAME, TORCH_NAME, PathLike

SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"  # transformers' sharded checkpoints

# Bounds on the sizes a config.json may ask for, checked before anything is allocated: a 1 KB file must not
# make us allocate gigabytes or build thousands of layers. Generous for every released model of these families.
# The bounds are :mod:`attnlab._limits`'s, shared with a recipe's ``--set`` sizes.
_LAYERS, _HEADS, _HIDDEN, _FFN, _POSITIONS = LAYERS, HEADS, HIDDEN, FFN, POSITIONS


def _listed(names: list[str], limit: int = 10) -> str:
    """``names`` as a list, cut after ``limit`` with how many more: a broken checkpoint must not print thousands."""
    if len(names) <= limit:
        return str(names)
    return f"{str(names[:limit])[:-1]}, ... ({len(names) - limit} more)]"


def _size_fields(raw: dict):
    """``(sub-config, its dict)`` pairs: the config and nested ones (CLIP's text_config / vision_config)."""
    yield "", raw
    for key, value in raw.items():
        if isinstance(value, dict) and key.endswith("_config"):
            yield f"{key}.", value


def check_config_sizes(raw: dict, *, where: str) -> None:
    """Every size field of ``config.json`` (and its nested configs) is an int within :data:`SIZE_LIMITS`.

    Raises:
        ValueError: naming the file, the field, its value and the bound.
    """
    for prefix, cfg in _size_fields(raw):
        for names, limit in SIZE_LIMITS.items():
            for name in names:
                if name not in cfg or cfg[name] is None:
                    continue
                check_size(f"{prefix}{name}", cfg[name], limit, where=where)


def _estimated_parameters(raw: dict) -> int:
    """A rough count from the config alone: per layer ``4h² + 2hf`` (attention and feed-forward), plus the
    token and position tables. Within a small factor of the real count for the families here."""
    return sum(estimated_parameters(cfg) for _, cfg in _size_fields(raw))


def _check_config_matches_weights(raw: dict, weights: dict, *, where: str) -> None:
    """Refuse a config that describes a model far larger than its weights (checked before building it)."""
    stored = sum(t.numel() for t in weights.values())
    estimated = _estimated_parameters(raw)
    if estimated > 64 * stored + 10_000_000:  # the estimate is rough; this only stops configs far from their weights
        raise ValueError(f"{where!r} describes a model of ~{estimated:,} parameters, but the weights beside it hold "
                         f"{stored:,}: the config does not belong to these weights")


def load_weights(path: PathLike) -> dict[str, Tensor]:
    """The tensors of ``model.safetensors`` (preferred), of the shards ``model.safetensors.index.json`` lists
    (``save_pretrained(max_shard_size=...)``), or of ``pytorch_model.bin`` (``weights_only`` unpickling).

    Raises:
        FileNotFoundError: none of these exists in ``path``, or a listed shard is missing.
        ValueError: a file is corrupt or truncated (the message names it); an index that is not a
            ``{"weight_map": {tensor: shard file}}`` object, names a shard outside ``path``, or does not
            match what its shards hold.
    """
    path = Path(path)
    st, pt, index = path / SAFETENSORS_NAME, path / TORCH_NAME, path / SAFETENSORS_INDEX_NAME
    if st.exists():
        return _read_safetensors(st)
    if index.exists():
        return _load_sharded(path, index)
    if pt.exists():
        check_input_file("", pt, "weights")
        try:
            sd = torch.load(str(pt), map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises several types (UnpicklingError, RuntimeError, EOFError) here
            raise ValueError(f"cannot read {str(pt)!r} (corrupt, truncated or not a plain state dict): {e}") from e
        if not isinstance(sd, dict) or not all(isinstance(v, Tensor) for v in sd.values()):
            raise ValueError(f"{str(pt)!r} must hold a dict of tensors")
        return sd
    raise FileNotFoundError(f"no {SAFETENSORS_NAME}, {SAFETENSORS_INDEX_NAME} or {TORCH_NAME} in {str(path)!r}")


def _read_safetensors(file: Path) -> dict[str, Tensor]:
    check_input_file("", file, "weights")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise ValueError(f"cannot read {str(file)!r} (corrupt or truncated safetensors file): {e}") from e


def _load_sharded(folder: Path, index: Path) -> dict[str, Tensor]:
    """The tensors of every shard ``index``'s ``weight_map`` names, each shard a file directly in ``folder``
    holding exactly the tensors the map assigns to it."""
    raw = read_input_json("", index)
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if (not isinstance(weight_map, dict) or not weight_map
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())):
        raise ValueError(f"{str(index)!r}: weight_map must be a non-empty object {{tensor name: shard file}}")
    root = folder.resolve()
    shards: dict[str, set[str]] = {}
    for name, shard in weight_map.items():
        shards.setdefault(shard, set()).add(name)
    out: dict[str, Tensor] = {}
    for shard, names in shards.items():
        file = (folder / shard).resolve()
        if Path(shard).is_absolute() or file.parent != root:
            raise ValueError(f"{str(index)!r} names the shard {shard!r}, which is not a file directly in "
                             f"{str(folder)!r}: refused")
        if not file.is_file():
            raise FileNotFoundError(f"{str(index)!r} names the shard {shard!r}, which is missing")
        tensors = _read_safetensors(file)
        missing, extra = sorted(names - tensors.keys()), sorted(tensors.keys() - names)
        if missing or extra:
            raise ValueError(f"shard {shard!r} does not match {str(index)!r}: tensors the index assigns to it but "
                             f"it lacks {_listed(missing)}, tensors it holds that the index assigns elsewhere "
                             f"{_listed(extra)}")
        out.update(tensors)
    return out
