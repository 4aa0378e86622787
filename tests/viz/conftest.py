"""Shared pieces of the viz tests: synthetic attention records and tiny word-level tokenizers."""
import os

import pytest
import torch

from attnlab.viz.extract import AttentionRecord


def random_record(L=6, *, layers=2, heads=3, kind="encoder", tokens=None, seed=0, Lk=None):
    """Softmax-normalised random attention ``(layers, heads, L, Lk)`` with token strings ``t0, t1, …``."""
    g = torch.Generator().manual_seed(seed)
    Lk = L if Lk is None else Lk
    w = (3 * torch.randn(layers, heads, L, Lk, generator=g)).softmax(-1)
    tq = list(tokens) if tokens is not None else [f"t{i}" for i in range(L)]
    tk = list(tokens) if tokens is not None and Lk == L else [f"k{j}" for j in range(Lk)]
    return AttentionRecord({kind: w}, {kind: tq}, {kind: tk}, "Synthetic")


@pytest.fixture
def make_record():
    return random_record


def save_word_tokenizer(directory, words, *, template=None, specials=()):
    """A WordLevel ``tokenizer.json`` over ``specials + words`` (ids in that order), split on whitespace;
    ``template``: a ``TemplateProcessing`` single-sequence template such as ``"$A </s>"``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate([*specials, *words])}
    unk = "<unk>" if "<unk>" in vocab else next(iter(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if template is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=template, special_tokens=[(s, vocab[s]) for s in specials if s in template])
    tok.save(str(directory / "tokenizer.json"))
    return vocab


@pytest.fixture
def word_tokenizer():
    return save_word_tokenizer


# ---- the browser (headless Chromium through Playwright), shared by test_browser and test_notebook_export ----

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"Chromium is not installed at {CHROMIUM} (Debian package 'chromium')")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield b
        b.close()


@pytest.fixture
def open_file(browser):
    """``open_file(path) -> page``; ``page.problems`` collects console errors, page errors and any
    request other than the file itself (an ``<iframe srcdoc>`` is no request: ``about:srcdoc``)."""
    pages = []

    def _open(path):
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.problems = []
        page.on("console", lambda m: m.type == "error" and page.problems.append(f"console: {m.text}"))
        page.on("pageerror", lambda e: page.problems.append(f"pageerror: {e}"))
        url = path.resolve().as_uri()
        page.on("request", lambda r: r.url not in (url, "about:srcdoc") and page.problems.append(f"request: {r.url}"))
        page.goto(url)
        pages.append(page)
        return page

    yield _open
    for p in pages:
        p.close()
