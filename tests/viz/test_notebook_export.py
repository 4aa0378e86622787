"""A notebook's HTML export (nbconvert, its default ``lab`` template) holding our views, opened in headless
Chromium: each view draws inside its ``<iframe srcdoc sandbox="allow-scripts">``, a hover changes the lines'
opacity there, hostile tokens stay text, and no request leaves the file from a view. nbconvert's own template
asks for require.js and MathJax from a CDN (its choice, not ours): the test aborts every network request, checks
that the only ones are those two template URLs from the top-level page, and that the views draw without them.

The default run puts the view's ``_repr_html_()`` into the notebook as the ``execute_result`` Jupyter would store;
the ``slow`` test executes a real notebook in a fresh kernel first (``nbclient``), then exports it.
"""
import pytest
import torch

nbformat = pytest.importorskip("nbformat", reason="nbformat is a dev dependency (pip install -e .[dev])")
nbconvert = pytest.importorskip("nbconvert", reason="nbconvert is a dev dependency (pip install -e .[dev])")

from attnlab.viz import head_view, model_view  # noqa: E402

HOSTILE = ["[CLS]", '<img src=x onerror="window.__pwned=1">', "</script><script>window.__pwned=1</script>", "a & b"]


def _export(nb, path):
    exporter = nbconvert.HTMLExporter()
    body, _ = exporter.from_notebook_node(nb)
    path.write_text(body, encoding="utf-8")
    return path, {exporter.require_js_url, exporter.mathjax_url}


def _open(browser, path):
    """The page, and every request it made as (url, url of the frame that made it); all network requests aborted."""
    page = browser.new_page(viewport={"width": 1200, "height": 2400})
    page.requests, page.problems = [], []
    page.on("request", lambda r: page.requests.append((r.url, r.frame.url)))
    page.on("pageerror", lambda e: page.problems.append(f"pageerror: {e}"))
    page.route("http*://**/*", lambda route: route.abort())
    page.goto(path.resolve().as_uri())
    page.wait_for_load_state("load")
    return page


def _view_frames(page, n):
    """The ``n`` views' frames, once each has drawn (an iframe's document loads after the page's ``load`` on a
    busy machine, so wait for it rather than read ``page.frames`` at once)."""
    page.wait_for_function(f"document.querySelectorAll('iframe[srcdoc]').length === {n}")
    frames = [el.content_frame() for el in page.query_selector_all("iframe[srcdoc]")]
    for frame in frames:
        frame.wait_for_selector("#hv-svg, canvas.thumb, #grid", state="attached")
    return frames


def _opacities(frame, q=None):
    sel = "#hv-svg line" if q is None else f"#hv-svg line[data-q='{q}']"
    return frame.eval_on_selector_all(sel, "els => els.map(e => +e.getAttribute('stroke-opacity'))")


def _check(page, template_urls, n_views, tokens):
    frames = _view_frames(page, n_views)  # drawn: every request a view would make has been made
    assert [f.url for f in frames] == ["about:srcdoc"] * n_views
    url = page.url
    outside = [(u, f) for u, f in page.requests if u not in (url, "about:srcdoc")]
    assert all(f == url for _, f in outside), f"a view made a request: {outside}"
    assert {u for u, _ in outside} <= template_urls, outside
    head = frames[0]
    head.wait_for_selector("#hv-svg line", state="attached")
    assert head.eval_on_selector_all("#hv-svg text.tok-q", "els => els.map(e => e.textContent)") == tokens
    before = _opacities(head)
    assert before and any(op > 0 for op in before)
    head.hover("#hv-svg text.tok-q[data-i='2']")
    after = _opacities(head)
    assert after != before
    others = [op for i in range(len(tokens)) if i != 2 for op in _opacities(head, i)]
    assert others and all(op == 0 for op in others)  # only the hovered token's lines stay visible
    assert any(op > 0 for op in _opacities(head, 2))
    for target in (page, *frames):
        assert target.evaluate("typeof window.__pwned") == "undefined"
        assert target.eval_on_selector_all("img", "els => els.length") == 0
    assert page.problems == []


def _notebook(cells_and_views):
    nb = nbformat.v4.new_notebook()
    for i, (source, view) in enumerate(cells_and_views, 1):
        cell = nbformat.v4.new_code_cell(source, execution_count=i)
        cell.outputs = [nbformat.v4.new_output("execute_result", execution_count=i,
                                               data={"text/html": view._repr_html_(), "text/plain": repr(view)})]
        nb.cells.append(cell)
    return nb


def test_exported_notebook_views_draw_and_stay_inside(browser, tmp_path):
    g = torch.Generator().manual_seed(0)
    att = tuple((2 * torch.randn(1, 3, 4, 4, generator=g)).softmax(-1) for _ in range(2))
    nb = _notebook([("head_view(att, tokens)", head_view(att, HOSTILE, html_action="return")),
                    ("model_view(att, tokens)", model_view(att, HOSTILE, html_action="return"))])
    path, template_urls = _export(nb, tmp_path / "views.html")
    page = _open(browser, path)
    _check(page, template_urls, 2, HOSTILE)
    page.close()


@pytest.mark.slow
def test_executed_notebook_export(browser, tmp_path):
    nbclient = pytest.importorskip("nbclient", reason="nbclient is a dev dependency (pip install -e .[dev])")
    pytest.importorskip("transformers")
    src = f"""import torch, transformers
from attnlab.viz import head_view
cfg = transformers.BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=64, max_position_embeddings=32, attn_implementation="eager")
torch.manual_seed(0)
with torch.no_grad():
    out = transformers.BertModel(cfg).eval()(torch.tensor([[2, 5, 9, 3]]), output_attentions=True)
head_view(out.attentions, {HOSTILE!r})"""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    path, template_urls = _export(nb, tmp_path / "executed.html")
    page = _open(browser, path)
    _check(page, template_urls, 1, HOSTILE)
    page.close()
