"""Tokenizers with one small protocol: ``encode``, ``decode``, ``vocab_size``, ``save``, ``load``.

- :class:`CharTokenizer` — one id per character, ids in sorted character order (nanoGPT's
  ``shakespeare_char``: 65 ids for tiny-shakespeare).
- :class:`TextTokenizer` — a ``tokenizers.Tokenizer`` (``tokenizer.json``): :func:`train_bpe`
  (byte-level BPE, lossless: ``decode(encode(s)) == s``), :func:`train_wordpiece` (BERT-style) or any
  ``tokenizer.json`` through :func:`load_tokenizer` (e.g. all-MiniLM-L6-v2's).

``encode`` returns the bare token ids by default; ``add_special_tokens=True`` applies the tokenizer's
template (``<s> … </s>`` for :func:`train_bpe`, ``[CLS] … [SEP]`` for :func:`train_wordpiece` and BERT).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Optional, Union

import torch
from torch import Tensor

from attnlab._checks import is_int, positive_int
from attnlab._io import atomic_write, check_input_file, read_input_json

__all__ = ["CharTokenizer", "TextTokenizer", "train_bpe", "train_wordpiece", "load_tokenizer"]

PathLike = Union[str, os.PathLike]


def _ids_list(ids, vocab_size: int) -> list[int]:
    """Accept a list/tuple of ints or a 1-D integer tensor/array, each in ``[0, vocab_size)``."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)) or any(isinstance(i, (list, tuple)) for i in ids):
        raise TypeError(f"ids must be a flat sequence of ints, got {type(ids).__name__}")
    odd = next((i for i in ids if not is_int(i)), None)
    if odd is not None:  # 1.5 would be truncated to 1, True read as 1
        raise TypeError(f"ids must be ints, got {odd!r}")
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"id {bad[0]} is outside [0, {vocab_size})")
    return ids


class CharTokenizer:
    """Character-level tokenizer: ``id(c) = rank of c among the sorted distinct characters``.

    Args:
        chars: the vocabulary, distinct characters (one-character strings) in id order.

    Raises:
        ValueError: empty vocabulary, a repeated character, or an entry that is not one character.
    """

    kind = "char"

    def __init__(self, chars: Iterable[str]):
        chars = list(chars)
        if not chars:
            raise ValueError("chars must not be empty")
        bad = [c for c in chars if not isinstance(c, str) or len(c) != 1]
        if bad:
            raise ValueError(f"chars must be one-character strings, got {bad[0]!r}")
        if len(set(chars)) != len(chars):
            raise ValueError("chars must be distinct")
        self.chars: list[str] = chars
        self._stoi = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        """The tokenizer of ``sorted(set(text))``. Raises ValueError on empty text, TypeError on non-str."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if not text:
            raise ValueError("text must not be empty")
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """``[id(c) for c in text]``. Raises ValueError naming a character outside the vocabulary."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        try:
            return [self._stoi[c] for c in text]
        except KeyError as e:
            c = e.args[0]
            raise ValueError(f"character {c!r} (position {text.index(c)}) is not in the vocabulary of "
                             f"{self.vocab_size} characters") from None

    def encode_tensor(self, text: str, dtype: torch.dtype = torch.long) -> Tensor:
        """:meth:`encode` as a 1-D tensor of ``dtype``, by one table lookup over the code points (tiny-shakespeare's
        1.1 M characters: ~0.02 s against ~0.2 s for the list and its conversion). Raises as :meth:`encode`."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if not isinstance(dtype, torch.dtype) or dtype.is_floating_point or dtype.is_complex or \
                dtype == torch.bool or self.vocab_size - 1 > torch.iinfo(dtype).max:
            raise ValueError(f"dtype must be an integer type holding ids up to {self.vocab_size - 1}, got {dtype}")
        if not text:
            return torch.empty(0, dtype=dtype)
        codes = torch.frombuffer(bytearray(text.encode("utf-32-le", "surrogatepass")), dtype=torch.int32).long()
        table = torch.full((max(ord(c) for c in self.chars) + 1,), -1, dtype=torch.long)
        table[torch.tensor([ord(c) for c in self.chars])] = torch.arange(self.vocab_size)
        ids = table[codes.clamp(max=table.numel() - 1)]
        if bool(((codes >= table.numel()) | (ids < 0)).any()):
            self.encode(text)  # raises, naming the first character outside the vocabulary
        return ids.to(dtype)

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def token_to_id(self, token: str) -> Optional[int]:
        """The id of a one-character token, or ``None`` if it is not in the vocabulary."""
        return self._stoi.get(token)

    def decode(self, ids) -> str:
        """``"".join(chars[i] for i in ids)``; ids may be a list or a 1-D tensor.

        Raises:
            ValueError: an id outside ``[0, vocab_size)``.
        """
        ids = _ids_list(ids, self.vocab_size)
        return "".join(self.chars[i] for i in ids)

    def save(self, path: PathLike) -> None:
        """Write ``{"type": "char", "chars": [...]}`` as JSON (atomically)."""
        text = json.dumps({"type": self.kind, "chars": self.chars}, ensure_ascii=False) + "\n"
        atomic_write(Path(path), lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))

    @classmethod
    def load(cls, path: PathLike) -> "CharTokenizer":
        """Read a file written by :meth:`save`.

        Raises:
            FileNotFoundError: no file at ``path``.
            ValueError: the file is not a saved CharTokenizer.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer file at {path}")
        data = read_input_json("", path, "tokenizer")
        if not isinstance(data, dict) or data.get("type") != cls.kind or not isinstance(data.get("chars"), list):
            raise ValueError(f"{path} is not a saved CharTokenizer (expected {{'type': 'char', 'chars': [...]}})")
        try:
            return cls(data["chars"])
        except ValueError as e:
            raise ValueError(f"{path} is not a saved CharTokenizer: {e}") from None

    def __eq__(self, other) -> bool:
        return isinstance(other, CharTokenizer) and self.chars == other.chars

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


# Conventional names of the special tokens, looked up in this order.
_ROLES = {
    "pad": ("<pad>", "[PAD]"), "bos": ("<s>", "<bos>", "[BOS]"), "eos": ("</s>", "<eos>", "[EOS]"),
    "unk": ("<unk>", "[UNK]"), "mask": ("<mask>", "[MASK]"), "cls": ("[CLS]", "<cls>"), "sep": ("[SEP]", "<sep>"),
}


class TextTokenizer:
    """A subword tokenizer: a thin wrapper of ``tokenizers.Tokenizer`` with :class:`CharTokenizer`'s protocol.

    Special-token ids (``pad_id``, ``bos_id``, ``eos_id``, ``unk_id``, ``mask_id``, ``cls_id``, ``sep_id``)
    are found by their conventional names (``<pad>``/``[PAD]``, ``<s>``, ``</s>``, ``<unk>``/``[UNK]``,
    ``<mask>``/``[MASK]``, ``[CLS]``, ``[SEP]``) and are ``None`` where the vocabulary has none.
    Fixed-length padding and truncation stored in a ``tokenizer.json`` (all-MiniLM-L6-v2 pads to 128)
    are switched off on a copy: ``encode`` maps text to ids, batching pads (:func:`~attnlab.data.batching.pad_batch`).

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
    """

    def __init__(self, tokenizer):
        from tokenizers import Tokenizer

        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"tokenizer must be a tokenizers.Tokenizer, got {type(tokenizer).__name__}")
        if tokenizer.padding is not None or tokenizer.truncation is not None:
            tokenizer = Tokenizer.from_str(tokenizer.to_str())
            tokenizer.no_padding()
            tokenizer.no_truncation()
        self.tokenizer = tokenizer
        self._special = {role: next((i for n in names if (i := tokenizer.token_to_id(n)) is not None), None)
                         for role, names in _ROLES.items()}

    pad_id = property(lambda self: self._special["pad"], doc="id of ``<pad>``/``[PAD]`` or None")
    bos_id = property(lambda self: self._special["bos"], doc="id of ``<s>`` or None")
    eos_id = property(lambda self: self._special["eos"], doc="id of ``</s>`` or None")
    unk_id = property(lambda self: self._special["unk"], doc="id of ``<unk>``/``[UNK]`` or None")
    mask_id = property(lambda self: self._special["mask"], doc="id of ``<mask>``/``[MASK]`` or None")
    cls_id = property(lambda self: self._special["cls"], doc="id of ``[CLS]`` or None")
    sep_id = property(lambda self: self._special["sep"], doc="id of ``[SEP]`` or None")

    @property
    def vocab_size(self) -> int:
        """Number of ids, added (special) tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> Optional[int]:
        """The id of ``token``, or ``None`` if it is not in the vocabulary."""
        return self.tokenizer.token_to_id(token)

    def id_to_token(self, i: int) -> Optional[str]:
        return self.tokenizer.id_to_token(int(i))

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the tokenizer's template (e.g. ``<s> … </s>``)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Iterable[str], *, add_special_tokens: bool = False) -> list[list[int]]:
        """:meth:`encode` of each text (in parallel, in the Rust library)."""
        texts = list(texts)
        bad = next((t for t in texts if not isinstance(t, str)), None)
        if bad is not None:
            raise TypeError(f"texts must be strings, got {type(bad).__name__}")
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (a list or a 1-D tensor), special tokens dropped by default.

        Raises:
            ValueError: an id outside ``[0, vocab_size)``.
        """
        ids = _ids_list(ids, self.vocab_size)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch, *, skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in batch]

    def save(self, path: PathLike) -> None:
        """Write ``tokenizer.json`` (Hugging Face format) atomically."""
        text = self.tokenizer.to_str()
        atomic_write(Path(path), lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))

    @classmethod
    def load(cls, path: PathLike) -> "TextTokenizer":
        """Read a ``tokenizer.json`` (or a folder holding one). Raises FileNotFoundError / ValueError."""
        from tokenizers import Tokenizer

        path = check_input_file("", _tokenizer_file(path), "tokenizer")
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as e:  # the Rust library raises a bare Exception on bad JSON
            raise ValueError(f"{path} is not a tokenizer.json: {e}") from None

    def __repr__(self) -> str:
        model = type(self.tokenizer.model).__name__
        return f"TextTokenizer({model}, vocab_size={self.vocab_size})"


def _tokenizer_file(path: PathLike) -> Path:
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"no tokenizer file at {path}")
    return path


def _check_training(texts, vocab_size: int, special_tokens) -> tuple[Iterable[str], list[str]]:
    if isinstance(texts, str):
        raise TypeError("texts must be an iterable of strings, not one string")
    positive_int("vocab_size", vocab_size)
    special_tokens = list(special_tokens)
    if len(set(special_tokens)) != len(special_tokens) or not all(isinstance(t, str) and t for t in special_tokens):
        raise ValueError(f"special_tokens must be distinct non-empty strings, got {special_tokens}")
    return texts, special_tokens


def _template(tok, first: str, last: str, specials: list[str]) -> None:
    """``first $A last`` (pair: ``first $A last $B:1 last:1``) when both tokens exist."""
    from tokenizers import processors

    if first in specials and last in specials:
        ids = [(t, tok.token_to_id(t)) for t in (first, last)]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{first} $A {last}", pair=f"{first} $A {last} $B:1 {last}:1", special_tokens=ids)


def train_bpe(texts: Iterable[str], *, vocab_size: int, special_tokens=("<pad>", "<s>", "</s>", "<unk>"),
              lowercase: bool = False, min_frequency: int = 2) -> TextTokenizer:
    """Train a byte-level BPE tokenizer (GPT-2's scheme) with the ``tokenizers`` library.

    Byte-level: every string is encodable (no unknown tokens) and decoding is lossless,
    ``decode(encode(s)) == s`` (after lower-casing if ``lowercase``), so model outputs detokenise
    exactly for sacreBLEU. Special tokens take the first ids in the given order; with ``<s>`` and ``</s>``
    present, ``encode(s, add_special_tokens=True)`` is ``<s> s </s>``.

    Args:
        texts: training sentences (any iterable, read once).
        vocab_size: size of the vocabulary, special tokens and the 256 byte symbols included.
        special_tokens: added first, in order.
        lowercase: lower-case the text before tokenising.
        min_frequency: a pair must occur this often to be merged.

    Raises:
        ValueError: ``vocab_size`` smaller than the specials + 256 bytes, or bad special tokens.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    texts, specials = _check_training(texts, vocab_size, special_tokens)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(specials) + len(alphabet):
        raise ValueError(f"vocab_size must be >= {len(specials) + len(alphabet)} (the special tokens and 256 "
                         f"byte symbols), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    if lowercase:
        tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials,
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(texts, trainer)
    _template(tok, "<s>", "</s>", specials)
    return TextTokenizer(tok)


def train_wordpiece(texts: Iterable[str], *, vocab_size: int,
                    special_tokens=("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"), lowercase: bool = False,
                    min_frequency: int = 2) -> TextTokenizer:
    """Train a BERT-style WordPiece tokenizer (``##`` continuation pieces) with the ``tokenizers`` library.

    Text is normalised as BERT's (``BertNormalizer``: cleanup, CJK spacing, optional lower-casing and
    accent stripping) and split on whitespace and punctuation; unknown characters become ``[UNK]``.
    ``encode(s, add_special_tokens=True)`` is ``[CLS] s [SEP]``. Decoding joins ``##`` pieces but, as in
    BERT, does not restore the original spacing around punctuation.

    Raises:
        ValueError: ``special_tokens`` lacks ``[UNK]``, or bad ``vocab_size``.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    texts, specials = _check_training(texts, vocab_size, special_tokens)
    if "[UNK]" not in specials:
        raise ValueError(f"special_tokens must contain '[UNK]', got {specials}")
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                        special_tokens=specials, show_progress=False)
    tok.train_from_iterator(texts, trainer)
    _template(tok, "[CLS]", "[SEP]", specials)
    return TextTokenizer(tok)


def load_tokenizer(path: PathLike) -> Union[CharTokenizer, TextTokenizer]:
    """Load any tokenizer file attnlab writes or reads: a saved :class:`CharTokenizer`, or a Hugging Face
    ``tokenizer.json`` (a file, or a model folder holding one, e.g. all-MiniLM-L6-v2's).

    Raises:
        FileNotFoundError: no such file (or no ``tokenizer.json`` in the folder).
        ValueError: the file is neither.
    """
    path = _tokenizer_file(path)
    head = read_input_json("", path, "tokenizer")
    if isinstance(head, dict) and head.get("type") == CharTokenizer.kind:
        return CharTokenizer.load(path)
    return TextTokenizer.load(path)

