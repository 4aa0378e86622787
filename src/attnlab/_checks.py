"""Argument checks shared by the configs and settings: each raises a ValueError that names the field."""
from __future__ import annotations

import numbers

__all__ = ["check_int", "check_rate", "check_positive_float"]


def check_int(name: str, value, minimum: int = 1, *, optional: bool = False) -> None:
    """``value`` must be an int ``>= minimum`` (bools refused), or None when ``optional``."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be {'None or ' if optional else ''}an int >= {minimum}, got {value!r}")


def check_rate(name: str, value) -> None:
    """``value`` must be a float in ``[0, 1)`` (a dropout or masking rate)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be a float in [0, 1), got {value!r}")


def check_positive_float(name: str, value) -> None:
    """``value`` must be a real number ``> 0`` (an epsilon, a temperature)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"{name} must be a positive float, got {value!r}")
