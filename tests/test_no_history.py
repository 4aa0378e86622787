"""The product speaks of itself: no tracked text file carries development history or a developer's machine.

Code, comments, docstrings, docs and tests state what the code does and guarantees. Who measured what, when, on
which host, in which session or for which issue belongs in the commit log and CHANGELOG.md; measured numbers live
in ``benchmarks/results/<cpu class>.json`` and the page generated from them, ``docs/performance.md``, where a CPU
class names the numbers' machine. A failure lists every ``file:line`` and what matched.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()

HISTORY = {
    "a session number": re.compile(r"(?i)\bsessions? \d+"),
    "a helper's name": re.compile(r"\bhelper [A-Z]\b"),
    # ours; an upstream project's bug behind a workaround is named as ``owner/repo#N``
    "an issue reference": re.compile(r"\b(?:[Ii]ssues?|PR|[Pp]ull request)(?:\s*#|\s+)\d+|(?:^|(?<=[\s(\[]))#\d+\b(?![;\w])"),
    "a host": re.compile(r"(?i)\bthis host\b"),
    "a path outside the repository": re.compile(r"/work/|\.\./shared\b|/root/|/home/\w"),
}
MACHINE = {"a CPU model": re.compile(r"(?i)\bzen ?\d|\bEPYC\b|\bXeon\b")}
DATE = {"a date": re.compile(r"\b20\d\d-\d\d-\d\d\b")}

# Where a CPU class or model is the numbers' machine or the code's subject, not history: the measured results, the
# page generated from them, the CPU-class table of the benchmarks and its test.
MACHINE_NAMED = ("benchmarks/results/", "docs/performance.md", "benchmarks/_common.py",
                 "tests/benchmarks/test_performance_page.py")
# History with dates, by version.
DATED = ("CHANGELOG.md",)
# The CI script finds the offline datasets beside the clone (the product itself never names that folder).
OUTSIDE = (".ci/",)


def rules(path: str) -> dict[str, re.Pattern]:
    """The patterns that apply to the tracked file ``path``."""
    if path == THIS:
        return {}
    history = {k: v for k, v in HISTORY.items() if k != "a path outside the repository" or not path.startswith(OUTSIDE)}
    return {**history, **({} if path.startswith(MACHINE_NAMED) else MACHINE), **({} if path in DATED else DATE)}


def text_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    return [p for p in out.decode().split("\0") if p]


def findings(path: str, text: str) -> list[str]:
    """``path:line: what (the match)`` for every line of ``text`` that matches one of ``path``'s rules."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for what, pattern in rules(path).items():
            m = pattern.search(line)
            if m:
                found.append(f"{path}:{n}: {what} ({m.group(0)!r})")
    return found


def test_no_tracked_text_file_carries_history():
    found = []
    for path in text_files():
        file = ROOT / path
        if not file.is_file():  # deleted in the working tree, not yet committed
            continue
        data = file.read_bytes()
        if b"\0" in data:
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        found += findings(path, text)
    assert not found, f"{len(found)} line(s) of history:\n" + "\n".join(found)


def test_the_rules_catch_history_and_let_the_product_be():
    """Each rule catches what it is for and passes ordinary text (CSS colours, ``# 1`` comments, a CPU class in
    the results)."""
    caught = ["measured in session 26", "Sessions 25-26", "on 2 Zen4 cores", "a Zen 3 host", "AMD EPYC", "Xeon",
              "on this host", "helper D's test", "issue #16", "issue 50", "(#16 asks)", "PR #24773", "2026-12-07", "/work/shared/data", "../shared/data", "/root/x", "/home/dev/x"]
    for text in caught:
        assert findings("src/x.py", text), text
    passed = ["color: #222; background: #fff;", "x = 1  # 1 row", "the session's state", "helper function",
              "zenith 3", "issue a warning", "see docs/performance.md", "epycycle", "base64 +Pr6/PR1aB",
              "oneDNN's bug pytorch/pytorch#195066"]
    for text in passed:
        assert not findings("src/x.py", text), text
    assert not findings("benchmarks/results/amd-zen-3-avx2.json", '"cpu_class": "AMD Zen 3 AVX2"')
    assert findings("benchmarks/results/amd-zen-3-avx2.json", "session 3")
    assert not findings("CHANGELOG.md", "## 0.1.0 (2026-01-01)")
