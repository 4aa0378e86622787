"""``head_view`` / ``model_view`` for any model: the page embeds exactly the given weights (integers
``round(w·SCALE)``, so ``|w_page - w| <= 0.5/SCALE``), selection and sentence splits as bertviz, tokens
stay text, the inline frame holds the very page ``save`` writes, and bad input is named."""
import json
import re
from html.parser import HTMLParser

import pytest
import torch

from attnlab.viz import AttentionRecord, head_view, model_view, render_html
from attnlab.viz.html import SCALE

HOSTILE = ['</script><img src=x onerror="window.__pwned=1">', "<svg onload=alert(1)>", "a & b", '"quote\'',
           "line\u2028sep"]


def _attentions(layers=3, batch=2, heads=4, L=6, Lk=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple((2 * torch.randn(batch, heads, L, L if Lk is None else Lk, generator=g)).softmax(-1)
                 for _ in range(layers))


def _data(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="attnlab-data">(.*?)</script>', page, re.S)
    return json.loads(m.group(1))


def _lines(kind: dict, layer: int) -> dict:
    """{(head, q, k): integer weight} of the head view's lines in ``layer``."""
    out = {}
    for h, flat in enumerate(kind["head"]["lines"][layer]):
        for i in range(0, len(flat), 3):
            out[(h, flat[i], flat[i + 1])] = flat[i + 2]
    return out


def _ints(w: torch.Tensor) -> list[int]:
    return (w * SCALE).round().long().flatten().tolist()


def test_page_embeds_exactly_the_given_weights():
    att = _attentions()
    toks = [f"w{i}" for i in range(6)]
    data = _data(head_view(att, toks, batch_index=1, min_weight=0.0, html_action="return").html)
    (kind,) = data["kinds"]
    assert kind["tokens_q"] == toks and kind["tokens_k"] == toks
    assert kind["n_layers"] == 3 and kind["n_heads"] == 4 and data["layer"] == 0 and data["heads"] is None
    for layer in range(3):
        w = att[layer][1]  # (heads, L, L) of example 1
        assert kind["model"]["maps"][layer] == [_ints(w[h]) for h in range(4)]
        lines = _lines(kind, layer)
        assert len(lines) == 4 * 6 * 6  # min_weight=0: every (head, q, k) has its line
        for (h, q, k), v in lines.items():
            assert v == round(float(w[h, q, k]) * SCALE)


def test_layer_and_head_selection():
    att, toks = _attentions(), list("abcdef")
    data = _data(head_view(att, toks, layer=2, heads=[3, 1], html_action="return").html)
    assert data["layer"] == 2 and data["heads"] == [1, 3] and data["tab"] == "head"
    data = _data(model_view(att, toks, include_layers=[2, 0], include_heads=[1], html_action="return").html)
    mv = data["kinds"][0]["model"]
    assert data["tab"] == "model" and mv["layers"] == [0, 2] and mv["heads"] == [1]
    assert mv["maps"] == [[_ints(att[0][0, 1])], [_ints(att[2][0, 1])]]
    assert any("heads 1 of 4" in n for n in mv["notes"])
    for bad in ({"layer": 3}, {"heads": [4]}, {"heads": []}, {"layer": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            head_view(att, toks, **bad)
    with pytest.raises(ValueError, match=r"include_layers must be a non-empty list of ints in \[0, 3\)"):
        model_view(att, toks, include_layers=[5])


def test_sentence_b_start_splits_into_bertviz_blocks():
    att, toks = _attentions(layers=2, L=7), [f"t{i}" for i in range(7)]
    kinds = _data(head_view(att, toks, sentence_b_start=3, min_weight=0.0, html_action="return").html)["kinds"]
    assert [k["label"] for k in kinds] == ["All", "Sentence A \u2192 Sentence A", "Sentence B \u2192 Sentence B",
                                           "Sentence A \u2192 Sentence B", "Sentence B \u2192 Sentence A"]
    a, b = slice(0, 3), slice(3, 7)
    for k, (q, key) in zip(kinds, [(slice(0, 7), slice(0, 7)), (a, a), (b, b), (a, b), (b, a)]):
        assert k["tokens_q"] == toks[q] and k["tokens_k"] == toks[key]
        for layer in range(2):  # the weights as given, not renormalised within the block
            assert k["model"]["maps"][layer] == [_ints(att[layer][0, h][q, key]) for h in range(4)]
    for bad in (0, 7, 2.5, True):
        with pytest.raises(ValueError, match="sentence_b_start"):
            head_view(att, toks, sentence_b_start=bad)


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def test_hostile_tokens_stay_text_and_the_frame_holds_the_saved_page(tmp_path):
    att = _attentions(layers=1, L=len(HOSTILE))
    view = head_view(att, HOSTILE, html_action="return")
    data = _data(view.html)
    assert data["kinds"][0]["tokens_q"] == HOSTILE  # round-trips as text
    assert "</script><img" not in view.html and "<svg onload" not in view.html
    parser = _Tags()
    parser.feed(view._repr_html_())
    assert [t for t, _ in parser.tags] == ["iframe"]  # the notebook sees one element, nothing else runs
    attrs = parser.tags[0][1]
    assert attrs["sandbox"] == "allow-scripts" and attrs["srcdoc"] == view.html
    assert "default-src 'none'" in view.html and not re.search(r"https?://", view.html)  # names no URL
    path = view.save(tmp_path / "view.html")
    assert path.read_text(encoding="utf-8") == view.html


def test_the_same_renderer_as_attnlab_viz():
    att, toks = _attentions(layers=2), list("abcdef")
    enc = head_view(encoder_attentions=att, encoder_tokens=toks, title="T", html_action="return")
    rec = AttentionRecord({"encoder": torch.stack([a[0] for a in att])}, {"encoder": toks}, {"encoder": toks},
                          "encoder-decoder")
    assert enc.html == render_html(rec, title="T")


def test_encoder_decoder_triples_and_bertviz_names():
    enc, dec = _attentions(layers=2, L=5, seed=1), _attentions(layers=2, L=3, seed=2)
    cross = _attentions(layers=2, L=3, Lk=5, seed=3)
    et, dt = list("abcde"), list("xyz")
    view = model_view(encoder_attention=enc, decoder_attention=dec, cross_attention=cross,
                      encoder_tokens=et, decoder_tokens=dt, html_action="return")
    kinds = _data(view.html)["kinds"]
    assert [k["name"] for k in kinds] == ["encoder", "decoder", "cross"]
    assert kinds[2]["tokens_q"] == dt and kinds[2]["tokens_k"] == et
    assert kinds[2]["model"]["maps"][1][0] == _ints(cross[1][0, 0])
    with pytest.raises(ValueError, match="encoder_tokens has 4 tokens"):
        model_view(encoder_attentions=enc, decoder_attentions=dec, encoder_tokens=et[:4], decoder_tokens=dt)
    with pytest.raises(ValueError, match="not both"):
        head_view(_attentions(), list("abcdef"), attentions=_attentions())


def test_bad_input_names_the_argument_and_the_shape():
    att, toks = _attentions(), list("abcdef")
    with pytest.raises(ValueError, match=r"attention\[1\] has shape \(2, 4, 5, 5\).*\(batch, heads, q, k\)"):
        head_view((att[0], att[1][:, :, :5, :5], att[2]), toks)
    with pytest.raises(ValueError, match=r"tokens has 5 tokens but attention is \(batch, heads, q, k\) with q=6"):
        head_view(att, toks[:5])
    with pytest.raises(TypeError, match=r"attention must be a tuple of per-layer \(batch, heads, q, k\)"):
        head_view(att[0], toks)
    with pytest.raises(TypeError, match=r"attention\[0\] must be a torch.Tensor"):
        head_view((att[0].tolist(),), toks)
    with pytest.raises(ValueError, match=r"attention\[0\] must be .* \(batch, heads, q, k\)"):
        head_view((att[0][0],), toks)
    with pytest.raises(TypeError, match="tokens must hold str"):
        head_view(att, [1, 2, 3, 4, 5, 6])
    with pytest.raises(ValueError, match=r"\[0, 1\] \(softmax outputs, not scores\)"):
        head_view(tuple(3 * a - 1 for a in att), toks)
    with pytest.raises(ValueError, match="batch_index must be in"):
        head_view(att, toks, batch_index=2)
    with pytest.raises(ValueError, match="attention is required"):
        head_view(tokens=toks)
    with pytest.raises(TypeError, match=r"unexpected argument\(s\) \['prettify'\]"):
        head_view(att, toks, prettify=False)
    with pytest.raises(ValueError, match="html_action must be 'view'.*or 'return'"):
        head_view(att, toks, html_action="show")


def test_transformers_bert_attentions():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=32, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.BertModel(cfg).eval()
    ids = torch.tensor([[2, 5, 9, 11, 3, 7, 8, 3]])
    with torch.no_grad():
        out = model(ids, token_type_ids=torch.tensor([[0] * 5 + [1] * 3]), output_attentions=True)
    toks = ["[CLS]", "the", "cat", "sat", "[SEP]", "it", "slept", "[SEP]"]
    view = head_view(out.attentions, toks, sentence_b_start=5, min_weight=0.0, html_action="return")
    kinds = _data(view.html)["kinds"]
    assert kinds[0]["n_layers"] == 2 and kinds[0]["n_heads"] == 4
    for layer in range(2):
        assert kinds[0]["model"]["maps"][layer] == [_ints(out.attentions[layer][0, h]) for h in range(4)]


def test_attnlab_gpt2_attentions():
    from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=2)).eval()
    with torch.no_grad():
        out = model(torch.tensor([[1, 4, 9, 16, 25]]), output_attentions=True)
    toks = ["a", "b", "c", "d", "e"]
    kind = _data(model_view(out.attentions, toks, html_action="return").html)["kinds"][0]
    for layer in range(2):
        maps = kind["model"]["maps"][layer]
        assert maps == [_ints(out.attentions[layer][0, h]) for h in range(2)]
        upper = torch.ones(5, 5, dtype=torch.bool).triu(1).flatten()
        assert all(v == 0 for h in range(2) for v, u in zip(maps[h], upper.tolist()) if u)  # causal
