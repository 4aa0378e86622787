"""Attention weights of a real model on real text, as one :class:`AttentionRecord`.

::

    ids   = tokenizer.json(text [, text_b])                      (the model directory's tokenizer)
    A[l]  = softmax(Q_l K_lᵀ / √d + mask)   (B=1, H, Lq, Lk)     for every layer l
    record.attentions[kind] = stack_l A[l][0]   (layers, heads, Lq, Lk)

The weights come from each model's ``output_attentions=True`` forward, which recovers them from
q, k and the fast backend's row log-sum-exp; the model is never switched to a slow path.

Kinds: ``"encoder"`` (BERT, the CLIP text tower, the T5/BART encoder), ``"decoder"`` (causal
self-attention: GPT-2, Llama, the T5/BART decoder) and ``"cross"`` (decoder queries over encoder
keys). For encoder–decoder models the decoder reads what teacher forcing feeds it: ``tgt``'s ids
shifted right behind ``decoder_start_token_id`` (HF's ``labels`` -> ``decoder_input_ids``).
"""
from __future__ import annotations

import math
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch
from torch import Tensor, nn

from attnlab._limits import check_forward_memory

KINDS = ("encoder", "decoder", "cross")
PathLike = Union[str, os.PathLike]


@dataclass(frozen=True)
class AttentionRecord:
    """Attention maps of one input, per kind.

    Attributes:
        attentions: kind -> ``(layers, heads, Lq, Lk)`` float32 weights (each row sums to 1, or
            to 0 for a row that may attend to nothing).
        tokens_q: kind -> the ``Lq`` query token strings.
        tokens_k: kind -> the ``Lk`` key token strings.
        model_name: e.g. ``"BertModel"`` (shown in the page; may be empty).

    Raises:
        ValueError: an unknown kind, a tensor that is not 4-D or not finite, token lists whose
            lengths do not match the tensor, or a kind missing from one of the three dicts.
        TypeError: ``tokens_q``/``tokens_k`` not dicts, or a token that is not a ``str``.
    """

    attentions: dict[str, Tensor]
    tokens_q: dict[str, list[str]]
    tokens_k: dict[str, list[str]]
    model_name: str = ""
    kinds: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.attentions, dict) or not self.attentions:
            raise ValueError("attentions must be a non-empty dict {kind: (layers, heads, Lq, Lk) tensor}")
        for name in ("tokens_q", "tokens_k"):
            if not isinstance(getattr(self, name), dict):
                got = type(getattr(self, name)).__name__
                raise TypeError(f"{name} must be a dict {{kind: list of str}}, got {got}")
        for kind, w in self.attentions.items():
            if kind not in KINDS:
                raise ValueError(f"attentions kind must be one of {KINDS}, got {kind!r}")
            if not isinstance(w, Tensor) or w.dim() != 4 or 0 in w.shape:
                raise ValueError(f"attentions[{kind!r}] must be a non-empty (layers, heads, Lq, Lk) tensor, "
                                 f"got {tuple(getattr(w, 'shape', ())) or type(w).__name__}")
            if not bool(torch.isfinite(w).all()):
                raise ValueError(f"attentions[{kind!r}] holds NaN or inf")
            for name, toks, n in (("tokens_q", self.tokens_q, w.shape[2]), ("tokens_k", self.tokens_k, w.shape[3])):
                if kind not in toks or len(toks[kind]) != n:
                    got = len(toks[kind]) if kind in toks else "none"
                    raise ValueError(f"{name}[{kind!r}] must hold {n} tokens to match attentions, got {got}")
                bad = next((t for t in toks[kind] if not isinstance(t, str)), None)
                if bad is not None:
                    raise TypeError(f"{name}[{kind!r}] must hold str tokens, got {type(bad).__name__}")
        object.__setattr__(self, "kinds", tuple(k for k in KINDS if k in self.attentions))
        object.__setattr__(self, "attentions",
                           {k: v.detach().to("cpu", torch.float32) for k, v in self.attentions.items()})

    @property
    def num_layers(self) -> int:
        """The layers every kind has (a T5 encoder and decoder may differ in depth)."""
        return min(w.shape[0] for w in self.attentions.values())


def _model_kind(model) -> str:
    """``"bert"``, ``"causal"``, ``"seq2seq"`` or ``"clip"``: which forward to call."""
    from attnlab.models.bart import BartForConditionalGeneration
    from attnlab.models.bert import BertForMaskedLM, BertModel
    from attnlab.models.causal_lm import DecoderOnlyLM
    from attnlab.models.clip import CLIPModel
    from attnlab.models.t5 import T5ForConditionalGeneration
    from attnlab.models.transformer import Seq2SeqTransformer
    from attnlab.models.vit import ViTForImageClassification, ViTModel

    if isinstance(model, (BertModel, BertForMaskedLM)):
        return "bert"
    if isinstance(model, DecoderOnlyLM):
        return "causal"
    if isinstance(model, (T5ForConditionalGeneration, BartForConditionalGeneration, Seq2SeqTransformer)):
        return "seq2seq"
    if isinstance(model, CLIPModel):
        return "clip"
    if isinstance(model, (ViTModel, ViTForImageClassification)):
        raise ValueError("model is a ViT, which reads images: give a picture (attnlab viz --image FILE, "
                         "attnlab.viz.image_view); text views are for bert, gpt2, llama, t5, bart, the clip text tower")
    raise TypeError(f"model must be an attnlab BERT, GPT-2, Llama, T5, BART, CLIP or Seq2SeqTransformer model, got "
                    f"{type(model).__name__}")


def _as_tokenizer(tokenizer):
    """A ``tokenizers.Tokenizer`` becomes a :class:`TextTokenizer` (its padding and truncation off)."""
    from tokenizers import Tokenizer

    from attnlab.data.tokenizers import CharTokenizer, TextTokenizer

    if isinstance(tokenizer, Tokenizer):
        return TextTokenizer(tokenizer)
    if not isinstance(tokenizer, (TextTokenizer, CharTokenizer)):
        raise TypeError("tokenizer must be a tokenizers.Tokenizer, TextTokenizer or CharTokenizer, "
                        f"got {type(tokenizer).__name__}")
    return tokenizer


def _encode(tokenizer, text: str, name: str, pair: Optional[str] = None) -> tuple[list[int], list[str], list[int]]:
    """``(ids, token strings, token types)`` of ``text`` (and ``pair``), special tokens included."""
    from attnlab.data.tokenizers import CharTokenizer

    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str, got {type(text).__name__}")
    if pair is not None and not isinstance(pair, str):
        raise TypeError(f"text_b must be a str, got {type(pair).__name__}")
    if isinstance(tokenizer, CharTokenizer):
        if pair is not None:
            raise ValueError("text_b needs a tokenizer.json with a sentence-pair template, not a CharTokenizer")
        ids = tokenizer.encode(text)
        out = (ids, list(text), [0] * len(ids))
    else:
        enc = tokenizer.tokenizer.encode(text, pair, add_special_tokens=True)
        out = (list(enc.ids), list(enc.tokens), list(enc.type_ids))
    if not out[0]:
        raise ValueError(f"{name} gives no tokens: {text!r}")
    return out


def _token(tokenizer, i: int) -> str:
    from attnlab.data.tokenizers import CharTokenizer

    t = tokenizer.chars[i] if isinstance(tokenizer, CharTokenizer) else tokenizer.id_to_token(i)
    return t if t is not None else f"<{i}>"


@contextmanager
def _rejected(what: str, n_tokens, model_name: str):
    """Re-raise the model's input ValueError (e.g. too many positions) naming the user's text."""
    try:
        yield
    except ValueError as e:
        raise ValueError(f"{what} ({n_tokens} tokens) rejected by {model_name}: {e}") from e


def _stack(attns: Sequence[Tensor]) -> Tensor:
    return torch.stack([a[0].float().cpu() for a in attns])  # (layers, heads, Lq, Lk)


@torch.no_grad()
def extract_attention(model, tokenizer, *, text: Optional[str] = None, text_b: Optional[str] = None,
                      src: Optional[str] = None, tgt: Optional[str] = None) -> AttentionRecord:
    """Run ``model`` once on the text and return every layer's attention weights.

    Args:
        model: an attnlab model (e.g. from :func:`attnlab.from_pretrained`): BERT, GPT-2, Llama,
            T5, BART, or CLIP (its text tower).
        tokenizer: a ``tokenizers.Tokenizer``, or attnlab's ``TextTokenizer`` / ``CharTokenizer``
            (:func:`attnlab.data.tokenizers.load_tokenizer`); padding and truncation are not applied.
        text: the input of an encoder-only or decoder-only model.
        text_b: a second sentence (BERT sentence pair: token types 0 then 1).
        src, tgt: the source and target of an encoder–decoder model (T5, BART).

    Returns:
        An :class:`AttentionRecord`: ``encoder`` (BERT, CLIP), ``decoder`` (GPT-2, Llama) or all
        three kinds (T5, BART).

    Raises:
        ValueError: the texts do not fit the model (``text`` for an encoder–decoder, ``src``/``tgt``
            for another, ``text_b`` for a model without token types), a text gives no tokens, or
            the model rejects the input (e.g. longer than its positions), or the model is in
            training mode.
        TypeError: an unsupported model or tokenizer, or a text that is not a ``str``.
    """
    name = type(model).__name__
    if isinstance(getattr(model, "bert", None), nn.Module):  # a task head on BERT: its encoder's attention
        model = model.bert
    family = _model_kind(model)
    if family == "seq2seq" and not hasattr(model, "decoder"):  # T5ForTokenClassification: the encoder alone
        family = "encoder-only"
    if model.training:
        raise ValueError(f"{name} is in training mode (dropout would perturb the weights): call model.eval() first")
    if family == "seq2seq":
        if text is not None or text_b is not None:
            raise ValueError(f"{name} is an encoder-decoder: give src and tgt, not text/text_b")
        if src is None or tgt is None:
            raise ValueError(f"{name} is an encoder-decoder: both src and tgt are required")
        return _extract_seq2seq(model, tokenizer, src, tgt)
    if src is not None or tgt is not None:
        raise ValueError(f"src/tgt are for encoder-decoder models; {name} takes text")
    if text is None:
        raise ValueError("text is required")
    if text_b is not None and family != "bert":
        raise ValueError(f"text_b (a sentence pair with token types) needs a BERT model, not {name}")
    ids, toks, types = _encode(_as_tokenizer(tokenizer), text, "text", text_b)
    check_forward_memory(f"text ({len(ids)} tokens)", model.config, batch=1, seq=len(ids), maps=True,
                         device=_device(model))  # every layer's weights are kept
    with _rejected("text", len(ids), name):
        ids = torch.tensor([ids], device=_device(model))  # (1, L)
        if family == "bert":
            out = model(ids, token_type_ids=torch.tensor([types], device=_device(model)), output_attentions=True)
            kind = "encoder"
        elif family == "causal":
            out = model(ids, output_attentions=True)
            kind = "decoder"
        elif family == "encoder-only":
            attentions, kind = model._encode(ids, None, True)[1], "encoder"
        else:  # CLIP: the text tower (causal mask, pooled at EOS)
            out = model.text_model(ids, output_attentions=True)
            kind = "encoder"
        if family != "encoder-only":
            attentions = out.attentions
    return AttentionRecord({kind: _stack(attentions)}, {kind: toks}, {kind: list(toks)}, name)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def seq2seq_tokens(model, tokenizer, src: str, tgt: str, names: tuple[str, str] = ("src", "tgt")):
    """``(src ids, src tokens, decoder ids, decoder tokens)`` of an encoder–decoder: the decoder reads ``tgt``
    teacher-forced, shifted right behind ``decoder_start_token_id`` (a Seq2SeqTransformer's ``<s> … </s>``
    target: all but its last token); ``names`` are the arguments named in errors."""
    (src_ids, src_toks, _), (tgt_ids, tgt_toks, _) = _encode(tokenizer, src, names[0]), _encode(tokenizer, tgt,
                                                                                               names[1])
    start = getattr(model.config, "decoder_start_token_id", None)
    if start is None:  # attnlab's Seq2SeqTransformer: the tokenizer's "<s> ... </s>" already starts the target
        if len(tgt_ids) < 2:
            raise ValueError(f"{names[1]} gives {len(tgt_ids)} token(s); the decoder reads all but the last: give "
                             "at least 2")
        return src_ids, src_toks, tgt_ids[:-1], tgt_toks[:-1]
    return src_ids, src_toks, [int(start), *tgt_ids[:-1]], [_token(tokenizer, int(start)), *tgt_toks[:-1]]


def _extract_seq2seq(model, tokenizer, src: str, tgt: str) -> AttentionRecord:
    tokenizer = _as_tokenizer(tokenizer)
    src_ids, src_toks, dec_ids, dec_toks = seq2seq_tokens(model, tokenizer, src, tgt)
    start = getattr(model.config, "decoder_start_token_id", None)
    src_t, dec_t = torch.tensor([src_ids], device=_device(model)), torch.tensor([dec_ids], device=_device(model))
    check_forward_memory(f"src/tgt ({len(src_ids)}/{len(dec_ids)} tokens)", model.config, batch=1,
                         seq=max(len(src_ids), len(dec_ids)), maps=True, device=_device(model))
    with _rejected("src/tgt", f"{len(src_ids)}/{len(dec_ids)}", type(model).__name__):
        if start is None:
            out = model(src_t, dec_t, output_attentions=True)
        elif hasattr(model.config, "num_labels"):
            # a T5 / BART task head: its forward returns the head's logits; the weights come from the body's stacks
            from attnlab.models.outputs import Seq2SeqLMOutput

            memory, enc_w = model._encode(src_t, None, True)
            _, dec_w, cross_w = model._decoder_states(dec_t, memory, None, None, None, True)
            out = Seq2SeqLMOutput(None, memory, encoder_attentions=enc_w, decoder_attentions=dec_w,
                                  cross_attentions=cross_w)
        else:
            out = model(input_ids=src_t, decoder_input_ids=dec_t, output_attentions=True)
    return AttentionRecord(
        {"encoder": _stack(out.encoder_attentions), "decoder": _stack(out.decoder_attentions),
         "cross": _stack(out.cross_attentions)},
        {"encoder": src_toks, "decoder": dec_toks, "cross": list(dec_toks)},
        {"encoder": list(src_toks), "decoder": list(dec_toks), "cross": list(src_toks)},
        type(model).__name__)


def extract_from_path(path: PathLike, *, tokenizer: Optional[PathLike] = None, dtype: torch.dtype = torch.float32,
                      device="cpu", **texts) -> AttentionRecord:
    """Load an HF-format model directory or Hub id (``attnlab.from_pretrained`` in ``dtype`` on ``device``; e.g. one
    written by ``save_pretrained``) and its tokenizer (``tokenizer``, default ``path/tokenizer.json``: a Hugging
    Face file or a saved ``CharTokenizer``), then call :func:`extract_attention` with ``texts``.

    Raises:
        FileNotFoundError: the directory (or Hub id), its weights or the tokenizer are missing.
        ValueError: as :func:`extract_attention` and :func:`attnlab.from_pretrained`.
    """
    from attnlab.data.tokenizers import load_tokenizer
    from attnlab.models.hub import from_pretrained, resolve_pretrained

    path = resolve_pretrained(path)  # a folder, or a Hub id's snapshot in huggingface_hub's cache
    model = from_pretrained(path, dtype=dtype).to(device)
    tok = load_tokenizer(tokenizer if tokenizer is not None else path)
    return extract_attention(model, tok, **texts)


def pool_attention(w: Tensor, max_size: int) -> tuple[Tensor, list[range], list[range]]:
    """Shrink ``w (..., Lq, Lk)`` to at most ``max_size`` rows and columns.

    Row group ``I`` and column group ``J`` (consecutive tokens) become
    ``P[I, J] = mean_{i∈I} Σ_{j∈J} w[i, j]``: the mean attention mass a query of ``I`` puts on
    ``J``, so pooled rows still sum to 1.

    Returns:
        ``(P, row_groups, col_groups)``; ``P is w`` when no pooling is needed.

    Raises:
        ValueError: ``max_size`` < 1.
    """
    if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
        raise ValueError(f"max_size must be an int >= 1, got {max_size!r}")
    Lq, Lk = w.shape[-2:]
    rows, cols = _groups(Lq, max_size), _groups(Lk, max_size)
    if len(rows) == Lq and len(cols) == Lk:
        return w, rows, cols
    row_idx = torch.tensor([g for g, r in enumerate(rows) for _ in r])
    col_idx = torch.tensor([g for g, c in enumerate(cols) for _ in c])
    p = w.new_zeros(*w.shape[:-1], len(cols)).index_add_(-1, col_idx, w)  # (..., Lq, nk)
    p = p.new_zeros(*w.shape[:-2], len(rows), len(cols)).index_add_(-2, row_idx, p)  # (..., nq, nk)
    sizes = torch.tensor([len(r) for r in rows], dtype=w.dtype).unsqueeze(-1)  # (nq, 1)
    return p / sizes, rows, cols


def _groups(n: int, max_size: int) -> list[range]:
    step = math.ceil(n / max_size)
    return [range(i, min(i + step, n)) for i in range(0, n, step)]


def group_labels(tokens: Sequence[str], groups: Sequence[range]) -> list[str]:
    """``tokens[i]`` for single-token groups; ``"i–j"`` (first–last index) for pooled ones."""
    return [tokens[g.start] if len(g) == 1 else f"{g.start}\u2013{g.stop - 1}" for g in groups]
