"""attnlab installs beside the user's own PyTorch: pyproject.toml asks for a range of torch (a floor, no pin), the
Makefile's oldest-torch venv tests that floor, and the torch that `make` installs (constraints.txt) lies inside it."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
requirements = pytest.importorskip("packaging.requirements", reason="the packaging package is not installed")

ROOT = Path(__file__).resolve().parents[1]


def _torch_requirement():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    (torch,) = [r for r in map(requirements.Requirement, deps) if r.name == "torch"]
    return torch


def test_torch_is_a_floor_that_the_oldest_torch_venv_tests():
    spec = _torch_requirement().specifier
    assert [s.operator for s in spec] == [">="], f"torch{spec}: a floor only, no upper or exact pin"
    (floor,) = [s.version for s in spec]
    oldest = re.search(r"^TORCH_OLDEST\s*:=\s*(\S+)$", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M)
    assert oldest and oldest.group(1) in spec and oldest.group(1).startswith(floor), (floor, oldest)


def test_the_torch_make_installs_is_in_the_range():
    pins = [requirements.Requirement(line.split("#")[0]) for line in
            (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines() if line.split("#")[0].strip()]
    (torch,) = [p for p in pins if p.name == "torch"]
    (pin,) = torch.specifier
    assert pin.operator == "==" and pin.version in _torch_requirement().specifier, torch
