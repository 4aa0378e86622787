"""Hugging Face format in and out: ``config.json`` + ``model.safetensors`` in HF's tensor names.

:func:`from_pretrained` reads a local HF-format directory (``transformers.save_pretrained`` output
or a hub snapshot), or a Hugging Face Hub id through ``huggingface_hub``'s cache
(:func:`resolve_pretrained`), into an attnlab model; :func:`save_pretrained` writes one that
``transformers.AutoModel*.from_pretrained`` loads with identical outputs.

Registration contract (one call per model family, at the bottom of its model file)::

    register("bert", config_from_hf=BertConfig.from_hf,
             architectures={"BertModel": BertModel, "BertForMaskedLM": BertForMaskedLM},
             default="BertModel")

- ``config_from_hf(dict) -> config``: builds the family's config from ``config.json``; raises
  ``ValueError`` naming the field for values it cannot express. The config has ``to_hf() -> dict``
  (including ``"model_type"``), written back as ``config.json``.
- ``architectures``: HF architecture name (``config.json``'s ``architectures[0]``) -> our class;
  ``default`` is used when ``config.json`` names none (or one not registered for the family).
- Each class derives from :class:`PreTrainedMixin` and provides:
  ``__init__(config)``; ``self.config``; ``hf_architecture: str``;
  ``hf_weight_map() -> WeightMap`` (:mod:`attnlab.models.weight_map`): the one declaration of its HF
  tensor names — renames, packed q/k/v, transposes, tied parameters, ignored keys (non-persistent
  buffers such as ``position_ids``, tied copies) and optional ones (filled with zeros of the expected
  shape when a checkpoint omits them: BART's ``final_logits_bias``) — from which the mixin derives
  ``to_hf_state_dict() -> {hf_name: tensor}`` (every tensor HF expects, tied ones once) and
  ``from_hf_state_dict(hf: dict) -> {our_name: tensor}`` (the inverse, for ``load_state_dict``);
  optionally the classmethod ``config_from_hf(dict) -> config``, used instead of the family's (a task
  head's config adds ``id2label`` … to the family's: :mod:`attnlab.models.heads`);
  optionally the classmethod ``adapt_hf_checkpoint(config, hf) -> (config, hf)``, which settles what
  ``config.json`` alone cannot say from the tensors present (T5: an ``lm_head.weight`` of its own
  unties the head) or completes a checkpoint in ways a weight map cannot declare.

The loader checks names and shapes against ``to_hf_state_dict()`` of the freshly built model
*before* anything is copied, so a bad checkpoint never leaves a half-loaded model.
"""
from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from attnlab._checks import float_dtype, one_of, stored_dtype
from attnlab._io import atomic_write, read_input_json
from attnlab.models.hub_id import (CONFIG_NAME, HUB_ALLOW_PATTERNS, SAFETENSORS_NAME, TORCH_NAME,  # noqa: F401
                                   PathLike, resolve_pretrained)  # (resolve_pretrained is public here too)
# the files of a folder, the input checks and the weight map, importable from here as before
from attnlab.models.hub_weights import (SAFETENSORS_INDEX_NAME, _check_config_matches_weights,  # noqa: F401
                                        _listed, check_config_sizes, load_weights)
from attnlab.models.input_checks import check_attention_mask, check_encoder_outputs, check_token_inputs  # noqa: F401
from attnlab.models.weight_map import WeightMap, pack, rename  # noqa: F401  (re-exported for the model files)


@dataclass(frozen=True)
class ModelFamily:
    """A registered HF ``model_type``: how to read its config and which class serves each architecture."""

    model_type: str
    config_from_hf: Callable[[dict], Any]
    architectures: dict[str, type]
    default: str


MODEL_TYPES: dict[str, ModelFamily] = {}
# Model files that register themselves on import; imported on first lookup (they import this module).
BUILTIN_MODULES = ("attnlab.models.bert", "attnlab.models.gpt", "attnlab.models.llama", "attnlab.models.t5",
                   "attnlab.models.bart", "attnlab.models.vit", "attnlab.models.clip", "attnlab.models.heads",
                   "attnlab.models.image_heads")


def _import_builtin() -> None:
    for name in BUILTIN_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:  # a real missing dependency, not a family that is not written yet
                raise


def register(model_type: str, *, config_from_hf: Callable[[dict], Any], architectures: dict[str, type],
             default: str) -> None:
    """Register a model family under HF's ``model_type`` (see the module docstring for the contract).

    Raises:
        ValueError: ``model_type`` is empty, ``architectures`` is empty or lacks ``default``.
        TypeError: ``config_from_hf`` is not callable or an architecture is not a class.
    """
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"model_type must be a non-empty str, got {model_type!r}")
    if not callable(config_from_hf):
        raise TypeError(f"config_from_hf must be callable, got {type(config_from_hf).__name__}")
    if not isinstance(architectures, dict) or not architectures:
        raise ValueError("architectures must be a non-empty dict {HF architecture name: class}")
    for name, cls in architectures.items():
        if not isinstance(cls, type):
            raise TypeError(f"architectures[{name!r}] must be a class, got {type(cls).__name__}")
    one_of("default", default, sorted(architectures))
    MODEL_TYPES[model_type] = ModelFamily(model_type, config_from_hf, dict(architectures), default)


def read_config(path: PathLike) -> tuple[dict, ModelFamily]:
    """``config.json`` of a directory and its registered family.

    Raises:
        FileNotFoundError: the directory or its ``config.json`` is missing.
        ValueError: the JSON is invalid or ``model_type`` is not registered (lists the supported ones).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no such model directory: {str(path)!r}")
    cfg_file = path / CONFIG_NAME
    if not cfg_file.exists():  # a FIFO or device is refused by the read, by name
        raise FileNotFoundError(f"no {CONFIG_NAME} in {str(path)!r}")
    raw = read_input_json("", cfg_file, "config")  # a regular file of plausible size: never a FIFO or /dev/zero
    if not isinstance(raw, dict):
        raise ValueError(f"{str(cfg_file)!r} must hold a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    _import_builtin()
    if model_type is None and isinstance(raw.get("recipe"), str):
        raise ValueError(f"{str(path)!r} is an `attnlab train` run folder (recipe {raw['recipe']!r}), not HF format: "
                         "its model loads once attnlab.training.recipes is imported (the attnlab command does), "
                         "or through attnlab.training.recipes.load_run")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r} in {str(cfg_file)!r}; "
                         f"supported: {sorted(MODEL_TYPES)}")
    return raw, MODEL_TYPES[model_type]


# Readers of model folders that are not HF format, registered by the layer that writes them (the training layer:
# a run folder of checkpoints): ``reader(path, dtype=...) -> model`` in eval mode, or None when ``path`` is not
# theirs. :func:`from_pretrained` asks them before reading ``config.json`` as HF's.
FOLDER_READERS: list[Callable[..., Any]] = []


def register_folder_reader(reader: Callable[..., Any]) -> None:
    """Add ``reader`` to :data:`FOLDER_READERS` (once).

    Raises:
        TypeError: ``reader`` is not callable.
    """
    if not callable(reader):
        raise TypeError(f"reader must be callable, got {type(reader).__name__}")
    if reader not in FOLDER_READERS:
        FOLDER_READERS.append(reader)


def from_pretrained(path: PathLike, *, dtype: Optional[torch.dtype] = None, model_cls: Optional[type] = None,
                    revision: Optional[str] = None, local_files_only: bool = False,
                    cache_dir: Optional[PathLike] = None):
    """Load an HF-format directory, or a Hugging Face Hub id, into the attnlab model its ``config.json`` names.

    Args:
        path: directory with ``config.json`` and ``model.safetensors`` (or ``pytorch_model.bin``), or a
            Hub id ``"org/name"`` (:func:`resolve_pretrained`).
        dtype: cast the model to this dtype; default: the dtype of the stored weights.
        model_cls: load into this class instead of the one ``architectures`` names (it must be
            registered for the checkpoint's ``model_type``).
        revision, local_files_only, cache_dir: for a Hub id, as :func:`resolve_pretrained`.

    Returns:
        The model, in eval mode (as ``transformers`` returns it).

    Raises:
        TypeError: ``dtype`` is not a floating ``torch.dtype``.
        FileNotFoundError: the directory (or Hub id), ``config.json`` or the weights are missing.
        ValueError: unknown ``model_type``; corrupt weights; missing or unexpected tensor names
            (all listed); a tensor of the wrong shape (named, with both shapes); an integer or bool tensor
            for a floating-point parameter (named, with both dtypes).
    """
    float_dtype("dtype", dtype)
    path = resolve_pretrained(path, revision=revision, local_files_only=local_files_only, cache_dir=cache_dir)
    for reader in FOLDER_READERS:
        model = reader(path, dtype=dtype)
        if model is not None:
            if model_cls is not None and not isinstance(model, model_cls):
                raise ValueError(f"{str(path)!r} holds a {type(model).__name__}, not a {model_cls.__name__}")
            return model
    raw, family = read_config(path)
    if model_cls is None:
        archs = raw.get("architectures") or []
        model_cls = family.architectures.get(archs[0] if archs else None, family.architectures[family.default])
    elif model_cls not in family.architectures.values():
        raise ValueError(f"model_cls {model_cls.__name__} is not registered for model_type "
                         f"{family.model_type!r}; registered: {sorted(c.__name__ for c in family.architectures.values())}")
    cfg_file = Path(path) / CONFIG_NAME
    check_config_sizes(raw, where=str(cfg_file))
    try:
        config = getattr(model_cls, "config_from_hf", family.config_from_hf)(raw)  # a task head: + its labels
    except (TypeError, ValueError, KeyError) as e:  # a field of the wrong type or range: name the file
        raise ValueError(f"{str(cfg_file)!r}: {e}") from None
    weights = load_weights(path)
    _check_config_matches_weights(raw, weights, where=str(cfg_file))
    config, hf = model_cls.adapt_hf_checkpoint(config, weights)
    model = model_cls(config)
    expected = model.to_hf_state_dict()
    weight_map = model.hf_weight_map()
    ignored = [re.compile(p) for p in weight_map.ignore]
    hf = {k: v for k, v in hf.items() if k in expected or not any(p.search(k) for p in ignored)}
    hf.update({k: torch.zeros_like(expected[k]) for k in weight_map.optional if k in expected and k not in hf})
    missing, unexpected = sorted(expected.keys() - hf.keys()), sorted(hf.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(f"checkpoint {str(path)!r} does not match {model_cls.__name__}: "
                         f"missing tensors {_listed(missing)}, unexpected tensors {_listed(unexpected)}")
    for name, t in expected.items():
        if hf[name].shape != t.shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(hf[name].shape)} in the checkpoint but "
                             f"{model_cls.__name__} expects {tuple(t.shape)}")
        stored_dtype(f"{name!r} of checkpoint {str(path)!r}", hf[name], t)
    if dtype is None:
        dtype = next((v.dtype for v in hf.values() if v.is_floating_point()), torch.get_default_dtype())
    model = model.to(dtype)
    model.load_state_dict(model.from_hf_state_dict(hf), strict=True)
    return model.eval()


def save_pretrained(model, path: PathLike) -> None:
    """Write ``config.json`` + ``model.safetensors`` (HF names) into ``path`` (created), each atomically.

    Raises:
        TypeError: ``model`` does not implement the :class:`PreTrainedMixin` contract.
    """
    for attr in ("config", "hf_architecture", "to_hf_state_dict"):
        if not hasattr(model, attr):
            raise TypeError(f"model must implement the PreTrainedMixin contract (missing {attr!r}), "
                            f"got {type(model).__name__}")
    from safetensors.torch import save_file

    cfg = model.config.to_hf()  # first: a config HF cannot express is refused before anything is written
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    cfg.update(architectures=[model.hf_architecture], torch_dtype=str(dtype).removeprefix("torch."))
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.to_hf_state_dict().items()}
    atomic_write(path / SAFETENSORS_NAME, lambda f: save_file(tensors, f, metadata={"format": "pt"}))
    atomic_write(path / CONFIG_NAME,
                  lambda f: Path(f).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8"))


class PreTrainedMixin:
    """``Model.from_pretrained(path)`` and ``model.save_pretrained(path)`` for registered models, and the
    two directions of HF's tensor names, both read from the model's :meth:`hf_weight_map`."""

    hf_architecture: str = ""

    def hf_weight_map(self) -> WeightMap:
        """The declaration of this model's HF tensor names (each family defines it; see the module docstring)."""
        raise NotImplementedError(f"{type(self).__name__} must define hf_weight_map()")

    def to_hf_state_dict(self) -> dict[str, Tensor]:
        """Our tensors under HF's names and layout, tied ones once (:meth:`WeightMap.to_hf`)."""
        return self.hf_weight_map().to_hf(self.state_dict())

    def from_hf_state_dict(self, hf: dict[str, Tensor]) -> dict[str, Tensor]:
        """HF's tensors under our names, for ``load_state_dict`` (:meth:`WeightMap.from_hf`)."""
        return self.hf_weight_map().from_hf(hf)

    @classmethod
    def adapt_hf_checkpoint(cls, config, hf: dict[str, Tensor]) -> tuple[Any, dict[str, Tensor]]:
        """``(config, hf)`` completed from what the checkpoint holds; unchanged by default (see the
        module docstring). Runs before the names and shapes are checked."""
        return config, hf

    @classmethod
    def from_pretrained(cls, path: PathLike, *, dtype: Optional[torch.dtype] = None, **hub):
        """Load ``path`` (a folder or a Hub id; ``hub``: ``revision``, ``local_files_only``, ``cache_dir``)
        into this class (see :func:`attnlab.models.hub.from_pretrained`)."""
        return from_pretrained(path, dtype=dtype, model_cls=cls, **hub)

    def save_pretrained(self, path: PathLike) -> None:
        """Write HF-format ``config.json`` + ``model.safetensors`` (see :func:`save_pretrained`)."""
        save_pretrained(self, path)
