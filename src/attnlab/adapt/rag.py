"""Retrieval-augmented generation (Lewis et al. 2020), small and exact.

1. **Embed** every passage with a BERT encoder (all-MiniLM-L6-v2 through :func:`attnlab.from_pretrained`)
   as sentence-transformers does: ``e = h̄ / ‖h̄‖`` with ``h̄ = Σ_i m_i h_i / Σ_i m_i`` the mean of
   the last hidden states over the real tokens (mask ``m``).
2. **Retrieve** the top-k passages by cosine similarity ``cos(q, p) = e_qᵀ e_p``.
3. **Generate**: the decoder continues ``"Context: [1] p₁ … [k] p_k  Question: q  Answer:"``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab._checks import is_int, positive_int
from attnlab.data.batching import pad_batch


def mean_pool(hidden: Tensor, mask: Tensor) -> Tensor:
    """``Σ_i m_i h_i / max(Σ_i m_i, 1e-9)``: ``hidden (B, L, E)``, ``mask (B, L)`` -> ``(B, E)``."""
    m = mask.unsqueeze(-1).to(hidden.dtype)  # (B, L, 1)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)


class SentenceEncoder:
    """Unit-length sentence embeddings from a BERT encoder: ``normalize(mean_pool(BERT(x)))``.

    Args:
        model: a :class:`~attnlab.models.bert.BertModel` (its ``last_hidden_state`` is pooled).
        tokenizer: a :class:`~attnlab.data.tokenizers.TextTokenizer` with ``[CLS] … [SEP]`` special tokens.
        max_length: tokens kept per text (sentence-transformers' all-MiniLM-L6-v2 uses 256).
        batch_size: texts per forward pass.
    """

    def __init__(self, model: nn.Module, tokenizer, *, max_length: int = 256, batch_size: int = 64) -> None:
        for name, v in (("max_length", max_length), ("batch_size", batch_size)):
            positive_int(name, v)
        if tokenizer.pad_id is None:
            raise ValueError("tokenizer has no padding token ([PAD] or <pad>)")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.max_length = min(max_length, model.config.max_position_embeddings)
        self.batch_size = batch_size

    @classmethod
    def from_pretrained(cls, path, *, dtype=None, device="cpu", **kwargs) -> "SentenceEncoder":
        """Load an HF-format BERT directory holding ``tokenizer.json`` (e.g. all-MiniLM-L6-v2's), or a Hub id
        (:func:`attnlab.models.hub.resolve_pretrained`), in ``dtype`` (default: the checkpoint's) on ``device``."""
        from attnlab.data.tokenizers import TextTokenizer, load_tokenizer
        from attnlab.models.hub import from_pretrained, resolve_pretrained

        path = resolve_pretrained(path)
        model = from_pretrained(path, dtype=dtype).to(device)
        if not hasattr(model, "embeddings") or not hasattr(model, "pooler"):
            raise ValueError(f"{str(path)!r} holds a {type(model).__name__}; a BERT encoder (BertModel) is needed")
        tokenizer = load_tokenizer(path)
        if not isinstance(tokenizer, TextTokenizer):
            raise ValueError(f"{str(path)!r} must hold a subword tokenizer.json, not a character tokenizer")
        return cls(model, tokenizer, **kwargs)

    def _ids(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=True)
        if len(ids) > self.max_length:  # truncate, keeping the final [SEP]
            ids = ids[:self.max_length - 1] + ids[-1:]
        return ids

    @torch.inference_mode()
    def encode(self, texts: Union[str, Sequence[str]]) -> Tensor:
        """``(N, E)`` unit vectors for ``N`` texts (batched by length to pad little; order kept).

        Raises:
            TypeError: a text is not a str.
        """
        texts = [texts] if isinstance(texts, str) else list(texts)
        bad = next((t for t in texts if not isinstance(t, str)), None)
        if bad is not None:
            raise TypeError(f"texts must be strings, got {type(bad).__name__}")
        seqs = [self._ids(t) for t in texts]
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        out = torch.empty(len(seqs), self.model.config.hidden_size)
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            ids = pad_batch([seqs[i] for i in idx], self.tokenizer.pad_id)  # (B, L)
            lengths = torch.tensor([len(seqs[i]) for i in idx])
            mask = (torch.arange(ids.shape[1]) < lengths[:, None]).long()  # (B, L)
            device = next(self.model.parameters()).device
            ids, mask = ids.to(device), mask.to(device)
            h = self.model(ids, mask).last_hidden_state  # (B, L, E)
            out[idx] = F.normalize(mean_pool(h, mask), dim=-1).float().cpu()
        return out


@dataclass
class Hit:
    """A retrieved passage: its index in the corpus, cosine score and text."""

    index: int
    score: float
    text: str


class Retriever:
    """Dense retrieval over a fixed corpus: ``top-k_p cos(e_q, e_p)``.

    Args:
        encoder: a :class:`SentenceEncoder`.
        passages: the corpus (non-empty strings); embedded once, here.

    Raises:
        ValueError: an empty corpus or an empty passage.
    """

    def __init__(self, encoder: SentenceEncoder, passages: Sequence[str]) -> None:
        passages = list(passages)
        if not passages:
            raise ValueError("passages must not be empty")
        empty = next((i for i, p in enumerate(passages) if not isinstance(p, str) or not p.strip()), None)
        if empty is not None:
            raise ValueError(f"passage {empty} is empty or not a string")
        self.encoder, self.passages = encoder, passages
        self.embeddings = encoder.encode(passages)  # (N, E), unit rows

    def scores(self, queries: Union[str, Sequence[str]]) -> Tensor:
        """Cosine similarities ``(Q, N)`` of the queries to every passage."""
        return self.encoder.encode(queries) @ self.embeddings.T

    def search(self, queries: Union[str, Sequence[str]], *, k: int = 3) -> list[list[Hit]]:
        """The ``k`` most similar passages of each query, best first.

        Raises:
            ValueError: ``k`` is not in ``[1, len(passages)]``.
        """
        n = len(self.passages)
        if not (is_int(k) and 1 <= k <= n):
            raise ValueError(f"k must be an int in [1, {n}] (the corpus size), got {k!r}")
        top = self.scores(queries).topk(k, dim=-1)
        return [[Hit(int(i), float(s), self.passages[int(i)]) for s, i in zip(vals, idx)]
                for vals, idx in zip(top.values, top.indices)]


def build_prompt(query: str, hits: Sequence[Hit]) -> str:
    """``"Context:\\n[1] p₁\\n…\\n\\nQuestion: q\\nAnswer:"``."""
    context = "\n".join(f"[{i}] {h.text}" for i, h in enumerate(hits, 1))
    return f"Context:\n{context}\n\nQuestion: {query}\nAnswer:"


@dataclass
class RAGOutput:
    """What :func:`rag_generate` returns: the prompt fed to the decoder, the hits and the generated answer."""

    prompt: str
    hits: list[Hit]
    answer: str
    prompt_ids: list[int]


def rag_generate(retriever: Retriever, model: nn.Module, tokenizer, query: str, *, k: int = 3,
                 max_new_tokens: int = 32, **generate_kwargs) -> RAGOutput:
    """Retrieve ``k`` passages for ``query`` and let a decoder-only ``model`` continue the RAG prompt.

    Args:
        retriever: the corpus index.
        model: a decoder with ``generate`` (e.g. :class:`~attnlab.models.gpt.GPT2LMHeadModel`).
        tokenizer: the decoder's tokenizer (``encode(str) -> list[int]``, ``decode(ids) -> str``).
        generate_kwargs: passed to :func:`attnlab.generation.generate` (``do_sample``, ``top_p``, ...).

    Raises:
        ValueError: the prompt does not fit the model's positions together with ``max_new_tokens``
            (the message gives both numbers), or as :meth:`Retriever.search`.
    """
    hits = retriever.search(query, k=k)[0]
    prompt = build_prompt(query, hits)
    ids = list(tokenizer.encode(prompt))
    limit = getattr(model, "max_positions", None)
    if limit is not None and len(ids) + max_new_tokens > limit:
        raise ValueError(f"the RAG prompt has {len(ids)} tokens; with max_new_tokens={max_new_tokens} it exceeds "
                         f"the model's {limit} positions (use a smaller k or shorter passages)")
    model.eval()
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, **generate_kwargs)
    return RAGOutput(prompt, hits, tokenizer.decode(out[0, len(ids):].tolist()), ids)
