"""README.md and README.zh-CN.md stay in step.

The Chinese README is a translation: its prose differs, but what a reader copies or follows must not.
Compared, English against Chinese:

- the fenced code blocks, in order, byte for byte (code and its comments stay as in README.md);
- the tables, in order, with the same number of rows each;
- every ``attnlab <subcommand>`` written in inline code, and every relative link target (``docs/...``);
- each README links to the other before its first ``##`` section.

When README.md changes, make the same change in README.zh-CN.md (translated prose, identical code).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EN, ZH = "README.md", "README.zh-CN.md"

_FENCE = re.compile(r"^```[^\n]*\n.*?^```[ \t]*$", re.M | re.S)
_INLINE = re.compile(r"`([^`\n]+)`")
_SUBCOMMAND = re.compile(r"\battnlab ([a-z][a-z0-9-]*)")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _read(name: str) -> str:
    return (REPO / name).read_text(encoding="utf-8")


def code_blocks(text: str) -> list[str]:
    """The fenced code blocks, in order, fences included."""
    return _FENCE.findall(text)


def prose(text: str) -> str:
    """The text with its fenced code blocks removed."""
    return _FENCE.sub("", text)


def table_rows(text: str) -> list[int]:
    """Rows (header and separator included) of each table, in order of appearance."""
    counts, run = [], 0
    for line in prose(text).splitlines() + [""]:
        if line.lstrip().startswith("|"):
            run += 1
        elif run:
            counts.append(run)
            run = 0
    return counts


def subcommands(text: str) -> set[str]:
    """``attnlab <subcommand>`` as written in inline code spans of the prose."""
    return {m for span in _INLINE.findall(prose(text)) for m in _SUBCOMMAND.findall(span)}


def relative_links(text: str) -> set[str]:
    """Markdown link targets that are neither URLs nor in-page anchors."""
    links = {t for t in _LINK.findall(prose(text)) if not re.match(r"[a-z][a-z0-9+.-]*:|#", t)}
    return links - {EN, ZH}  # each links to the other: checked by links_at_top


def links_at_top(text: str, target: str) -> bool:
    """True when a link to ``target`` appears before the first ``## `` heading."""
    head = re.split(r"^## ", prose(text), maxsplit=1, flags=re.M)[0]
    return f"]({target})" in head


def differences(en: str, zh: str) -> list[str]:
    """Every way the two READMEs are out of step, one readable line each (empty: in step)."""
    out = []
    a, b = code_blocks(en), code_blocks(zh)
    if len(a) != len(b):
        out.append(f"{EN} has {len(a)} fenced code blocks, {ZH} has {len(b)}")
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            xl, yl = x.splitlines(), y.splitlines()
            j = next((j for j, (p, q) in enumerate(zip(xl, yl)) if p != q), min(len(xl), len(yl)))
            got = yl[j] if j < len(yl) else "<end of block>"
            want = xl[j] if j < len(xl) else "<end of block>"
            out.append(f"code block {i + 1}, line {j + 1}: {EN} has {want!r}, {ZH} has {got!r}")
    ra, rb = table_rows(en), table_rows(zh)
    if ra != rb:
        out.append(f"table rows (per table, in order): {EN} {ra}, {ZH} {rb}")
    for what, f in (("`attnlab <subcommand>`", subcommands), ("relative link", relative_links)):
        sa, sb = f(en), f(zh)
        if sa - sb:
            out.append(f"{what} only in {EN}: {sorted(sa - sb)}")
        if sb - sa:
            out.append(f"{what} only in {ZH}: {sorted(sb - sa)}")
    if not links_at_top(en, ZH):
        out.append(f"{EN} does not link to {ZH} before its first '## ' section")
    if not links_at_top(zh, EN):
        out.append(f"{ZH} does not link to {EN} before its first '## ' section")
    return out


def test_readmes_in_step():
    diffs = differences(_read(EN), _read(ZH))
    assert not diffs, (
        f"{EN} and {ZH} are out of step:\n  - " + "\n  - ".join(diffs)
        + f"\nMake the same change in both: translate the prose into {ZH}, copy code blocks, "
        "commands, tables' rows and links unchanged."
    )


_SAMPLE_EN = """[中文](README.zh-CN.md)

# x

```bash
attnlab demo
```

| a | b |
|---|---|
| `attnlab train R` | [d](docs/a.md) |

## more
"""
_SAMPLE_ZH = _SAMPLE_EN.replace("[中文](README.zh-CN.md)", "[English](README.md)")


def test_sample_in_step():
    assert differences(_SAMPLE_EN, _SAMPLE_ZH) == []


@pytest.mark.parametrize(
    "side, old, new, expected",
    [
        ("zh", "attnlab demo\n", "attnlab demo --x\n",
         "code block 1, line 2: README.md has 'attnlab demo', README.zh-CN.md has 'attnlab demo --x'"),
        ("zh", "## more", "| x | e |\n\n## more",
         "table rows (per table, in order): README.md [3], README.zh-CN.md [3, 1]"),
        ("en", "`attnlab train R`", "train", "`attnlab <subcommand>` only in README.zh-CN.md: ['train']"),
        ("zh", "docs/a.md", "docs/b.md",
         "relative link only in README.md: ['docs/a.md']\nrelative link only in README.zh-CN.md: ['docs/b.md']"),
        ("en", "[中文](README.zh-CN.md)\n", "",
         "README.md does not link to README.zh-CN.md before its first '## ' section"),
        ("zh", "[English](README.md)\n", "## top\n[English](README.md)\n",
         "README.zh-CN.md does not link to README.md before its first '## ' section"),
    ],
)
def test_each_drift_is_named(side, old, new, expected):
    en, zh = _SAMPLE_EN, _SAMPLE_ZH
    if side == "en":
        en = en.replace(old, new)
    else:
        zh = zh.replace(old, new)
    assert differences(en, zh) == expected.split("\n")
