"""The checks of a model's inputs at its boundary (token ids, attention masks, an encoder's outputs), shared by
every model family: one clear ``ValueError`` that names the argument and the valid shape or range."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def check_token_inputs(input_ids, attention_mask=None, *, vocab_size: int, max_positions: Optional[int] = None,
                       past: int = 0, name: str = "input_ids", mask_name: str = "attention_mask",
                       positions_name: str = "max_position_embeddings") -> tuple[int, int]:
    """Validate ``input_ids (B, L)`` continuing ``past`` cached positions, and an optional 0/1
    ``attention_mask (B, past + L)``, at a model's boundary; return ``(B, L)``.

    The checks that read the values (ids in range, a 0/1 mask) are skipped while ``torch.compile``
    traces (a data-dependent check would break the graph); shapes and dtypes are always checked.

    Args:
        max_positions: the most positions ``past + L`` the model has (None: unbounded).
        name, mask_name: the argument names used in the error messages.
        positions_name: the config field that holds ``max_positions`` (GPT-2: ``n_positions``).

    Raises:
        ValueError: not a non-empty integer (B, L) tensor, more than ``max_positions`` positions, ids
            outside ``[0, vocab_size)``, or a mask of another shape or with values other than 0 and 1.
    """
    if (not isinstance(input_ids, Tensor) or input_ids.dim() != 2
            or input_ids.dtype not in (torch.int64, torch.int32)):
        raise ValueError(f"{name} must be an integer tensor (B, L), got "
                         f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} "
                         f"{tuple(getattr(input_ids, 'shape', ()))}")
    B, L = input_ids.shape
    if B == 0 or L == 0:
        raise ValueError(f"{name} must be non-empty, got shape {(B, L)}")
    if max_positions is not None and past + L > max_positions:
        cached = f"{past} cached + " if past else ""
        raise ValueError(f"{name} has {cached}{L} positions; at most {positions_name}={max_positions} fit")
    tracing = torch.compiler.is_compiling()
    if not tracing:
        lo, hi = (int(v) for v in torch.aminmax(input_ids))
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"{name} must lie in [0, vocab_size={vocab_size}), got values in [{lo}, {hi}]")
    check_attention_mask(attention_mask, (B, past + L), name=mask_name, values=not tracing)
    return B, L


def check_attention_mask(mask, shape: tuple[int, ...], *, name: str = "attention_mask", values: bool = True) -> None:
    """Check that ``mask`` is None or a tensor of ``shape`` holding only 1 (token) and 0 (padding)
    (the values are read only when ``values``).

    Raises:
        ValueError: another shape, not a tensor, or other values (the message names ``name``).
    """
    if mask is None:
        return
    if not isinstance(mask, Tensor) or tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{name} must be a tensor of shape {tuple(shape)}, got "
                         f"{tuple(getattr(mask, 'shape', ())) or type(mask).__name__}")
    if values and not ((mask == 0) | (mask == 1)).all():
        raise ValueError(f"{name} must hold only 1 (token) and 0 (padding)")


def check_encoder_outputs(memory, d_model: int) -> None:
    """Check an encoder–decoder's ``encoder_outputs``: a ``(B, S, d_model)`` tensor.

    Raises:
        ValueError: anything else (the message names ``encoder_outputs`` and the expected shape).
    """
    if not isinstance(memory, Tensor) or memory.dim() != 3 or memory.shape[-1] != d_model:
        raise ValueError(f"encoder_outputs must be a (B, S, d_model={d_model}) tensor, got "
                         f"{tuple(getattr(memory, 'shape', ())) or type(memory).__name__}")
