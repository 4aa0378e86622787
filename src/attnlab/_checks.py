"""Argument checks, one set for the whole library.

Every checker takes the argument's ``name`` first and raises an error that names it and says
what was expected, e.g. ``ValueError: dropout must be a float in [0, 1), got 1.5``. Bools are
never accepted where a number is expected (``True`` is an ``int`` to Python, not to us).

* ints: :func:`integer`, :func:`positive_int`, :func:`non_negative_int`, :func:`int_at_least`, :func:`index`
* reals: :func:`real`, :func:`positive_number`, :func:`non_negative_number`, :func:`rate`,
  :func:`fraction`
* others: :func:`boolean`, :func:`one_of`, :func:`tensor`, :func:`stored_dtype` (a tensor read from a file)
* predicates for checks with a message of their own: :func:`is_int`, :func:`is_real`

``check_int``, ``check_rate`` and ``check_positive_float`` are the names the configs used first;
they stay as the same checks.
"""
from __future__ import annotations

import math
import numbers
from typing import Iterable, Optional

import torch

__all__ = ["is_int", "is_real", "integer", "positive_int", "non_negative_int", "int_at_least", "index", "real",
           "positive_number", "non_negative_number", "rate", "fraction", "boolean", "one_of", "tensor",
           "check_int", "check_rate", "check_positive_float"]


def is_int(value) -> bool:
    """True for an integral number that is not a bool (``3``, ``numpy.int64(3)``; not ``True``, ``3.0``)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    """True for a real number that is not a bool (``0.5``, ``2``; not ``True``, ``"0.5"``)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _refuse(name: str, expected: str, value, optional: bool = False) -> None:
    raise ValueError(f"{name} must be {expected}{' or None' if optional else ''}, got {value!r}")


# ---------------------------------------------------------------------------------- ints

def integer(name: str, value) -> None:
    """``value`` must be an int (bools refused); a ``TypeError`` otherwise, for APIs that separate
    the wrong type (``TypeError``) from the wrong value (``ValueError``)."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")


def int_at_least(name: str, value, minimum: int, *, optional: bool = False) -> None:
    """``value`` must be an int with ``value >= minimum`` (or None when ``optional``): ``an int >= minimum``."""
    if not (optional and value is None) and not (is_int(value) and value >= minimum):
        _refuse(name, f"an int >= {minimum}", value, optional)


def positive_int(name: str, value, *, optional: bool = False) -> None:
    """``value`` must be an int ``> 0`` (or None when ``optional``): ``a positive int``."""
    if not (optional and value is None) and not (is_int(value) and value > 0):
        _refuse(name, "a positive int", value, optional)


def non_negative_int(name: str, value, *, optional: bool = False) -> None:
    """``value`` must be an int ``>= 0`` (or None when ``optional``): ``a non-negative int``."""
    if not (optional and value is None) and not (is_int(value) and value >= 0):
        _refuse(name, "a non-negative int", value, optional)


def index(name: str, value, n: int) -> None:
    """``value`` must be an int in ``[0, n)`` (a layer, a head, a row)."""
    if not (is_int(value) and 0 <= value < n):
        _refuse(name, f"an int in [0, {n})", value)


# --------------------------------------------------------------------------------- reals

def real(name: str, value) -> None:
    """``value`` must be a real number (any sign, bools refused); a ``TypeError`` otherwise."""
    if not is_real(value):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")


def positive_number(name: str, value, *, finite: bool = False) -> None:
    """``value`` must be a real number ``> 0`` (and finite when ``finite``): an epsilon, a scale."""
    if not (is_real(value) and value > 0 and (not finite or math.isfinite(value))):
        _refuse(name, "a positive finite number" if finite else "a positive number", value)


def non_negative_number(name: str, value, *, finite: bool = False) -> None:
    """``value`` must be a real number ``>= 0`` (and finite when ``finite``); NaN is refused."""
    if not (is_real(value) and value >= 0 and (not finite or math.isfinite(value))):
        _refuse(name, "a finite number >= 0" if finite else "a non-negative number", value)


def rate(name: str, value) -> None:
    """``value`` must be a float in ``[0, 1)``: a dropout or masking rate (1 would drop everything)."""
    if not (is_real(value) and 0.0 <= value < 1.0):
        _refuse(name, "a float in [0, 1)", value)


def fraction(name: str, value) -> None:
    """``value`` must be a float in ``[0, 1]`` (a mixing weight, a threshold)."""
    if not (is_real(value) and 0.0 <= value <= 1.0):
        _refuse(name, "a float in [0, 1]", value)


# -------------------------------------------------------------------------------- others

def boolean(name: str, value) -> None:
    """``value`` must be ``True`` or ``False`` (not 0/1, not a string); a ``TypeError`` otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def float_dtype(name: str, value) -> None:
    """``value`` must be a floating ``torch.dtype`` or None; a ``TypeError`` otherwise."""
    if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise TypeError(f"{name} must be a floating torch.dtype (torch.float32, torch.bfloat16, ...) or None, "
                        f"got {value!r}")


def one_of(name: str, value, choices: Iterable) -> None:
    """``value`` must be one of ``choices`` (a registry's keys, a tuple of names)."""
    choices = list(choices)
    try:
        ok = value in choices
    except TypeError:  # an unhashable value against a dict view, say
        ok = False
    if not ok:
        _refuse(name, f"one of {', '.join(map(repr, choices))}", value)


def tensor(name: str, value, *, kind: Optional[str] = None, ndim: Optional[int] = None,
           shape: Optional[str] = None) -> None:
    """``value`` must be a ``torch.Tensor``; with ``kind="floating"`` a floating-point one, with
    ``kind="integer"`` one of integer (or bool) dtype; with ``ndim``, of that many dims (checked
    before the dtype). ``shape``
    names the expected layout in the message, e.g. ``"(B, L)"``.

    Raises:
        TypeError: not a tensor, or the wrong kind of dtype.
        ValueError: the wrong number of dims.
    """
    if kind not in (None, "floating", "integer"):
        raise ValueError(f"kind must be None, 'floating' or 'integer', got {kind!r}")
    what = {None: "a tensor", "floating": "a floating-point tensor", "integer": "an integer tensor"}[kind]
    layout = f" {shape}" if shape else ""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be {what}{layout}, got {type(value).__name__}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims{layout}, got shape {tuple(value.shape)}")
    if kind == "floating" and not value.is_floating_point():
        raise TypeError(f"{name} must be {what}{layout}, got {value.dtype}")
    if kind == "integer" and (value.is_floating_point() or value.is_complex()):
        raise TypeError(f"{name} must be {what}{layout}, got {value.dtype}")


def stored_dtype(name: str, stored: torch.Tensor, expected: torch.Tensor) -> None:
    """A tensor read from a file must suit the parameter it fills: a floating-point one for a floating-point
    parameter (integer or bool values copied into a weight are numbers of another scale, silently).

    Raises:
        ValueError: naming the tensor, its stored dtype and the parameter's.
    """
    if expected.is_floating_point() and not stored.is_floating_point():
        raise ValueError(f"tensor {name} is stored as {stored.dtype}, but the parameter it fills is {expected.dtype}: "
                         f"a floating-point weight cannot be read from integer or bool data")


# ------------------------------------------------------- the configs' first names, kept

def check_int(name: str, value, minimum: int = 1, *, optional: bool = False) -> None:
    """Same as :func:`int_at_least` (``minimum`` defaults to 1)."""
    int_at_least(name, value, minimum, optional=optional)


check_rate = rate


def check_positive_float(name: str, value) -> None:
    """``value`` must be a real number ``> 0`` (an epsilon, a temperature): ``a positive float``."""
    if not (is_real(value) and value > 0):
        _refuse(name, "a positive float", value)
