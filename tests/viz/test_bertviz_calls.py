"""bertviz's documented calls, unchanged but for the import (``from attnlab.viz import head_view, model_view,
neuron_view``): positional ``sentence_b_start``, ``html_action`` ("view" displays through IPython and returns None;
"return" gives an object whose ``.data`` is the page), ``prettify_tokens``, ``display_mode``, ``include_layers``,
``include_heads``, the encoder-decoder triples, and the neuron view's ``(model, model_type, tokenizer, sentence_a,
sentence_b, layer=, head=)`` on transformers' BERT and GPT-2 and on ours. The neuron view's softmax equals the
model's own attention weights to the page's rounding (1e-4 / 2)."""
import json
import re

import pytest
import torch

from attnlab.viz import head_view, model_view, neuron_view

transformers = pytest.importorskip("transformers")

HOSTILE = "</script><svg/onload=window.__pwned=1>"
WORDS = ["the", "cat", "sat", "on", "mat", "lay", "rug", "Ġdog", HOSTILE]


def _data(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="attnlab-data">(.*?)</script>', page, re.S)
    return json.loads(m.group(1))


@pytest.fixture
def shown(monkeypatch):
    """What ``html_action='view'`` hands to IPython's ``display``."""
    import IPython.display

    out = []
    monkeypatch.setattr(IPython.display, "display", lambda obj: out.append(obj))
    return out


@pytest.fixture(scope="module")
def tokenizer():
    """A transformers fast tokenizer over a word-level vocabulary with BERT's special tokens and pair template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    vocab = {w: i for i, w in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                                cls_token="[CLS]", sep_token="[SEP]")


BERT = dict(vocab_size=16, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=32)


@pytest.fixture(scope="module")
def bert_run(tokenizer):
    """bertviz's README example on a tiny random BERT: ``attention``, ``tokens`` and ``sentence_b_start``."""
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(**BERT, attn_implementation="eager")).eval()
    inputs = tokenizer.encode("the cat sat on the mat", "the cat lay on the rug", return_tensors="pt")
    with torch.no_grad():
        outputs = model(inputs, token_type_ids=torch.tensor([[0] * 8 + [1] * 7]), output_attentions=True)
    attention = outputs.attentions  # bertviz's README: outputs[-1], which transformers 5 fills with cross_attentions
    tokens = tokenizer.convert_ids_to_tokens(inputs[0])
    sentence_b_start = tokens.index("[SEP]") + 1
    return model, attention, tokens, sentence_b_start


def test_readme_head_and_model_view_calls(bert_run, shown):
    _, attention, tokens, sentence_b_start = bert_run
    assert head_view(attention, tokens, sentence_b_start) is None  # displayed, as bertviz
    assert model_view(attention, tokens, sentence_b_start) is None
    assert [type(v).__name__ for v in shown] == ["AttentionView", "AttentionView"]
    head, model = (_data(v.data) for v in shown)
    assert [k["label"] for k in head["kinds"]][:2] == ["All", "Sentence A \u2192 Sentence A"]
    assert head["tab"] == "head" and model["tab"] == "model" and model["theme"] == "dark"  # bertviz's default
    assert head["kinds"][1]["tokens_q"] == tokens[:sentence_b_start]
    assert shown[0]._repr_html_().startswith("<iframe srcdoc=")


def test_html_action_return_gives_the_page_in_data(bert_run, shown, tmp_path):
    _, attention, tokens, _ = bert_run
    html_head_view = head_view(attention, tokens, html_action="return")
    with open(tmp_path / "head_view.html", "w") as file:
        file.write(html_head_view.data)
    html_model_view = model_view(attention, tokens, html_action="return")
    assert shown == []  # nothing displayed
    page = (tmp_path / "head_view.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and _data(page)["kinds"][0]["tokens_q"] == tokens
    w = _data(html_model_view.data)["kinds"][0]["model"]["maps"][2][1]
    assert w == (attention[2][0, 1] * 10_000).round().long().flatten().tolist()


def test_documented_options(bert_run, shown):
    _, attention, tokens, _ = bert_run
    head_view(attention, tokens, layer=2, heads=[3, 1])
    head_view(attention, tokens, include_layers=[1, 2])
    model_view(attention, tokens, include_layers=[0, 2])
    model_view(attention, tokens, include_heads=[1, 3])
    model_view(attention, tokens, display_mode="light")
    a, b, c, d, e = (_data(v.data) for v in shown)
    assert a["layer"] == 2 and a["heads"] == [1, 3] and a["layers"] is None
    assert b["layers"] == [1, 2] and b["layer"] == 1  # the menu offers the included layers, opening on the first
    assert c["kinds"][0]["model"]["layers"] == [0, 2] and d["kinds"][0]["model"]["heads"] == [1, 3]
    assert e["theme"] == "light"
    with pytest.raises(ValueError, match=r"layer 0 is not in include_layers \[1, 2\]"):
        head_view(attention, tokens, layer=0, include_layers=[1, 2])
    with pytest.raises(ValueError, match="display_mode must be 'light' or 'dark', got 'blue'"):
        model_view(attention, tokens, display_mode="blue")
    with pytest.raises(ValueError, match="html_action must be"):
        model_view(attention, tokens, html_action="save")


def test_prettify_tokens():
    att = (torch.full((1, 1, 4, 4), 0.25),)
    toks = ["Ġthe", "\u2581cat", "sat</w>", "a\u010a"]
    head_view(att, toks, html_action="return")
    pretty = _data(head_view(att, toks, html_action="return").data)["kinds"][0]["tokens_q"]
    assert pretty == [" the", " cat", "sat", "a\n"]
    raw = _data(head_view(att, toks, prettify_tokens=False, html_action="return").data)["kinds"][0]["tokens_q"]
    assert raw == toks


def test_encoder_decoder_call(shown):
    g = torch.Generator().manual_seed(0)

    def att(q, k):
        return tuple((2 * torch.randn(1, 2, q, k, generator=g)).softmax(-1) for _ in range(2))

    enc, dec, cross = att(5, 5), att(3, 3), att(3, 5)
    encoder_text = ["\u2581Hello", "\u2581world", "!", "</s>", "x"]
    decoder_text = ["<pad>", "\u2581Hallo", "\u2581Welt"]
    model_view(encoder_attention=enc, decoder_attention=dec, cross_attention=cross, encoder_tokens=encoder_text,
               decoder_tokens=decoder_text)
    head_view(encoder_attention=enc, decoder_attention=dec, cross_attention=cross, encoder_tokens=encoder_text,
              decoder_tokens=decoder_text)
    for v in shown:
        kinds = _data(v.data)["kinds"]
        assert [k["name"] for k in kinds] == ["encoder", "decoder", "cross"]
        assert kinds[2]["tokens_q"] == ["<pad>", " Hallo", " Welt"] and kinds[2]["tokens_k"][0] == " Hello"


def test_empty_attentions_name_the_eager_implementation(tokenizer):
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(**BERT)).eval()  # transformers' default: SDPA
    inputs = tokenizer.encode("the cat sat", return_tensors="pt")
    with torch.no_grad():
        attention = model(inputs, output_attentions=True)[-1]
    assert attention == ()  # the last field: cross_attentions, empty for an encoder
    with pytest.raises(ValueError, match=r"outputs\[-1\] may be another field"):
        head_view(attention, tokenizer.convert_ids_to_tokens(inputs[0]))
    with torch.no_grad():
        attention = model(inputs, output_attentions=True).attentions
    if attention != ():
        pytest.fail(f"transformers {transformers.__version__} returned attentions under SDPA; update this test")
    with pytest.raises(ValueError, match='attention is an empty tuple.*attn_implementation="eager"'):
        head_view(attention, tokenizer.convert_ids_to_tokens(inputs[0]))


def _eager(model, cls, cfg_cls, **cfg):
    twin = cls(cfg_cls(**cfg, attn_implementation="eager")).eval()
    twin.load_state_dict(model.state_dict())
    return twin


def test_neuron_view_transformers_bert(tokenizer, shown):
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(**BERT)).eval()  # SDPA: hooks, not output_attentions
    sentence_a, sentence_b = "the cat sat on the mat", "the cat lay on the rug"
    assert neuron_view(model, "bert", tokenizer, sentence_a, sentence_b, layer=2, head=0) is None
    data = _data(shown[0].data)
    enc = tokenizer(sentence_a, sentence_b, return_tensors="pt")
    with torch.no_grad():
        att = _eager(model, transformers.BertModel, transformers.BertConfig, **BERT)(**enc, output_attentions=True)
    expected = torch.stack([a[0] for a in att.attentions])  # (layers, heads, L, L)
    assert data["layer"] == 2 and data["head"] == 0 and data["theme"] == "dark"
    assert data["tokens"] == tokenizer.convert_ids_to_tokens(enc["input_ids"][0])
    assert (torch.tensor(data["w"]) - expected).abs().max() <= 0.5e-4 + 1e-6
    q, k = torch.tensor(data["q"]), torch.tensor(data["k"])
    assert q.shape == k.shape == (3, 4, 15, 8)
    # the query and key vectors are the model's own projections of head 0's slice
    scores = torch.tensor(data["scores"])
    assert (scores - q @ k.transpose(-1, -2) / 8 ** 0.5).abs().max() < 1e-2


def test_neuron_view_transformers_gpt2_is_causal(tokenizer):
    cfg = dict(vocab_size=16, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg)).eval()
    data = _data(neuron_view(model, "gpt2", tokenizer, "the cat sat on", html_action="return").data)
    ids = tokenizer("the cat sat on", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        att = _eager(model, transformers.GPT2LMHeadModel, transformers.GPT2Config, **cfg)(ids, output_attentions=True)
    w = torch.tensor(data["w"])
    assert (w - torch.stack([a[0] for a in att.attentions])).abs().max() <= 0.5e-4 + 1e-6
    assert w.triu(1).abs().max() == 0 and data["mask"][0][0] == [1, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_neuron_view_attnlab_models(tokenizer, family):
    from attnlab.models.bert import BertConfig, BertModel
    from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel
    from attnlab.models.llama import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = {"bert": lambda: BertModel(BertConfig(**BERT)),
             "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=16, n_embd=32, n_layer=2, n_head=2)),
             "llama": lambda: LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=32, num_hidden_layers=2,
                                                           num_attention_heads=4, num_key_value_heads=2,
                                                           intermediate_size=64, max_position_embeddings=32)),
             }[family]().eval()
    view = neuron_view(model, None, tokenizer, "the cat sat on the mat", html_action="return", display_mode="light")
    data = _data(view.data)
    ids = tokenizer("the cat sat on the mat", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        att = model(ids, output_attentions=True).attentions
    assert (torch.tensor(data["w"]) - torch.stack([a[0] for a in att])).abs().max() <= 0.5e-4 + 1e-6
    assert data["theme"] == "light"


def test_neuron_view_bad_input(tokenizer):
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(**BERT)).eval()
    with pytest.raises(ValueError, match="model_type='gpt2' but the model is a 'bert' model"):
        neuron_view(model, "gpt2", tokenizer, "the cat")
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 3\), got 3"):
        neuron_view(model, "bert", tokenizer, "the cat", layer=3)
    with pytest.raises(ValueError, match=r"head must be an int in \[0, 4\), got -1"):
        neuron_view(model, "bert", tokenizer, "the cat", head=-1)
    with pytest.raises(ValueError, match="sentence_a must be a non-empty str"):
        neuron_view(model, "bert", tokenizer, "")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        neuron_view("bert-base-uncased", "bert", tokenizer, "the cat")


def test_neuron_view_page_in_the_browser(tokenizer, open_file, tmp_path):
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(**BERT)).eval()
    hostile = f"the {HOSTILE} cat"
    view = neuron_view(model, "bert", tokenizer, hostile, html_action="return", layer=1, head=3)
    page = open_file(view.save(tmp_path / "neuron.html"))
    assert page.input_value("#layer") == "1" and page.input_value("#head") == "3"
    shown_tokens = page.eval_on_selector_all("#nv td.tok-q", "els => els.map(e => e.textContent)")
    assert shown_tokens == _data(view.data)["tokens"] == ["[CLS]", "the", HOSTILE, "cat", "[SEP]"]
    page.hover("#nv td.tok-q[data-i='2']")
    assert page.get_attribute("#nv tr[data-j='2']", "class").split()[0] == "sel"
    w = page.eval_on_selector_all("#nv td.w", "els => els.map(e => +e.getAttribute('data-w'))")
    assert w == _data(view.data)["w"][1][3][2]
    assert page.evaluate("typeof window.__pwned") == "undefined" and page.problems == []
