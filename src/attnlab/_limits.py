"""Bounds on every size a user can ask for, checked before anything is built or allocated.

One table for the sizes of a model (:data:`SIZE_LIMITS`: layers, heads, widths, vocabulary, positions), used by
``config.json`` (:func:`attnlab.models.hub.check_config_sizes`) and by a recipe's settings (``--set n_layer=…``,
:func:`check_settings`) alike; the common flags' checks (:func:`check_seed`, :func:`check_threads`,
:func:`check_device`); and :func:`check_memory`, which compares an allocation's size with the memory this
machine has free before it is made — a training step's (:func:`check_training_memory`, every recipe), a forward
pass's with or without its attention maps (:func:`check_forward_memory`: ``predict``'s batches, ``viz`` and
``analyze``), a ``generate`` call's caches of every row and beam (``attnlab.generation.generation_bytes``). Every refusal is one ``ValueError`` naming the argument and its valid range.
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Optional

from attnlab._checks import is_int

__all__ = ["SIZE_LIMITS", "SETTING_LIMITS", "LENGTH_LIMIT", "BATCH_LIMIT", "STEPS_LIMIT", "MAX_THREADS",
           "SEED_LIMIT", "check_size", "check_settings",
           "check_model_sizes", "check_seed", "check_threads", "check_device", "available_memory", "check_memory",
           "check_elements", "estimated_parameters",
           "max_positions", "forward_bytes", "check_forward_memory", "TrainingShape", "transformer_training_bytes",
           "model_sizes", "training_shape", "check_training_memory"]

# field names -> the largest value: generous for every released model (a config.json of 1 KB must not build
# thousands of layers or allocate gigabytes)
LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "num_encoder_layers", "encoder_layers",
          "decoder_layers")
HEADS = ("num_attention_heads", "n_head", "num_heads", "num_key_value_heads", "encoder_attention_heads",
         "decoder_attention_heads")
HIDDEN = ("hidden_size", "n_embd", "d_model", "d_kv", "projection_dim", "dim")
FFN = ("intermediate_size", "n_inner", "d_ff", "encoder_ffn_dim", "decoder_ffn_dim", "ffn_dim")
POSITIONS = ("max_position_embeddings", "n_positions", "relative_attention_num_buckets", "image_size",
             "max_positions")
SIZE_LIMITS = {LAYERS: 1024, HEADS: 1024, HIDDEN: 65536, FFN: 1 << 20, ("vocab_size",): 1 << 22,
               POSITIONS: 1 << 20}

# a recipe's settings beyond the model's sizes: context, batch and window lengths
LENGTH_LIMIT = 1 << 20  # tokens in a sequence, a context, a window
BATCH_LIMIT = 1 << 16  # rows in a batch
STEPS_LIMIT = 1 << 40  # optimizer steps, or steps between evaluations, checkpoints or log lines
SETTING_LIMITS = {**SIZE_LIMITS, ("block_size", "max_len", "max_tokens", "window"): LENGTH_LIMIT,
                  ("batch_size", "eval_batch_size", "decode_batch"): BATCH_LIMIT, ("num_beams",): 1024,
                  ("max_steps", "warmup_steps", "eval_every", "checkpoint_every", "log_every", "grad_accum",
                   "keep_checkpoints"): STEPS_LIMIT}

MAX_THREADS = 1024  # more is never a thread count, always a typo
SEED_LIMIT = 1 << 63  # torch.manual_seed takes [0, 2**63) without wrapping


def check_size(name: str, value: Any, limit: int, *, where: str = "") -> None:
    """``value`` must be an int in ``[0, limit]``. Raises ValueError naming ``where`` (a file), ``name`` and the range."""
    if not (is_int(value) and 0 <= value <= limit):
        prefix = f"{where!r}: " if where else ""
        raise ValueError(f"{prefix}{name}={value!r} is out of range (an int in [0, {limit:,}])")


def check_settings(settings: Any, *, prefix: str = "--set ") -> None:
    """Every size field of a recipe's settings (a dataclass) within :data:`SETTING_LIMITS`, and ``seed`` within
    :data:`SEED_LIMIT`. Raises ValueError naming ``--set field=value`` and the range."""
    for names, limit in SETTING_LIMITS.items():
        for name in names:
            value = getattr(settings, name, None)
            if value is not None and is_int(value):
                check_size(f"{prefix}{name}", value, limit)
    seed = getattr(settings, "seed", None)
    if seed is not None:
        check_seed(f"{prefix}seed", seed)


def check_model_sizes(config: Any) -> None:
    """Every size field of a model's config (a dataclass: ``GPT2Config(n_layer=…)``) within :data:`SIZE_LIMITS`,
    and its weights (:func:`estimated_parameters`, in torch's default dtype: the one layers are built in, before any
    cast) within free memory (:func:`check_memory`), checked when the config is made, before a layer is built. Raises
    ValueError naming ``field=value`` and the range, or the sizes and the memory free."""
    for names, limit in SIZE_LIMITS.items():
        for name in names:
            value = getattr(config, name, None)
            if value is not None and is_int(value):
                check_size(name, value, limit)
    n = estimated_parameters(vars(config))
    sizes = ", ".join(f"{k}={v}" for k, v in vars(config).items()
                      if is_int(v) and any(k in names for names in SIZE_LIMITS))
    import torch

    check_memory(f"{type(config).__name__}({sizes}): about {n:,} parameters,",
                 n * torch.empty((), dtype=torch.get_default_dtype()).element_size())


def estimated_parameters(fields: dict) -> int:
    """A rough count from a config's size fields alone: per layer ``4h² + 2hf`` (attention and feed-forward), plus
    the token and position tables. Within a small factor of the real count for the families here."""
    def size(names):
        return max((fields[n] for n in names if is_int(fields.get(n))), default=0)

    # encoder + decoder stacks (T5: num_layers + num_decoder_layers; BART: encoder_ + decoder_layers)
    layers = sum(fields[n] for n in LAYERS if is_int(fields.get(n)))
    h = size(HIDDEN)
    f = size(FFN) or 4 * h
    return layers * (4 * h * h + 2 * h * f) + (size(("vocab_size",)) + size(POSITIONS[:2])) * h


def check_seed(name: str, value: Any) -> None:
    """``value`` must be an int in ``[0, 2**63)``."""
    if not (is_int(value) and 0 <= value < SEED_LIMIT):
        raise ValueError(f"{name} must be an int in [0, 2**63), got {value!r}")


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_threads(name: str, value: Any) -> None:
    """``value`` must be an int in ``[1, MAX_THREADS]``; above this process's cores it is kept, with a warning
    on standard error (the threads would share cores and run slower)."""
    if not (is_int(value) and 1 <= value <= MAX_THREADS):
        raise ValueError(f"{name} must be an int in [1, {MAX_THREADS}], got {value!r}")
    cores = _cores()
    if value > cores:
        print(f"warning: {name} {value} is more than the {cores} cores this process may use; threads will share "
              "cores and run slower", file=sys.stderr)


def check_device(name: str, value: Optional[str]) -> None:
    """``value`` must be ``cpu``, ``cuda`` or ``cuda:N`` (N an index of a present GPU); None passes.

    Raises:
        ValueError: another device type (mps, xla, meta, ...), a malformed name, or CUDA absent / N too large.
    """
    if value is None:
        return
    if not isinstance(value, str) or not re.fullmatch(r"cpu|cuda(:\d{1,4})?", value):
        raise ValueError(f"{name} must be one of cpu, cuda, cuda:N, got {value!r}")
    if value.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"{name} {value}: CUDA is not available on this machine (valid here: cpu)")
        n = torch.cuda.device_count()
        if ":" in value and int(value.split(":")[1]) >= n:
            raise ValueError(f"{name} {value}: this machine has {n} CUDA device(s), cuda:0 to cuda:{n - 1}")


def available_memory() -> Optional[int]:
    """Bytes of memory this machine can give now (Linux's ``MemAvailable``: free pages plus the page cache it can
    drop; psutil's ``available`` where installed), or None where it cannot say (then nothing is refused)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # psutil is optional: read the kernel's own figure
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(what: str, nbytes: int, *, device: Any = "cpu") -> None:
    """Refuse an allocation of ``nbytes`` that the device cannot hold: the free memory of the CPU (or of the
    CUDA device). ``what`` names the argument that sized it, e.g. ``"--window 1000000000"``.

    Raises:
        ValueError: naming ``what``, the bytes needed and the bytes free (never a MemoryError half-way).
    """
    free = None
    if str(device).startswith("cuda"):
        import torch

        try:
            free = torch.cuda.mem_get_info(torch.device(device))[0]
        except (RuntimeError, AssertionError):
            free = None
    else:
        free = available_memory()
    if free is not None and nbytes > free:
        raise ValueError(f"{what} needs {_gib(nbytes)} of memory, but {_gib(free)} is free: choose a smaller value")


def check_elements(what: str, *sizes: int, bytes_per_value: int = 4, device: Any = "cpu") -> None:
    """:func:`check_memory` of a tensor (or weights) of ``prod(sizes)`` values: a table, a cache or a layer sized by
    the arguments ``what`` names, refused before it is allocated."""
    n = 1
    for s in sizes:
        n *= int(s)
    check_memory(what, n * bytes_per_value, device=device)


def _first(obj: Any, names) -> tuple[Optional[str], Optional[int]]:
    """``(name, value)`` of the first of ``names`` that ``obj`` holds as an int, else ``(None, None)``."""
    return next(((n, getattr(obj, n)) for n in names if is_int(getattr(obj, n, None))), (None, None))


def max_positions(config: Any) -> Optional[int]:
    """The most token positions a model of ``config`` takes (``max_position_embeddings`` / ``n_positions``), or
    None where it does not say (relative or rotary positions without a bound)."""
    return _first(config, ("max_position_embeddings", "n_positions", "max_positions"))[1]


def forward_bytes(config: Any, *, batch: int, seq: int, maps: bool = False, bytes_per_value: int = 4) -> Optional[int]:
    """The memory one forward pass without gradients of a Transformer of ``config`` needs for ``batch`` rows of
    ``seq`` tokens: a layer's activations (hidden states, queries/keys/values, the feed-forward: ~8 widths a
    token) and its attention scores and weights (``2·heads·seq²`` a row), plus, with ``maps`` (every layer's
    weights kept, as ``viz`` and ``analyze`` keep them), ``layers·heads·seq²`` a row. None where ``config`` does
    not say its width, heads and layers."""
    _, width = _first(config, HIDDEN)
    _, heads = _first(config, HEADS)
    layers = sum(getattr(config, n) for n in LAYERS if is_int(getattr(config, n, None)))
    if width is None or heads is None or not layers:
        return None
    per_row = seq * width * 8 + 2 * heads * seq * seq + (layers * heads * seq * seq if maps else 0)
    return int(batch * per_row * bytes_per_value)


def check_forward_memory(what: str, config: Any, *, batch: int, seq: int, maps: bool = False,
                         device: Any = "cpu") -> None:
    """:func:`check_memory` of :func:`forward_bytes`: refuse a forward pass whose activations (and, with
    ``maps``, attention maps) would not fit, naming ``what`` (the argument that sized it)."""
    need = forward_bytes(config, batch=batch, seq=seq, maps=maps)
    if need is not None:
        check_memory(what, need, device=device)


@dataclass(frozen=True)
class TrainingShape:
    """The sizes a training step's memory follows (:func:`transformer_training_bytes`): ``batch`` examples of
    ``seq`` positions through ``layers`` layers of ``width`` and ``heads``, ``outputs`` logits a position, and
    ``parameters`` trained; ``what`` names the settings that chose them, as a refusal cites them
    (``"--set batch_size=4096 with block_size=256, n_embd=256, n_layer=4"``)."""

    what: str
    batch: int
    seq: int
    width: int
    layers: int
    heads: int
    outputs: int
    parameters: int


def transformer_training_bytes(*, batch: int, seq: int, width: int, layers: int, heads: int, vocab: int,
                               parameters: int = 0, bytes_per_value: int = 4) -> int:
    """The memory a training step of a Transformer holds at its peak::

        L · s·b·h·(34 + 5·a·s/h) · v/2    the activations kept for the backward pass
        + 3 · b·s·V · v                  the logits, their softmax and its gradient
        + 16 · P                         float32 weights, gradients and AdamW's two moments

    The per-layer count ``s·b·h·(34 + 5·a·s/h)`` bytes of 2-byte values (batch ``b``, sequence ``s``, width ``h``,
    ``a`` heads) is Korthikanti et al. 2022, "Reducing Activation Recomputation", scaled to ``v = bytes_per_value``
    (4: float32, also where a step computes in bfloat16, whose layers keep float32 copies beside). The safety
    factor is 1: the estimate is of the peak, not a bound on either side — for the recipes here it lies between
    about 0.7 and 1.3 times the memory a step adds (ViT patches and character blocks, batches of 16 to 16,384) —
    so a refusal is never far from the memory the step would have needed, and no setting that fits is refused
    by much."""
    per_layer = seq * batch * width * (34 + 5 * heads * seq / width) * bytes_per_value / 2
    return int(layers * per_layer + 3 * batch * seq * vocab * bytes_per_value + 16 * parameters)


def training_shape(settings: Any) -> Optional[TrainingShape]:
    """The :class:`TrainingShape` a recipe's settings name in their fields: a width, heads and layers
    (:data:`HIDDEN`, :data:`HEADS`, :data:`LAYERS`), a sequence (``block_size`` or ``max_len``), a batch
    (``batch_size``, or ``max_tokens`` of them), ``vocab_size`` (256 when absent: a byte-level vocabulary); None
    where they do not (a recipe whose model comes from a folder says its shape itself)."""
    seq_name, seq = _first(settings, ("block_size", "max_len"))
    sizes = model_sizes(vars(settings))
    if sizes is None or seq is None:
        return None
    batch_name, batch = _first(settings, ("batch_size",))
    if batch is None:
        batch_name, tokens = _first(settings, ("max_tokens",))  # a batch of so many tokens
        if tokens is None:
            return None
        batch = max(1, tokens // max(seq, 1))
    vocab = getattr(settings, "vocab_size", None)
    return TrainingShape(f"--set {batch_name}={getattr(settings, batch_name)} with {seq_name}={seq}, {sizes[0]}",
                         batch=batch, seq=seq, width=sizes[1], heads=sizes[2], layers=sizes[3],
                         outputs=vocab if is_int(vocab) else 256, parameters=estimated_parameters(vars(settings)))


def model_sizes(fields: dict) -> Optional[tuple[str, int, int, int]]:
    """``(words, width, heads, layers)`` of a model's size fields (a config's or a recipe's settings: the names of
    :data:`HIDDEN`, :data:`HEADS`, :data:`LAYERS`; the layers of every stack summed), ``words`` naming the width's
    and the layers' fields (``"n_embd=256, n_layer=4"``); None where the width, the heads or the layers are not
    said."""
    given = {n: v for n, v in fields.items() if is_int(v)}
    width_name = next((n for n in HIDDEN if n in given), None)
    heads = next((given[n] for n in HEADS if n in given), None)
    layer_names = [n for n in LAYERS if n in given]
    if width_name is None or heads is None or not layer_names:
        return None
    words = ", ".join(f"{n}={given[n]}" for n in [width_name] + layer_names)
    return words, given[width_name], heads, sum(given[n] for n in layer_names)


def check_training_memory(settings: Any, shape: Optional[TrainingShape] = None) -> None:
    """Refuse a recipe's settings whose training step would not fit in free memory (:func:`check_memory` of
    :func:`transformer_training_bytes`), naming the settings that size it. ``shape`` is the recipe's own
    (default: :func:`training_shape` of the settings); without one nothing is refused."""
    shape = shape if shape is not None else training_shape(settings)
    if shape is None:
        return
    need = transformer_training_bytes(batch=shape.batch, seq=shape.seq, width=shape.width, layers=shape.layers,
                                      heads=shape.heads, vocab=shape.outputs, parameters=shape.parameters)
    device = getattr(settings, "device", "cpu")
    check_memory(shape.what, need, device="cpu" if device == "auto" else device)


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"
