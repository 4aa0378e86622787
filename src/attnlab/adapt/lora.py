"""LoRA: low-rank adaptation of frozen linear layers (Hu et al. 2021).

An adapted projection computes::

    h = W x + b + (α / r) · B A dropout(x)        A ∈ R^{r×in}, B ∈ R^{out×r}, ΔW = (α / r) B A

with ``W``, ``b`` frozen, ``A`` Kaiming-uniform and ``B = 0`` at the start (so a freshly adapted
model computes exactly what the base model does), and only ``A``, ``B`` trained.

**Packed q/k/v.** :class:`~attnlab.modules.multihead.MultiheadAttention` packs ``W_Q; W_K; W_V`` in one
``in_proj`` (rows q, k, v — torch's layout). LoRA targets them separately, as in the paper (``W_q`` and
``W_v``): the packed layer gets one independent pair ``(A_s, B_s)`` per chosen row slice ``s`` and
``ΔW[rows s] = (α / r) B_s A_s`` (zero elsewhere) — loralib's ``MergedLinear`` design, equal to separate
LoRAs on separate q, k, v projections. Targets name these slices ``<attn>.q_proj``, ``<attn>.k_proj``,
``<attn>.v_proj`` whether or not the projection is packed; ``<attn>.in_proj`` adapts the whole packed
matrix with one pair; ``<attn>.out_proj`` and any other ``nn.Linear`` go by their module name.

The adapted layer (:class:`LoRALinear`) wraps the original ``nn.Linear`` as ``.base`` (PEFT's layout)
and exposes ``.weight`` = ``W + ΔW`` (``W`` once merged), so code that reads the weight directly —
``MultiheadAttention``'s cross-attention slices ``in_proj.weight[rows]`` — sees the adapted weight
(that path forms ``W + ΔW`` and skips the LoRA dropout; the layer's own forward keeps the cheap
factored form ``B (A x)``).
"""
from __future__ import annotations

import fnmatch
import math
import re
from typing import Iterable, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab._checks import is_int, positive_number, rate
from attnlab._limits import check_elements
from attnlab.modules.multihead import MultiheadAttention
from attnlab.nn.dropout import Dropout

Pattern = Union[str, "re.Pattern[str]"]
DEFAULT_TARGETS = ("*q_proj", "*v_proj")  # the paper's choice: the query and value projections
_SLICE_NAMES = ("q", "k", "v")


class LoRALinear(nn.Module):
    """``W x + b + (α/r) B_s A_s dropout(x)`` on each adapted row slice ``s`` of a frozen ``nn.Linear``.

    Args:
        base: the frozen linear layer (kept as ``.base``).
        r: rank.
        alpha: scale numerator; the update is scaled by ``alpha / r``.
        dropout: dropout on the input of the low-rank branch, in training.
        slices: ``{name: (start, end)}`` output rows to adapt (``None``: all rows, named ``"all"``).

    Parameters:
        lora_A[name]: ``(r, in_features)``; lora_B[name]: ``(end - start, r)``, zero at the start.
    """

    def __init__(self, base: nn.Linear, *, r: int, alpha: float, dropout: float = 0.0,
                 slices: Optional[dict[str, tuple[int, int]]] = None) -> None:
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"base must be an nn.Linear, got {type(base).__name__}")
        _check_rank_alpha_dropout(r, alpha, dropout)
        self.base, self.r, self.alpha, self.scaling = base, r, float(alpha), alpha / r
        self.slices = dict(slices) if slices else {"all": (0, base.out_features)}
        for name, (s, e) in self.slices.items():
            if not 0 <= s < e <= base.out_features:
                raise ValueError(f"slice {name!r} = ({s}, {e}) is outside the {base.out_features} output rows")
        fk = dict(device=base.weight.device, dtype=base.weight.dtype)
        check_elements(f"LoRA r={r} on a {base.in_features}→{base.out_features} layer", r,
                       len(self.slices) * base.in_features + base.out_features,
                       bytes_per_value=base.weight.element_size(), device=base.weight.device)
        self.lora_A = nn.ParameterDict({n: nn.Parameter(torch.empty(r, base.in_features, **fk)) for n in self.slices})
        self.lora_B = nn.ParameterDict({n: nn.Parameter(torch.zeros(e - s, r, **fk))
                                        for n, (s, e) in self.slices.items()})
        for a in self.lora_A.values():
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # as nn.Linear (and PEFT)
        self.lora_dropout = Dropout(dropout) if dropout > 0 else nn.Identity()
        self.dropout = float(dropout)
        self.merged = False

    in_features = property(lambda self: self.base.in_features)
    out_features = property(lambda self: self.base.out_features)
    bias = property(lambda self: self.base.bias, doc="the frozen base bias")

    @property
    def weight(self) -> Tensor:
        """The effective weight ``W + ΔW`` (``W`` alone once merged, where ΔW is already inside)."""
        return self.base.weight if self.merged else self.base.weight + self.delta_weight()

    def delta_weight(self) -> Tensor:
        """``ΔW (out, in)``: ``(α/r) B_s A_s`` on each adapted row slice, zero elsewhere."""
        if list(self.slices) == ["all"]:
            return self.scaling * (self.lora_B["all"] @ self.lora_A["all"])
        return self._assemble([self.scaling * (self.lora_B[n] @ self.lora_A[n]) for n in self.slices], dim=0,
                              rest=(self.in_features,))

    def _assemble(self, parts: list[Tensor], *, dim: int, rest: tuple) -> Tensor:
        """Place each slice's part at its rows (``dim`` of length ``out_features``), zeros in the gaps."""
        pieces, at = [], 0
        for (s, e), p in sorted(zip(self.slices.values(), parts), key=lambda t: t[0][0]):
            if s > at:
                pieces.append(p.new_zeros(*_shape(rest, s - at, dim)))
            pieces.append(p)
            at = e
        if at < self.out_features:
            pieces.append(parts[0].new_zeros(*_shape(rest, self.out_features - at, dim)))
        return torch.cat(pieces, dim=dim)

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)  # (..., out)
        if self.merged:
            return y
        h = self.lora_dropout(x)
        parts = [F.linear(F.linear(h, self.lora_A[n]), self.lora_B[n]) * self.scaling for n in self.slices]
        if list(self.slices) == ["all"]:
            return y + parts[0]
        return y + self._assemble(parts, dim=-1, rest=tuple(x.shape[:-1]))

    @torch.no_grad()
    def merge(self) -> None:
        """``W ← W + ΔW``: one matmul at inference, as the base layer."""
        if not self.merged:
            self.base.weight += self.delta_weight()
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """``W ← W − ΔW`` (exact up to float round-off)."""
        if self.merged:
            self.base.weight -= self.delta_weight()
            self.merged = False

    def adapter_named_parameters(self):
        """The LoRA parameters (``lora_A.<slice>``, ``lora_B.<slice>``), not the frozen base."""
        for name, p in self.named_parameters():
            if name.startswith("lora_"):
                yield name, p

    def extra_repr(self) -> str:
        return (f"r={self.r}, alpha={self.alpha}, slices={self.slices}, dropout={self.dropout}, "
                f"merged={self.merged}")


def _shape(rest: tuple, n: int, dim: int) -> tuple:
    return (n, *rest) if dim == 0 else (*rest, n)


def _check_rank_alpha_dropout(r, alpha, dropout) -> None:
    if not (is_int(r) and r > 0):
        raise ValueError(f"r (the LoRA rank) must be a positive int, got {r!r}")
    positive_number("alpha", alpha, finite=True)
    rate("dropout", dropout)


# ---- which projections a model has, by target name ----------------------------------------------

def projections(model: nn.Module) -> dict[str, tuple[str, Optional[tuple[str, tuple[int, int]]]]]:
    """Every LoRA-able projection: ``{target name: (linear module name, (slice name, rows) or None)}``.

    Packed attention projections appear as ``<attn>.q_proj/k_proj/v_proj`` (row slices of
    ``<attn>.in_proj``) and as ``<attn>.in_proj`` (all rows); every ``nn.Linear`` by its module name.
    """
    out: dict[str, tuple[str, Optional[tuple[str, tuple[int, int]]]]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, MultiheadAttention) and mod.packed:
            nq, nkv = mod.num_heads * mod.head_dim, mod.num_kv_heads * mod.head_dim
            rows = {"q": (0, nq), "k": (nq, nq + nkv), "v": (nq + nkv, nq + 2 * nkv)}
            linear = _join(name, "in_proj")
            for s in _SLICE_NAMES:
                out[_join(name, f"{s}_proj")] = (linear, (s, rows[s]))
        elif isinstance(mod, (nn.Linear, LoRALinear)) and not _inside_lora(name, model):
            out[name] = (name, None)
    return out


def _inside_lora(name: str, model: nn.Module) -> bool:
    """True for the ``.base`` Linear of a LoRALinear (not a projection of its own)."""
    parent, _, child = name.rpartition(".")
    return child == "base" and isinstance(model.get_submodule(parent) if parent else model, LoRALinear)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _matches(pattern: Pattern, name: str) -> bool:
    if isinstance(pattern, str):
        return fnmatch.fnmatchcase(name, pattern)
    return pattern.fullmatch(name) is not None


def resolve_targets(model: nn.Module, targets: Optional[Iterable[Pattern]] = None) -> dict[str, dict]:
    """``{linear module name: {slice name: rows}}`` (``{}`` = all rows) selected by ``targets``.

    Raises:
        TypeError: a pattern is neither a str (glob) nor a compiled regex.
        ValueError: a pattern matches no projection (the message lists some names), or both a packed
            projection and its q/k/v slices are selected.
    """
    targets = DEFAULT_TARGETS if targets is None else targets
    if isinstance(targets, (str, re.Pattern)):
        targets = [targets]
    targets = list(targets)
    if not targets:
        raise ValueError("targets must name at least one projection (or be None for the default)")
    projs = projections(model)
    chosen: dict[str, dict] = {}
    for pat in targets:
        if not isinstance(pat, (str, re.Pattern)):
            raise TypeError(f"targets must be glob strings or compiled regexes, got {type(pat).__name__}")
        hits = [n for n in projs if _matches(pat, n)]
        if not hits:
            shown = ", ".join(list(projs)[:8]) + (", ..." if len(projs) > 8 else "")
            raise ValueError(f"targets pattern {getattr(pat, 'pattern', pat)!r} matches no projection of "
                             f"{type(model).__name__}; projections are named like: {shown or '(none)'}")
        for n in hits:
            linear, sl = projs[n]
            slices = chosen.setdefault(linear, {})
            if sl is None:
                slices["all"] = None
            else:
                slices[sl[0]] = sl[1]
    for linear, slices in chosen.items():
        if "all" in slices and len(slices) > 1:
            raise ValueError(f"targets select both all of {linear!r} and its slices {sorted(set(slices) - {'all'})}")
    return chosen


# ---- the public API -----------------------------------------------------------------------------

def apply_lora(model: nn.Module, *, r: int, alpha: float, dropout: float = 0.0,
               targets: Optional[Iterable[Pattern]] = None) -> nn.Module:
    """Add LoRA to the projections named by ``targets`` and freeze everything else (in place).

    Args:
        model: any module; its ``nn.Linear`` layers and packed attention projections can be targeted.
        r: rank of each update ``ΔW = (α/r) B A``.
        alpha: scale numerator α.
        dropout: dropout on the LoRA branch input, in training.
        targets: glob strings (``fnmatch``: ``"*.q_proj"``, ``"layers.0.*"``) or compiled regexes
            (``re.compile(r"layers\\.[0-3]\\..*v_proj")``, full match) over projection names (see
            :func:`projections`); default ``("*q_proj", "*v_proj")``: every attention query and value.

    Returns:
        ``model``, with every base parameter ``requires_grad=False`` and only the LoRA ``A``, ``B`` trainable.

    Raises:
        ValueError: ``r <= 0`` or beyond a target's ``min(in_features, out_features)``, ``alpha <= 0``,
            ``dropout`` outside [0, 1), a pattern matching nothing, or a model that already has LoRA layers.
        TypeError: ``model`` is not an ``nn.Module`` or a pattern has the wrong type.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    _check_rank_alpha_dropout(r, alpha, dropout)
    if lora_layers(model):
        raise ValueError("model already has LoRA layers; unload_lora(model) first")
    chosen = resolve_targets(model, targets)
    for linear_name in chosen:  # a rank beyond the layer's own adds nothing but memory (A is r x in_features)
        base = model.get_submodule(linear_name)
        full = min(base.in_features, base.out_features)
        if r > full:
            raise ValueError(f"LoRA r={r} is more than the rank of {linear_name} ({base.in_features} -> "
                             f"{base.out_features}): choose r in [1, {full}]")
    for p in model.parameters():
        p.requires_grad_(False)
    for linear_name, slices in chosen.items():
        base = model.get_submodule(linear_name)
        layer = LoRALinear(base, r=r, alpha=alpha, dropout=dropout, slices=None if "all" in slices else slices)
        _replace(model, linear_name, layer)
    return model


def parse_lora_spec(spec: str) -> dict:
    """``"r=8"`` or ``"r=8,alpha=16,dropout=0.0"`` -> ``apply_lora`` keywords (``alpha`` defaults to ``r``).

    Raises:
        ValueError: not comma-separated ``key=value`` items, an unknown key, no ``r``, or a bad value.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"lora must be a spec like 'r=8' or 'r=8,alpha=16,dropout=0.0', got {spec!r}")
    kinds = {"r": int, "alpha": float, "dropout": float}
    out: dict = {}
    for item in spec.split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or key not in kinds:
            raise ValueError(f"lora spec {spec!r}: expected comma-separated r=INT, alpha=FLOAT, dropout=FLOAT, "
                             f"got {item.strip()!r}")
        try:
            out[key] = kinds[key](value)
        except ValueError:
            raise ValueError(f"lora spec {spec!r}: {key} must be {kinds[key].__name__}, got {value!r}") from None
    if "r" not in out:
        raise ValueError(f"lora spec {spec!r} has no rank: expected e.g. 'r=8'")
    out.setdefault("alpha", float(out["r"]))
    out.setdefault("dropout", 0.0)
    if out["r"] < 1 or not out["alpha"] > 0 or not 0.0 <= out["dropout"] < 1.0:
        raise ValueError(f"lora spec {spec!r}: need r >= 1, alpha > 0, 0 <= dropout < 1")
    return out


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """``{module name: LoRALinear}`` of a model."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def _require_lora(model: nn.Module) -> dict[str, LoRALinear]:
    layers = lora_layers(model)
    if not layers:
        raise ValueError(f"model ({type(model).__name__}) has no LoRA layers; call apply_lora first")
    return layers


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every ``ΔW`` into its base weight (``W ← W + ΔW``); the LoRA branch is then skipped.

    Raises:
        ValueError: the model has no LoRA layers.
    """
    for layer in _require_lora(model).values():
        layer.merge()
    return model


def unmerge_lora(model: nn.Module) -> nn.Module:
    """Undo :func:`merge_lora` (``W ← W − ΔW``), e.g. to train the adapter further."""
    for layer in _require_lora(model).values():
        layer.unmerge()
    return model


def unload_lora(model: nn.Module, *, merge: bool = True) -> nn.Module:
    """Put the plain ``nn.Linear`` layers back (merged with ``ΔW`` when ``merge``), e.g. before
    ``save_pretrained``; ``requires_grad`` flags are left as they are."""
    for name, layer in _require_lora(model).items():
        if merge:
            layer.merge()
        elif layer.merged:
            layer.unmerge()
        _replace(model, name, layer.base)
    return model


def lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Only the LoRA tensors, ``{"<layer>.lora_A.<slice>": A, "<layer>.lora_B.<slice>": B}`` (detached)."""
    return {f"{name}.{p_name}": p.detach() for name, layer in _require_lora(model).items()
            for p_name, p in layer.adapter_named_parameters()}


def lora_config(model: nn.Module) -> Optional[dict]:
    """The settings that rebuild this model's LoRA layers on a base model (None without LoRA):
    ``r``, ``alpha``, ``dropout`` and ``targets`` (exact projection names)."""
    layers = lora_layers(model)
    if not layers:
        return None
    settings = {(m.r, m.alpha, m.dropout) for m in layers.values()}
    if len(settings) > 1:
        raise ValueError(f"LoRA layers have different (r, alpha, dropout): {sorted(settings)}")
    r, alpha, dropout = settings.pop()
    targets = []
    for name, layer in layers.items():
        if list(layer.slices) == ["all"]:
            targets.append(name)
        else:  # <attn>.in_proj -> <attn>.<q|k|v>_proj
            attn = name.rpartition(".")[0]
            targets += [_join(attn, f"{s}_proj") for s in layer.slices]
    return {"r": r, "alpha": alpha, "dropout": dropout, "targets": sorted(targets)}


def apply_lora_config(model: nn.Module, config: dict) -> nn.Module:
    """:func:`apply_lora` from :func:`lora_config`'s dict (targets are exact names: glob-safe)."""
    return apply_lora(model, r=config["r"], alpha=config["alpha"], dropout=config["dropout"],
                      targets=config["targets"])
