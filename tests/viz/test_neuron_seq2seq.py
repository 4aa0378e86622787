"""The neuron view of T5 and BART: ``sentence_a`` is the source, ``sentence_b`` the target (teacher-forced), and
``attention`` picks the encoder's self-attention, the decoder's or the cross-attention. The softmax weights equal
transformers' ``encoder_attentions`` / ``decoder_attentions`` / ``cross_attentions`` of the same checkpoint (random
tiny ones written by transformers, eager attention); the scores are ``κ q·k (+ T5's position bias)``; the page draws
target queries over source keys in the browser."""
import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnlab  # noqa: E402
from attnlab.viz import neuron_view  # noqa: E402
from tests._seq2seq import save_hf  # noqa: E402
from tests.viz.conftest import save_word_tokenizer  # noqa: E402

WORDS = "the cat sat on mat dog ran".split()
SRC, TGT = "the cat sat on the mat", "the dog ran"


def _data(page: str) -> dict:
    return json.loads(re.search(r'<script type="application/json" id="attnlab-data">(.*?)</script>', page,
                                re.S).group(1))


def _folder(tmp_path, name):
    hf = save_hf(name, tmp_path)
    t5 = name.startswith("T5")
    save_word_tokenizer(tmp_path, WORDS, template="$A </s>" if t5 else "<s> $A </s>",
                        specials=("<pad>", "</s>", "<unk>") if t5 else ("<s>", "<pad>", "</s>", "<unk>"))
    from tokenizers import Tokenizer

    return hf, attnlab.from_pretrained(tmp_path).eval(), Tokenizer.from_file(str(tmp_path / "tokenizer.json"))


@pytest.mark.parametrize("name", ["BartForConditionalGeneration", "T5ForConditionalGeneration",
                                  "T5ForSequenceClassification"])
@pytest.mark.parametrize("attention", ["encoder", "decoder", "cross"])
def test_weights_equal_transformers(tmp_path, name, attention):
    hf, ours, tok = _folder(tmp_path, name)
    data = _data(neuron_view(ours, None, tok, SRC, TGT, html_action="return", attention=attention, layer=1,
                             head=2).data)
    src = torch.tensor([tok.encode(SRC).ids])
    tgt = tok.encode(TGT).ids
    dec = torch.tensor([[hf.config.decoder_start_token_id, *tgt[:-1]]])
    body = hf.transformer if hasattr(hf, "transformer") else hf  # T5ForSequenceClassification: its T5Model
    with torch.no_grad():
        out = body(input_ids=src, decoder_input_ids=dec, output_attentions=True)
    want = torch.stack([a[0] for a in {"encoder": out.encoder_attentions, "decoder": out.decoder_attentions,
                                       "cross": out.cross_attentions}[attention]])
    w = torch.tensor(data["w"])
    assert w.shape == want.shape and float((w - want).abs().max()) <= 0.5e-4 + 1e-6  # the page rounds to 1e-4
    q, k, scores, mask = (torch.tensor(data[n]) for n in ("q", "k", "scores", "mask"))
    expect = q @ k.transpose(-1, -2) * data["scale"] + (torch.tensor(data["bias"]) if data["bias"] else 0)
    assert float((scores - expect.masked_fill(mask[:, None] == 0, 0)).abs().max()) < 1e-2
    assert (data["bias"] is not None) == (name.startswith("T5") and attention != "cross")
    start = "<pad>" if name.startswith("T5") else "</s>"  # decoder_start_token_id's token
    src_toks, dec_toks = tok.encode(SRC).tokens, [start, *tok.encode(TGT).tokens[:-1]]
    assert (data["tokens"], data["tokens_k"]) == {"encoder": (src_toks, src_toks), "decoder": (dec_toks, dec_toks),
                                                  "cross": (dec_toks, src_toks)}[attention]
    if attention == "decoder":
        assert w.triu(1).abs().max() == 0


def test_errors_say_what_to_give(tmp_path):
    _, ours, tok = _folder(tmp_path / "bart", "BartForConditionalGeneration")
    with pytest.raises(ValueError, match="attention='cross' needs sentence_b, the target the decoder reads"):
        neuron_view(ours, None, tok, SRC, attention="cross")
    with pytest.raises(ValueError, match=r"attention must be one of \['encoder', 'decoder', 'cross'\]"):
        neuron_view(ours, None, tok, SRC, TGT, attention="self")
    _, token_head, tok5 = _folder(tmp_path / "t5", "T5ForTokenClassification")
    assert _data(neuron_view(token_head, None, tok5, SRC, html_action="return").data)["tokens"][-1] == "</s>"
    with pytest.raises(ValueError, match="encoder alone: give sentence_a only"):
        neuron_view(token_head, None, tok5, SRC, TGT)
    from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel

    gpt = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=16, n_embd=32, n_layer=1, n_head=2)).eval()
    with pytest.raises(ValueError, match="attention='decoder' is for encoder-decoders"):
        neuron_view(gpt, None, tok, "the cat", attention="decoder")


def test_cross_attention_page_in_the_browser(tmp_path, open_file):
    _, ours, tok = _folder(tmp_path, "BartForConditionalGeneration")
    view = neuron_view(ours, None, tok, SRC, TGT, html_action="return", attention="cross", layer=1, head=2)
    data = _data(view.data)
    page = open_file(view.save(tmp_path / "neuron.html"))
    queries = page.eval_on_selector_all("#nv td.tok-q", "els => els.map(e => e.textContent)")
    keys = page.eval_on_selector_all("#nv td.tok-k", "els => els.map(e => e.textContent)")
    assert queries == data["tokens"] and keys == data["tokens_k"] and len(keys) > len(queries)
    page.hover("#nv td.tok-q[data-i='2']")
    w = page.eval_on_selector_all("#nv td.w", "els => els.map(e => +e.getAttribute('data-w'))")
    assert w == data["w"][1][2][2] and "Cross-attention: target queries over source keys" in page.content()
    assert page.problems == []


@pytest.mark.parametrize("position", ["sinusoidal", "rope"])
def test_seq2seq_transformer_weights_equal_its_forward(tmp_path, position):
    from tokenizers import Tokenizer

    from attnlab.models.config import TransformerConfig
    from attnlab.models.transformer import Seq2SeqTransformer

    save_word_tokenizer(tmp_path, WORDS, template="<s> $A </s>", specials=("<pad>", "<s>", "</s>", "<unk>"))
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    torch.manual_seed(0)
    model = Seq2SeqTransformer(TransformerConfig(src_vocab_size=12, dim=32, num_heads=4, ffn_dim=64,
                                                 num_encoder_layers=2, num_decoder_layers=2, max_positions=64,
                                                 position=position, pad_id=0)).eval()
    src, tgt = torch.tensor([tok.encode(SRC).ids]), torch.tensor([tok.encode(TGT).ids[:-1]])  # "<s> … " read
    with torch.no_grad():
        out = model(src, tgt, output_attentions=True)
    for attention, maps in (("encoder", out.encoder_attentions), ("decoder", out.decoder_attentions),
                            ("cross", out.cross_attentions)):
        data = _data(neuron_view(model, None, tok, SRC, TGT, html_action="return", attention=attention).data)
        assert float((torch.tensor(data["w"]) - torch.stack([a[0] for a in maps])).abs().max()) <= 0.5e-4 + 1e-6
    assert data["tokens"] == ["<s>", "the", "dog", "ran"] and data["tokens_k"] == tok.encode(SRC).tokens
