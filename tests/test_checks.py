"""attnlab._checks: every checker accepts what it documents, refuses the rest, and names the argument."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from attnlab import _checks as C


@pytest.mark.parametrize("value, ok", [(3, True), (np.int64(3), True), (0, True), (True, False), (3.0, False),
                                       ("3", False), (None, False)])
def test_is_int(value, ok):
    assert C.is_int(value) is ok


@pytest.mark.parametrize("value, ok", [(0.5, True), (2, True), (math.inf, True), (False, False), ("0.5", False)])
def test_is_real(value, ok):
    assert C.is_real(value) is ok


@pytest.mark.parametrize("check, good, bad, message", [
    (lambda v: C.positive_int("n", v), [1, 7], [0, -1, True, 1.0], "n must be a positive int, got "),
    (lambda v: C.positive_int("n", v, optional=True), [None, 2], [0], "n must be a positive int or None, got 0"),
    (lambda v: C.non_negative_int("seed", v), [0, 5], [-1, False], "seed must be a non-negative int, got "),
    (lambda v: C.int_at_least("opset", v, 14), [14, 20], [13, 14.0], "opset must be an int >= 14, got "),
    (lambda v: C.int_at_least("keep", v, 1, optional=True), [None, 1], [0], "keep must be an int >= 1 or None, got 0"),
    (lambda v: C.index("layer", v, 3), [0, 2], [3, -1, True], "layer must be an int in [0, 3), got "),
    (lambda v: C.rate("dropout", v), [0, 0.0, 0.99], [1.0, -0.1, True, math.nan], "dropout must be a float in [0, 1), got "),
    (lambda v: C.fraction("alpha", v), [0, 1.0], [1.5, math.nan], "alpha must be a float in [0, 1], got "),
    (lambda v: C.positive_number("eps", v), [1e-6, math.inf], [0, -1.0, math.nan, True], "eps must be a positive number, got "),
    (lambda v: C.positive_number("alpha", v, finite=True), [2.0], [math.inf], "alpha must be a positive finite number"),
    (lambda v: C.non_negative_number("lr", v), [0, math.inf], [-1e-9, math.nan], "lr must be a non-negative number, got "),
    (lambda v: C.non_negative_number("lr", v, finite=True), [0.0], [math.inf], "lr must be a finite number >= 0, got inf"),
    (lambda v: C.one_of("norm", v, ("layernorm", "rmsnorm")), ["rmsnorm"], ["batchnorm", ["x"]],
     "norm must be one of 'layernorm', 'rmsnorm', got "),
    (lambda v: C.check_positive_float("layer_norm_eps", v), [1e-5], [0.0], "layer_norm_eps must be a positive float"),
])
def test_value_checks(check, good, bad, message):
    for v in good:
        assert check(v) is None
    for v in bad:
        with pytest.raises(ValueError) as info:
            check(v)
        assert str(info.value).startswith(message), (v, str(info.value))


@pytest.mark.parametrize("check, good, bad, message", [
    (lambda v: C.boolean("causal", v), [True, False], [1, 0, "yes", None], "causal must be a bool, got "),
    (lambda v: C.integer("pad_id", v), [0, -1], [1.0, True, "0"], "pad_id must be an int, got "),
    (lambda v: C.real("scale", v), [0.5, -2], [True, "1", None], "scale must be a real number, got "),
])
def test_type_checks(check, good, bad, message):
    for v in good:
        assert check(v) is None
    for v in bad:
        with pytest.raises(TypeError) as info:
            check(v)
        assert str(info.value).startswith(message), (v, str(info.value))


def test_tensor():
    C.tensor("q", torch.zeros(1, 2, 3, 4), kind="floating", ndim=4)
    C.tensor("ids", torch.zeros(2, 3, dtype=torch.long), kind="integer", ndim=2)
    C.tensor("mask", torch.zeros(2, dtype=torch.bool), kind="integer")
    with pytest.raises(TypeError, match=r"^q must be a floating-point tensor \(B, H, L, D\), got list$"):
        C.tensor("q", [1.0], kind="floating", shape="(B, H, L, D)")
    with pytest.raises(ValueError, match=r"^q must have 4 dims \(B, H, L, D\), got shape \(2, 3\)$"):
        C.tensor("q", torch.zeros(2, 3), kind="floating", ndim=4, shape="(B, H, L, D)")
    with pytest.raises(TypeError, match=r"^q must be a floating-point tensor, got torch.int64$"):
        C.tensor("q", torch.zeros(2, dtype=torch.long), kind="floating")
    with pytest.raises(TypeError, match=r"^positions must be an integer tensor, got torch.complex64$"):
        C.tensor("positions", torch.zeros(2, dtype=torch.complex64), kind="integer")
    with pytest.raises(ValueError, match="kind must be None, 'floating' or 'integer'"):
        C.tensor("x", torch.zeros(1), kind="float")


def test_no_module_keeps_its_own_int_check():
    """The inline ``isinstance(v, bool) or not isinstance(v, numbers.Integral)`` copies are gone."""
    from pathlib import Path

    import attnlab
    root = Path(attnlab.__file__).parent
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if p.name != "_checks.py" and "not isinstance(" in p.read_text()
                 and "numbers.Integral" in p.read_text()]
    assert offenders == []
