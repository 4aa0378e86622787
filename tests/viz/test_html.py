"""The HTML page without a browser: self-contained, escaped, data equal to the record, thinned with notes.

Tolerance of the embedded weights: they are integers w·SCALE, so |w_page - w| ≤ 0.5/SCALE.
"""
import base64
import hashlib
import json
import re
from html.parser import HTMLParser

import pytest
import torch

from attnlab.viz.html import SCALE, _json_for_script, _spread, render_html, save_html

HOSTILE = ['<img src=x onerror="window.__pwned=1">', "</script><script>window.__pwned=1</script>",
           "a & b", "line\u2028sep\u2029", "<!--", "]]>", "\"quote'"]


class _Tags(HTMLParser):
    """Every start tag with its attributes, and the text of each <script> and <style>."""

    def __init__(self):
        super().__init__()
        self.tags, self.scripts, self.styles, self._in = [], [], [], None

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag in ("script", "style"):
            self._in = (tag, dict(attrs))

    def handle_endtag(self, tag):
        if tag in ("script", "style"):
            self._in = None

    def handle_data(self, data):
        if self._in and self._in[0] == "script":
            self.scripts.append((self._in[1], data))
        elif self._in:
            self.styles.append(data)


def _parse(page):
    p = _Tags()
    p.feed(page)
    return p


def _data(page):
    m = re.search(r'<script type="application/json" id="attnlab-data">(.*?)</script>', page, re.S)
    return json.loads(m.group(1)), m.group(1)


def test_page_is_self_contained(make_record):
    page = render_html(make_record(8), title="fox")
    assert "http://" not in page and "https://" not in page
    p = _parse(page)
    for tag, attrs in p.tags:
        for a in ("src", "href", "action", "data", "srcset", "xlink:href"):
            assert a not in attrs or attrs[a].startswith("data:"), (tag, attrs)
        assert tag not in ("iframe", "object", "embed", "img", "base")
    assert [a for a, _ in p.scripts] == [{"type": "application/json", "id": "attnlab-data"}, {}]
    assert "@import" not in page and "url(" not in page
    # the CSP allows exactly the inline script and style (by hash) and nothing from anywhere else
    csp = next(a["content"] for t, a in p.tags if t == "meta" and a.get("http-equiv") == "Content-Security-Policy")
    assert csp.startswith("default-src 'none';")

    def digest(text):
        return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"

    assert f"script-src {digest(p.scripts[1][1])};" in csp
    assert f"style-src {digest(p.styles[0])};" in csp
    assert "innerHTML" not in page and "outerHTML" not in page and "eval(" not in page


def test_embedded_data_equals_the_record(make_record):
    rec = make_record(7, layers=3, heads=2)
    data, _ = _data(render_html(rec, layer=2, min_weight=0.0))
    assert data["layer"] == 2 and data["scale"] == SCALE
    (k,) = data["kinds"]
    w = rec.attentions["encoder"]
    assert k["tokens_q"] == rec.tokens_q["encoder"] and (k["n_layers"], k["n_heads"]) == (3, 2)
    maps = torch.tensor(k["model"]["maps"], dtype=torch.float64).view(3, 2, 7, 7) / SCALE
    assert (maps - w.double()).abs().max() <= 0.5 / SCALE
    for layer in range(3):  # min_weight 0, 7 tokens < top_k: every (q, k) pair has its line
        for h in range(2):
            flat = torch.tensor(k["head"]["lines"][layer][h]).view(-1, 3)
            assert len(flat) == 49
            got = torch.zeros(7, 7, dtype=torch.float64)
            got[flat[:, 0], flat[:, 1]] = flat[:, 2].double() / SCALE
            assert (got - w[layer, h].double()).abs().max() <= 0.5 / SCALE
    assert k["head"]["notes"] == ["Lines (all layers and heads): all 294 drawn."]
    assert k["model"]["notes"] == ["All 3\u00d72 maps at full resolution (7\u00d77)."]


def test_hostile_tokens_are_escaped_in_the_json_block(make_record):
    rec = make_record(len(HOSTILE), tokens=HOSTILE)
    page = render_html(rec, title='<b>"x"</b> & </title>')
    data, raw = _data(page)
    assert not set("<>&\u2028\u2029") & set(raw)  # nothing in the block can close it or end a JS line
    assert "\\u003c/script\\u003e" in raw and "\\u2028" in raw
    assert data["kinds"][0]["tokens_q"] == HOSTILE == data["kinds"][0]["tokens_k"]  # round trip, unchanged
    assert page.count("</script>") == 2 and page.count("<script") == 2
    assert "<img" not in page
    assert "<title>&lt;b&gt;&quot;x&quot;&lt;/b&gt; &amp; &lt;/title&gt;</title>" in page
    assert json.loads(_json_for_script({"s": "</script>\u2028"})) == {"s": "</script>\u2028"}


def test_long_input_is_thinned_and_says_so(make_record):
    L = 300
    rec = make_record(L, layers=14, heads=18)
    page = render_html(rec, top_k=5, max_tokens=100, max_lines=20_000, max_map=40, max_layers=6, max_heads=8)
    data, _ = _data(page)
    k = data["kinds"][0]
    hv, mv = k["head"], k["model"]
    notes = " ".join(hv["notes"] + mv["notes"])
    assert "first 100 of 300 query tokens" in notes
    assert "top_k was lowered from 5 to 1" in notes  # 20000 // (14 * 18 * 100) = 0 -> 1 line per token
    assert re.search(r"Lines \(all layers and heads\): \d+ of 2520000 drawn", notes)
    assert "largest weight left out is 0." in notes
    n_lines = sum(len(h) // 3 for layer in hv["lines"] for h in layer)
    assert n_lines <= 14 * 18 * 100 and hv["n_q"] == hv["n_k"] == 100
    for layer in hv["lines"]:
        for h in layer:
            q = h[0::3]
            assert len(q) == len(set(q)) and max(h[1::3]) < 100  # one line per query, keys in the window
    assert mv["layers"] == [0, 3, 5, 8, 10, 13] and mv["heads"] == list(range(8))
    assert "6 of 14 layers" in notes and "heads 0\u20137 of 18" in notes
    assert "pooled from 300\u00d7300 to 38\u00d738" in notes  # ceil(300/40) = 8 tokens per cell
    assert len(mv["rows"]) == 38 and mv["rows"][0] == "0\u20137" and len(mv["maps"][0][0]) == 38 * 38
    # the top line of a query is the strongest key, with its weight
    w = rec.attentions["encoder"]
    first = hv["lines"][0][0]
    q, key, wi = first[0], first[1], first[2]
    assert key == int(w[0, 0, q, :100].argmax()) and abs(wi / SCALE - float(w[0, 0, q, key])) <= 0.5 / SCALE


def test_min_weight_thins_lines(make_record):
    rec = make_record(12)
    k = _data(render_html(rec, min_weight=0.05))[0]["kinds"][0]
    w = rec.attentions["encoder"]
    assert sum(len(h) // 3 for h in k["head"]["lines"][1]) == int((w[1] >= 0.05).sum())
    left_out = float(w.masked_fill(w >= 0.05, 0).max())
    note = k["head"]["notes"][0]
    assert f"left out when its weight is below 0.05. The largest weight left out is {left_out:.4f}." in note


def test_encoder_decoder_record_has_a_kind_each(make_record):
    from attnlab.viz.extract import AttentionRecord

    enc, dec = torch.rand(2, 2, 5, 5).softmax(-1), torch.rand(3, 2, 4, 4).softmax(-1)
    cross = torch.rand(3, 2, 4, 5).softmax(-1)
    s, t = list("abcde"), list("wxyz")
    rec = AttentionRecord({"encoder": enc, "decoder": dec, "cross": cross},
                          {"encoder": s, "decoder": t, "cross": t}, {"encoder": s, "decoder": t, "cross": s})
    kinds = _data(render_html(rec, layer=1))[0]["kinds"]
    assert [k["name"] for k in kinds] == ["encoder", "decoder", "cross"]
    assert kinds[2]["tokens_q"] == t and kinds[2]["tokens_k"] == s and kinds[2]["n_layers"] == 3
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\)"):
        render_html(rec, layer=2)  # the encoder has only 2 layers


def test_bad_arguments(make_record, tmp_path):
    rec = make_record(4)
    with pytest.raises(TypeError, match="record must be an AttentionRecord"):
        render_html({"encoder": torch.rand(1, 1, 2, 2)})
    with pytest.raises(ValueError, match="layer must be an int in"):
        render_html(rec, layer=-1)
    with pytest.raises(ValueError, match="top_k must be an int >= 1"):
        render_html(rec, top_k=0)
    with pytest.raises(ValueError, match="min_weight must be a float in"):
        render_html(rec, min_weight=2.0)
    with pytest.raises(TypeError, match="title must be a str"):
        render_html(rec, title=None)
    with pytest.raises(FileNotFoundError, match="no such directory"):
        save_html(rec, tmp_path / "missing" / "v.html")


def test_save_html_is_atomic(make_record, tmp_path, monkeypatch):
    rec = make_record(4)
    path = save_html(rec, tmp_path / "view.html", title="t")
    assert path.read_text(encoding="utf-8") == render_html(rec, title="t")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["view.html"]  # no temp file left behind

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr("attnlab._io.os.replace", fail)
    with pytest.raises(OSError, match="disk full"):
        save_html(rec, tmp_path / "view.html", title="other")
    assert path.read_text(encoding="utf-8") == render_html(rec, title="t")  # the old file is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["view.html"]


def test_spread_keeps_first_and_last():
    assert _spread(5, 12) == [0, 1, 2, 3, 4]
    assert _spread(24, 4) == [0, 8, 15, 23]
    assert _spread(24, 1) == [23]
