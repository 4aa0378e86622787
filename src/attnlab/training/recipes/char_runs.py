"""A ``shakespeare-char`` run as the start, the adapter base or the teacher of another (the recipe's ``init``,
``lora`` and ``teacher`` settings; see :mod:`attnlab.training.recipes.shakespeare`)."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Union

import torch
from torch import Tensor, nn

from attnlab.adapt.io import trainable_parameters
from attnlab.adapt.lora import apply_lora, lora_layers, parse_lora_spec, unload_lora
from attnlab.data.tokenizers import CharTokenizer
from attnlab.training.checkpoint import latest_checkpoint, load_checkpoint
from attnlab.training.distributed import DistInfo
from attnlab.training.losses import causal_lm_loss, distillation_loss
from attnlab.training.recipes import _read_config, get_recipe, load_weights_checked, resolve_settings

__all__ = ["adapt_run", "load_run_model", "load_init"]


def adapt_run(model: nn.Module, s: ShakespeareSettings, *, out: Path, tokenizer: CharTokenizer,
           training: bool) -> tuple:
    """Apply ``init`` (fresh training runs only), ``lora`` (always: checkpoints hold the LoRA model) and
    ``teacher`` (training only) to a freshly built ``model``; return ``(loss_fn, info for metrics.json)``."""
    info: dict = {}
    if training and s.init is not None and latest_checkpoint(out) is None:  # resuming: the checkpoint wins
        load_init(model, s.init)
        info["init"] = s.init
    if s.lora is not None:
        apply_lora(model, **parse_lora_spec(s.lora))
        trainable, total = trainable_parameters(model)
        info.update(lora=s.lora, trainable_parameters=trainable, total_parameters=total,
                    trainable_fraction=trainable / total)
    if not training or s.teacher is None:
        return causal_lm_loss, info
    teacher = load_run_model(s.teacher, role="teacher")
    saved_tokenizer = Path(s.teacher) / "tokenizer.json"
    chars = CharTokenizer.load(saved_tokenizer).chars if saved_tokenizer.is_file() else None
    if teacher.config.vocab_size != tokenizer.vocab_size or (chars is not None and chars != tokenizer.chars):
        raise ValueError(f"teacher={s.teacher}: its vocabulary ({teacher.config.vocab_size} characters) is not "
                         f"this run's ({tokenizer.vocab_size}): a teacher must share the tokenizer")
    if teacher.max_positions is not None and teacher.max_positions < s.block_size:
        raise ValueError(f"teacher={s.teacher}: its context ({teacher.max_positions}) is shorter than "
                         f"block_size={s.block_size}")
    info.update(teacher=s.teacher, teacher_parameters=sum(p.numel() for p in teacher.parameters()))
    return functools.partial(_distill_loss, teacher=teacher, temperature=s.distill_temperature,
                             alpha=s.distill_alpha), info


def load_run_model(directory: Union[str, Path], *, role: str = "run") -> nn.Module:
    """The model of a ``shakespeare-char`` output folder at its latest checkpoint, frozen, in eval mode.

    A LoRA run's adapters are merged into the weights (``W + (α/r) B A``), so the result is a plain model.

    Raises:
        FileNotFoundError: no ``config.json`` or no checkpoint in ``directory``.
        ValueError: the folder holds another recipe's run, or its checkpoint has no model weights or weights that do
            not fit the model (missing, unexpected, of another shape or an integer dtype: named).
    """
    directory = Path(directory)
    saved = _read_config(directory)
    if saved is None:
        raise FileNotFoundError(f"{role}={directory}: no config.json there (not an `attnlab train` output folder)")
    if saved.get("recipe") != "shakespeare-char":
        raise ValueError(f"{role}={directory} holds a {saved.get('recipe')!r} run, not a shakespeare-char one")
    recipe = get_recipe("shakespeare-char")
    settings = resolve_settings(recipe, base=saved.get("settings", {}))
    path = latest_checkpoint(directory)
    if path is None:
        raise FileNotFoundError(f"{role}={directory}: no checkpoint (ckpt-*.pt) there")
    state = load_checkpoint(path).get("model")
    if state is None:
        raise ValueError(f"{role}={directory}: {path.name} holds no model weights")
    model = recipe.build(settings, out=directory, dist=DistInfo(), training=False).model
    load_weights_checked(model, state, source=path)
    if lora_layers(model):
        unload_lora(model, merge=True)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def load_init(model: nn.Module, directory: Union[str, Path]) -> None:
    """Copy the weights of run ``directory`` (see :func:`load_run_model`) into ``model``; shapes must match.

    Raises:
        ValueError: a parameter missing on either side or of another shape (named in the message).
    """
    src = load_run_model(directory, role="init").state_dict()
    dst = model.state_dict()
    for name in sorted(set(src) | set(dst)):
        a, b = src.get(name), dst.get(name)
        if a is None or b is None or a.shape != b.shape:
            def shape(t):
                return "absent" if t is None else tuple(t.shape)
            raise ValueError(f"init={directory}: {name} is {shape(a)} there but {shape(b)} in this model "
                             "(n_layer, n_head, n_embd and block_size must match the init run)")
    model.load_state_dict(src)


def _distill_loss(model: nn.Module, batch: tuple[Tensor, Tensor], *, teacher: nn.Module, temperature: float,
                  alpha: float) -> tuple[Tensor, int]:
    """The trainer's ``loss_fn`` with a frozen teacher: ``distillation_loss(student, teacher, y)``."""
    x, y = batch  # (B, T), (B, T)
    logits = model(x).logits  # (B, T, V)
    with torch.no_grad():
        teacher_logits = teacher.to(x.device)(x).logits  # (B, T, V)
    return distillation_loss(logits, teacher_logits, y, temperature=temperature, alpha=alpha), y.numel()
