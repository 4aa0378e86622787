"""Hub ids: ``"org/name"`` resolved to a local snapshot folder through ``huggingface_hub`` (its cache,
``HF_HUB_OFFLINE`` and ``HF_TOKEN`` untouched), fetching only configs, safetensors weights and tokenizer files;
a folder is returned as it is (an `attnlab train` run folder: the HF-format ``model/`` its recipe wrote, if any).
:func:`attnlab.models.hub.from_pretrained` reads what this returns.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

from attnlab._io import read_input_json

PathLike = Union[str, os.PathLike]
CONFIG_NAME, SAFETENSORS_NAME, TORCH_NAME = "config.json", "model.safetensors", "pytorch_model.bin"


# What a snapshot of a Hub id brings: the config, the safetensors weights and the tokenizer files (never pickles).
HUB_ALLOW_PATTERNS = ("config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
                      "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json", "merges.txt",
                      "generation_config.json", "preprocessor_config.json")


def run_model_folder(path: Path) -> Path:
    """``path/model`` when ``path`` is an `attnlab train` run folder (a ``config.json`` naming its ``recipe``) whose
    recipe wrote the trained model there in HF format (``classify``, ``digits-vit``); else ``path``."""
    inner = path / "model"
    if not (path / CONFIG_NAME).is_file() or not (inner / CONFIG_NAME).is_file():
        return path
    try:
        raw = read_input_json("", path / CONFIG_NAME, "config")
    except (OSError, ValueError):
        return path  # read_config reports a bad config.json by name
    return inner if isinstance(raw, dict) and isinstance(raw.get("recipe"), str) and "model_type" not in raw else path


def resolve_pretrained(name_or_path: PathLike, *, revision: Optional[str] = None, local_files_only: bool = False,
                       cache_dir: Optional[PathLike] = None) -> Path:
    """The local folder of a model: ``name_or_path`` itself when it is a folder, else the snapshot of the
    Hugging Face Hub id ``"org/name"`` in ``huggingface_hub``'s cache, downloaded if needed
    (:data:`HUB_ALLOW_PATTERNS` only; ``pytorch_model.bin`` only for a repository without safetensors, and
    then read with ``weights_only=True``). The cache, ``HF_HUB_OFFLINE``, ``HF_HUB_CACHE`` and ``HF_TOKEN``
    work as in ``huggingface_hub``; nothing here sets them.

    Args:
        name_or_path: a model folder (``config.json`` + weights), or a Hub id such as ``"bert-base-uncased"``
            or ``"org/name"``.
        revision: a branch, tag or commit of the Hub id (default ``"main"``); not for a folder.
        local_files_only: use the cache only, never the network.
        cache_dir: the cache folder (default: ``huggingface_hub``'s, i.e. ``HF_HUB_CACHE``).

    Raises:
        TypeError: ``name_or_path`` is not a ``str`` or path.
        ValueError: ``revision`` given with a folder.
        FileNotFoundError: neither an existing folder nor a valid Hub id (both named), or the id is not in
            the cache while downloads are off (``HF_HUB_OFFLINE`` / ``local_files_only``) or the Hub cannot
            be reached, or the Hub has no such repository or revision; always one line naming the id.
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"name_or_path must be a model folder or a Hub id (str), got {type(name_or_path).__name__}")
    if str(name_or_path).strip() == "":  # Path("") is the current folder: never what an empty name meant
        raise FileNotFoundError("no model named: give a model folder or a Hub id 'org/name', got an empty string")
    path = Path(name_or_path)
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"revision={revision!r} is for a Hub id, but {str(path)!r} is a local folder")
        return run_model_folder(path)
    if path.exists():
        raise FileNotFoundError(f"no such model directory: {str(path)!r} is a file (give the folder holding "
                                f"{CONFIG_NAME} and the weights, or a Hub id 'org/name')")
    if not isinstance(name_or_path, str):  # a Path names a folder, never a Hub id
        raise FileNotFoundError(f"no such model directory: {str(path)!r}")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (EntryNotFoundError, HfHubHTTPError, HFValidationError,
                                        LocalEntryNotFoundError, OfflineModeIsEnabled, RepositoryNotFoundError,
                                        RevisionNotFoundError)
    from huggingface_hub.utils import validate_repo_id

    name = name_or_path
    try:
        validate_repo_id(name)
    except HFValidationError as e:
        raise FileNotFoundError(f"no such model directory: {name!r}, and it is not a Hugging Face Hub id either "
                                f"('name' or 'org/name': {_first_line(e)})") from None
    where = f"Hub id {name!r}" + (f" at revision {revision!r}" if revision is not None else "")
    # offline is local-only: said explicitly, since some huggingface_hub versions (1.x) still list the tree of a
    # commit-hash revision online under HF_HUB_OFFLINE and fail instead of reading the cache
    kw = dict(repo_id=name, revision=revision, cache_dir=cache_dir,
              local_files_only=bool(local_files_only) or bool(constants.HF_HUB_OFFLINE))
    try:
        folder = Path(snapshot_download(allow_patterns=list(HUB_ALLOW_PATTERNS), **kw))
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:  # which one offline depends on the hub's version
        cache = cache_dir if cache_dir is not None else constants.HF_HUB_CACHE
        if constants.HF_HUB_OFFLINE:
            why = "HF_HUB_OFFLINE is set, so nothing is downloaded"
        elif local_files_only:
            why = "local_files_only=True, so nothing is downloaded"
        else:
            why = f"the Hub could not be reached ({_first_line(e)})"
        raise FileNotFoundError(f"{name!r} is not a local folder, and the {where} is not (completely) in the "
                                f"Hugging Face cache {str(cache)!r}: {why}") from None
    except RevisionNotFoundError:
        raise FileNotFoundError(f"the Hub repository {name!r} has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"{name!r} is neither a local folder nor a Hub repository readable here "
                                "(not found, private or gated: HF_TOKEN gives access)") from None
    except HfHubHTTPError as e:
        raise FileNotFoundError(f"cannot download the {where}: {_first_line(e)}") from None
    if not any(folder.glob("*.safetensors")):  # an older repository: its pickle, read with weights_only=True
        try:
            folder = Path(snapshot_download(allow_patterns=[TORCH_NAME], **kw))
        except (EntryNotFoundError, HfHubHTTPError):
            pass  # load_weights names the folder and the files it lacks
    return folder


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


