"""One declaration of how a model's tensor names map onto a Hugging Face checkpoint's, read both ways.

A :class:`WeightMap` is an ordered list of rules, each pairing a template of our names with the
template(s) of HF's::

    WeightMap("GPT-2", [                              # HF's Conv1D: fused q/k/v, weights (in, out)
        rename("wte.weight", "transformer.wte.weight"),
        rename("layers.{i}.self_attn.in_proj.{p}", "transformer.h.{i}.attn.c_attn.{p}", transpose=True),
        ...
    ], tied={"lm_head.weight": "wte.weight"}, ignore=(r"\\.attn\\.bias$",))

    WeightMap("BERT", [                               # HF's separate query/key/value
        pack("layers.{i}.self_attn.in_proj.{p}", *(f"encoder.layer.{{i}}.attention.self.{x}.{{p}}"
                                                  for x in ("query", "key", "value"))),
        rename("layers.{i}.norm{n:1|2}.{p}", ...),
        ...
    ])

Templates are names with placeholders: ``{i}`` is a layer index (digits), ``{p}`` is ``weight`` or
``bias``, and ``{name:a|b|c}`` is one of the listed words; a placeholder has the same value on both sides.
:meth:`WeightMap.to_hf` and :meth:`WeightMap.from_hf` are both driven by these rules, so the two
directions cannot disagree:

- ``rename``: one tensor, the same values under another name; ``transpose=True`` stores matrices
  transposed on HF's side (GPT-2's ``Conv1D`` keeps ``(in, out)``; vectors pass unchanged).
- ``pack``: our one tensor is HF's parts concatenated along dim 0 (``W_qkv = [W_q; W_k; W_v]``); the
  parts are equal unless ``sizes`` gives their lengths (grouped-query attention).
- ``tied``: ``{our alias: our source}``, one parameter under two of our names; HF stores it once (as the
  source), :meth:`~WeightMap.from_hf` fills the alias from the source.
- ``ignore``: regexes of HF names dropped silently when no rule takes them (non-persistent buffers,
  tied copies written by HF).
- ``optional``: HF names a checkpoint may omit; :func:`attnlab.models.hub.from_pretrained` fills them
  with zeros of the expected shape (an all-zero buffer some exports drop).

Rules are tried in order and the first whose template matches a name takes it. Both directions refuse,
with a ``ValueError`` naming the rule or the tensor: a name no rule takes, a rule that takes no
tensor, two tensors that would get one name, a packed tensor missing a part or of the wrong length.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

import torch
from torch import Tensor

_PLACEHOLDER = re.compile(r"\{(\w+)(?::([\w|]+))?\}")
_BUILTIN = {"i": r"\d+", "p": "weight|bias"}


@dataclass(frozen=True)
class Rule:
    """Our template ``ours`` <-> HF's template(s) ``hf`` (several: the parts of a packed tensor).

    Build with :func:`rename` or :func:`pack`; see the module docstring for the meaning of each field.
    """

    ours: str
    hf: tuple[str, ...]
    transpose: bool = False
    sizes: Optional[tuple[int, ...]] = None

    def __str__(self) -> str:
        hf = self.hf[0] if len(self.hf) == 1 else "[" + ", ".join(self.hf) + "]"
        return f"{self.ours!r} <-> {hf!r}" + (" (transposed)" if self.transpose else "")


def rename(ours: str, hf: str, *, transpose: bool = False) -> Rule:
    """A rule for one tensor stored under another name (``transpose``: HF stores matrices as ``Wᵀ``)."""
    return Rule(ours, (hf,), transpose=bool(transpose))


def pack(ours: str, *parts: str, sizes: Optional[Iterable[int]] = None) -> Rule:
    """A rule for our tensor ``W = [W_1; …; W_n]`` (concatenated along dim 0) stored as HF's ``parts``.

    Args:
        sizes: the parts' lengths along dim 0; default: equal parts.
    """
    return Rule(ours, tuple(parts), sizes=None if sizes is None else tuple(int(s) for s in sizes))


def _placeholders(template: str) -> dict[str, Optional[str]]:
    return {m[1]: m[2] for m in _PLACEHOLDER.finditer(template)}


@functools.lru_cache(maxsize=None)
def _compile(template: str, alternatives: tuple[tuple[str, str], ...]) -> re.Pattern:
    """``template`` as a regex with one named group per placeholder (its alternatives from either side)."""
    alts = dict(alternatives)
    out, pos = [], 0
    for m in _PLACEHOLDER.finditer(template):
        out += [re.escape(template[pos:m.start()]), f"(?P<{m[1]}>{alts[m[1]]})"]
        pos = m.end()
    out.append(re.escape(template[pos:]))
    return re.compile("".join(out))


def _fill(template: str, values: Mapping[str, str]) -> str:
    return _PLACEHOLDER.sub(lambda m: values[m[1]], template)


class WeightMap:
    """Our state dict <-> an HF checkpoint's, both directions from one ordered list of :class:`Rule`.

    Args:
        family: named in error messages (``"GPT-2"``).
        rules: tried in order; the first whose template matches a name takes it.
        tied: ``{our alias: our source}`` for parameters shared under two of our names.
        ignore: regexes of HF names no rule takes that are dropped silently.
        optional: HF names a checkpoint may omit (filled with zeros by the loader).

    Raises:
        ValueError: a template with a placeholder the other side lacks (or with two different lists
            of alternatives, or an unknown placeholder without one), a rule naming no HF tensor, a pack
            with ``sizes`` of another count, a transposed pack, a tied alias whose source is itself tied.
    """

    def __init__(self, family: str, rules: Iterable[Rule], *, tied: Optional[Mapping[str, str]] = None,
                 ignore: Iterable[str] = (), optional: Iterable[str] = ()) -> None:
        self.family = family
        self.rules = tuple(rules)
        self.tied = dict(tied or {})
        self.ignore = tuple(ignore)
        self.optional = tuple(optional)
        self._ignore = [re.compile(p) for p in self.ignore]
        self._patterns = [self._check(rule) for rule in self.rules]
        for alias, source in self.tied.items():
            if alias == source or source in self.tied:
                raise ValueError(f"{family} weight map: tied alias {alias!r} must name an untied source, "
                                 f"got {source!r}")

    def _check(self, rule: Rule) -> tuple[re.Pattern, list[re.Pattern]]:
        """Validate one rule; return its compiled templates (ours, [hf parts])."""
        if not isinstance(rule, Rule):
            raise ValueError(f"{self.family} weight map: rules must be built with rename() or pack(), got {rule!r}")
        if len(rule.hf) == 0:
            raise ValueError(f"{self.family} weight map: rule for {rule.ours!r} names no HF tensor")
        if len(rule.hf) > 1 and rule.transpose:
            raise ValueError(f"{self.family} weight map: rule {rule} packs and transposes; split it in two")
        if rule.sizes is not None and len(rule.sizes) != len(rule.hf):
            raise ValueError(f"{self.family} weight map: rule {rule} has {len(rule.hf)} parts but sizes={rule.sizes}")
        ours = _placeholders(rule.ours)
        alternatives = dict(ours)
        for hf in rule.hf:
            theirs = _placeholders(hf)
            if theirs.keys() != ours.keys():
                raise ValueError(f"{self.family} weight map: rule {rule} has placeholders {sorted(ours)} on our "
                                 f"side but {sorted(theirs)} in {hf!r}; both sides must have the same")
            for name, alts in theirs.items():
                if alts and alternatives[name] and alts != alternatives[name]:
                    raise ValueError(f"{self.family} weight map: rule {rule} gives {{{name}}} two different "
                                     f"lists of alternatives")
                alternatives[name] = alternatives[name] or alts
        for name, alts in alternatives.items():
            if not alts and name not in _BUILTIN:
                raise ValueError(f"{self.family} weight map: rule {rule}: placeholder {{{name}}} needs its "
                                 f"alternatives, e.g. {{{name}:a|b}} (only {{i}} and {{p}} are built in)")
            alternatives[name] = alts or _BUILTIN[name]
        key = tuple(sorted(alternatives.items()))
        return _compile(rule.ours, key), [_compile(hf, key) for hf in rule.hf]

    # ---- ours -> HF ----------------------------------------------------------------------

    def _match_ours(self, name: str) -> tuple[int, list[str]]:
        """``(index, HF names)`` of the first rule that takes our tensor ``name``."""
        for index, (rule, (ours, _)) in enumerate(zip(self.rules, self._patterns)):
            m = ours.fullmatch(name)
            if m:
                return index, [_fill(hf, m.groupdict()) for hf in rule.hf]
        raise ValueError(f"{self.family} weight map: no rule maps our tensor {name!r} to a Hugging Face name")

    def to_hf(self, state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Our ``state_dict`` under HF's names and layout: packed tensors split, transposes applied,
        each tied parameter stored once (under its source's name).

        Raises:
            ValueError: a tensor no rule takes, a rule that takes no tensor, two tensors mapped to one
                name, a packed tensor whose length is not the parts' sum, a tied alias or its source
                missing from ``state_dict``.
        """
        self._check_tied(state_dict, "the model's state dict")
        out: dict[str, Tensor] = {}
        source: dict[str, str] = {}
        used = [False] * len(self.rules)
        for name, t in state_dict.items():
            if name in self.tied:
                continue
            index, names = self._match_ours(name)
            rule, used[index] = self.rules[index], True
            parts = [t.t().contiguous() if rule.transpose and t.dim() == 2 else t] if len(names) == 1 \
                else self._split(rule, name, t)
            for hf_name, part in zip(names, parts):
                if hf_name in out:
                    raise ValueError(f"{self.family} weight map: {source[hf_name]!r} and {name!r} both map to "
                                     f"{hf_name!r}")
                out[hf_name], source[hf_name] = part, name
        self._check_used(used, "of the model's tensors")
        return out

    def _split(self, rule: Rule, name: str, t: Tensor) -> list[Tensor]:
        sizes = rule.sizes or (t.shape[0] // len(rule.hf),) * len(rule.hf)
        if t.dim() == 0 or sum(sizes) != t.shape[0]:
            raise ValueError(f"{self.family} weight map: {name!r} of shape {tuple(t.shape)} cannot be split into "
                             f"parts of lengths {list(sizes)} along dim 0 (rule {rule})")
        return list(t.split(list(sizes), dim=0))

    # ---- HF -> ours ----------------------------------------------------------------------

    def from_hf(self, hf: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The inverse of :meth:`to_hf`: an HF checkpoint's tensors under our names, for ``load_state_dict``
        (packed parts concatenated, transposes undone, tied aliases filled from their source; names that
        ``ignore`` matches and no rule takes are dropped).

        Raises:
            ValueError: an HF name no rule takes and ``ignore`` does not match, a rule no tensor matches,
                two tensors mapped to one name, a packed tensor missing a part.
        """
        out: dict[str, Tensor] = {}
        source: dict[str, str] = {}
        packs: dict[str, tuple[Rule, dict[int, Tensor], dict[str, str]]] = {}
        used = [False] * len(self.rules)
        for key, t in hf.items():
            found = self._match_hf(key)
            if found is None:
                if any(p.search(key) for p in self._ignore):
                    continue
                raise ValueError(f"{self.family} weight map: {key!r} is not a Hugging Face {self.family} weight "
                                 f"(no rule takes it)")
            index, part, groups = found
            name = _fill(self.rules[index].ours, groups)
            used[index] = True
            rule = self.rules[index]
            if len(rule.hf) > 1:
                packs.setdefault(name, (rule, {}, groups))[1][part] = t
                continue
            if name in out:
                raise ValueError(f"{self.family} weight map: {source[name]!r} and {key!r} both map to our {name!r}")
            out[name], source[name] = (t.t().contiguous() if rule.transpose and t.dim() == 2 else t), key
        for name, (rule, parts, groups) in packs.items():
            if len(parts) != len(rule.hf):
                missing = [_fill(rule.hf[i], groups) for i in range(len(rule.hf)) if i not in parts]
                raise ValueError(f"{self.family} weight map: {name!r} packs {len(rule.hf)} tensors but the "
                                 f"checkpoint lacks {missing}")
            if name in out:
                raise ValueError(f"{self.family} weight map: two rules produce our {name!r}")
            out[name] = torch.cat([parts[i] for i in range(len(rule.hf))], dim=0)
        self._check_used(used, "in the checkpoint")
        for alias, src in self.tied.items():
            if src not in out:
                raise ValueError(f"{self.family} weight map: the checkpoint has no tensor for {src!r}, the source "
                                 f"of the tied {alias!r}")
            out[alias] = out[src]
        return out

    def _match_hf(self, key: str) -> Optional[tuple[int, int, dict[str, str]]]:
        """``(rule index, part index, placeholder values)`` of the first rule with a part matching ``key``."""
        for index, (_, parts) in enumerate(self._patterns):
            for part, pattern in enumerate(parts):
                m = pattern.fullmatch(key)
                if m:
                    return index, part, m.groupdict()
        return None

    # ---- checks --------------------------------------------------------------------------

    def _check_used(self, used: list[bool], where: str) -> None:
        unused = [str(rule) for rule, u in zip(self.rules, used) if not u]
        if unused:
            raise ValueError(f"{self.family} weight map: rule {unused[0]} matches none {where}"
                             + (f" (nor do {len(unused) - 1} more rules)" if len(unused) > 1 else ""))

    def _check_tied(self, state_dict: Mapping[str, Tensor], where: str) -> None:
        for alias, src in self.tied.items():
            if alias not in state_dict or src not in state_dict:
                raise ValueError(f"{self.family} weight map: tied {alias!r} -> {src!r}, but {where} lacks "
                                 f"{(alias if alias not in state_dict else src)!r}")

