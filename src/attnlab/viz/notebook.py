"""Attention views inside a notebook, for any model: ``head_view`` and ``model_view`` as in bertviz.

::

    out = model(ids, output_attentions=True)           # transformers, attnlab, or your own code
    head_view(out.attentions, tokens)                   # shows inline in Jupyter / VS Code / Colab
    model_view(out.attentions, tokens).save("view.html")

``attentions`` is bertviz's argument: a tuple with one ``(batch, heads, q, k)`` tensor of softmax
weights per layer (``A[l][b, h, i, j]``: how much query token ``i`` attends to key token ``j``).
Encoder–decoder models give three such tuples instead: ``encoder_attentions`` (over
``encoder_tokens``), ``decoder_attentions`` (over ``decoder_tokens``) and ``cross_attentions``
(decoder queries over encoder keys). bertviz's singular spellings (``attention``,
``encoder_attention``, ...) are accepted too, so a notebook switches by changing one import.

The returned :class:`AttentionView` is the page ``attnlab viz`` writes (one renderer,
:func:`attnlab.viz.html.render_views`): weights embedded as integers ``round(w·SCALE)``
(``SCALE = 10,000``, so ``|w_page - w| <= 0.5e-4``), head-view lines thinned as documented in
:mod:`attnlab.viz.html` (pass ``min_weight=0.0`` for every line). Inline it lives in an
``<iframe srcdoc=... sandbox="allow-scripts">``: the page keeps its own Content-Security-Policy, runs
in an opaque origin, and fetches nothing (no CDN).
"""
from __future__ import annotations

import html
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import Tensor

from attnlab.viz.html import KIND_LABELS, View, _indices, render_views, write_page

# bertviz's argument names -> ours
BERTVIZ_NAMES = {"attention": "attentions", "encoder_attention": "encoder_attentions",
                 "decoder_attention": "decoder_attentions", "cross_attention": "cross_attentions"}
# render_views' options a view passes on; bertviz arguments we do not take are named in the error
PAGE_OPTIONS = ("top_k", "min_weight", "max_tokens", "max_lines", "max_map", "max_layers", "max_heads")
SPLIT_LABELS = (("all", "All"), ("aa", "Sentence A \u2192 Sentence A"), ("bb", "Sentence B \u2192 Sentence B"),
                ("ab", "Sentence A \u2192 Sentence B"), ("ba", "Sentence B \u2192 Sentence A"))


class AttentionView:
    """A rendered attention page: shown inline by Jupyter, VS Code and Colab (``_repr_html_``), written
    to a file by :meth:`save`.

    Attributes:
        html: the whole self-contained page (``<!DOCTYPE html>`` ...), as ``attnlab viz`` writes it.
        height: the inline frame's height in CSS pixels (the page scrolls inside it).
    """

    def __init__(self, page: str, *, height: int = 600):
        if not isinstance(page, str):
            raise TypeError(f"page must be a str, got {type(page).__name__}")
        self.html, self.height = page, int(height)

    def _repr_html_(self) -> str:
        """``<iframe srcdoc="page" sandbox="allow-scripts">``: the page, escaped once as an attribute."""
        return (f'<iframe srcdoc="{html.escape(self.html, quote=True)}" sandbox="allow-scripts" '
                f'referrerpolicy="no-referrer" title="attnlab attention view" '
                f'style="width: 100%; height: {self.height}px; border: 1px solid #ddd;"></iframe>')

    def save(self, path) -> Path:
        """Write the page to ``path`` (atomically); returns the path.

        Raises:
            FileNotFoundError: the parent directory of ``path`` does not exist.
        """
        return write_page(self.html, path)

    def __repr__(self) -> str:
        return f"<AttentionView: {len(self.html):,} characters of HTML; .save(path) writes it>"


def head_view(attentions=None, tokens=None, *, layer: Optional[int] = None, heads: Optional[Sequence[int]] = None,
              sentence_b_start: Optional[int] = None, encoder_attentions=None, decoder_attentions=None,
              cross_attentions=None, encoder_tokens=None, decoder_tokens=None, batch_index: int = 0,
              title: str = "attnlab head view", **options) -> AttentionView:
    """bertviz's head view: per layer, a line from query token ``i`` to key token ``j`` in head ``h``'s
    colour with opacity ``A[l][batch_index, h, i, j]``.

    Args:
        attentions: tuple of per-layer ``(batch, heads, L, L)`` tensors (``outputs.attentions``).
        tokens: the ``L`` token strings (e.g. ``tokenizer.convert_ids_to_tokens(ids)``); shown as text.
        layer: the layer shown first (default 0).
        heads: the heads drawn first (default all; the others are a click away).
        sentence_b_start: index of sentence B's first token: the page adds the four blocks
            A→A, B→B, A→B and B→A (the weights as given, not renormalised) beside "All".
        encoder_attentions, decoder_attentions, cross_attentions, encoder_tokens, decoder_tokens:
            an encoder–decoder model's maps instead of ``attentions`` (any of the three).
        batch_index: which example of the batch to show.
        title: the page title.
        **options: bertviz's singular names (``attention=``, ...), or the page's thinning options
            (``min_weight``, ``top_k``, ``max_tokens``, ...; see :func:`attnlab.viz.html.render_views`).

    Raises:
        TypeError: an attention that is not a tuple/list of ``torch.Tensor``, tokens that are not strings.
        ValueError: layers of different shapes, tokens of the wrong length, weights outside ``[0, 1]``,
            a bad ``layer``/``heads``/``sentence_b_start``/``batch_index``.
    """
    views, name = _views(attentions, tokens, sentence_b_start, encoder_attentions, decoder_attentions,
                         cross_attentions, encoder_tokens, decoder_tokens, batch_index, options)
    page = render_views(views, model_name=name, layer=layer, heads=heads, tab="head", title=title, **options)
    n = max(len(v.tokens_q) for v in views)
    return AttentionView(page, height=min(1000, 260 + 20 * min(n, options.get("max_tokens", 256))))


def model_view(attentions=None, tokens=None, *, include_layers: Optional[Sequence[int]] = None,
               include_heads: Optional[Sequence[int]] = None, sentence_b_start: Optional[int] = None,
               encoder_attentions=None, decoder_attentions=None, cross_attentions=None, encoder_tokens=None,
               decoder_tokens=None, batch_index: int = 0, title: str = "attnlab model view",
               **options) -> AttentionView:
    """bertviz's model view: a layers × heads grid of maps ``A[l][batch_index, h]`` (rows are queries,
    columns keys; shade = weight); click a map to enlarge it. The page's head view is one tab away.

    Args:
        include_layers, include_heads: exactly the layers and heads of the grid (default: every layer up
            to ``max_layers`` = 12, spread evenly, and the first ``max_heads`` = 16 heads).
        Others: as :func:`head_view`.

    Raises:
        TypeError, ValueError: as :func:`head_view`; an index outside the model's layers or heads.
    """
    views, name = _views(attentions, tokens, sentence_b_start, encoder_attentions, decoder_attentions,
                         cross_attentions, encoder_tokens, decoder_tokens, batch_index, options)
    n_layers, n_heads = (min(v.weights.shape[i] for v in views) for i in (0, 1))
    include_layers = _indices("include_layers", include_layers, n_layers)
    include_heads = _indices("include_heads", include_heads, n_heads)
    page = render_views(views, model_name=name, grid_layers=include_layers, grid_heads=include_heads,
                        tab="model", title=title, **options)
    rows = len(include_layers) if include_layers is not None else min(n_layers, options.get("max_layers", 12))
    return AttentionView(page, height=min(1000, 320 + 80 * rows))


def _views(attentions, tokens, sentence_b_start, enc, dec, cross, enc_tokens, dec_tokens, batch_index,
           options: dict) -> tuple[list[View], str]:
    """The page's menu entries from the user's arguments (bertviz spellings popped from ``options``)."""
    given = {"attentions": attentions, "encoder_attentions": enc, "decoder_attentions": dec, "cross_attentions": cross}
    for old, new in BERTVIZ_NAMES.items():
        if old in options:
            if given[new] is not None:
                raise ValueError(f"give {new} or bertviz's {old}, not both")
            given[new] = options.pop(old)
    unknown = sorted(set(options) - set(PAGE_OPTIONS))
    if unknown:
        raise TypeError(f"unexpected argument(s) {unknown}: besides attentions/tokens and the encoder-decoder "
                        f"triples, a view takes layer/heads (head_view), include_layers/include_heads (model_view), "
                        f"sentence_b_start, batch_index, title and the page options {list(PAGE_OPTIONS)} (tokens are "
                        "shown as given: bertviz's prettify_tokens, display_mode and html_action do not apply)")
    if isinstance(batch_index, bool) or not isinstance(batch_index, int):
        raise ValueError(f"batch_index must be an int, got {batch_index!r}")
    seq2seq = [k for k in ("encoder_attentions", "decoder_attentions", "cross_attentions") if given[k] is not None]
    if given["attentions"] is not None:
        if seq2seq or enc_tokens is not None or dec_tokens is not None:
            raise ValueError("give attentions + tokens, or the encoder/decoder/cross attentions with encoder_tokens/"
                             f"decoder_tokens, not both (got attentions and {seq2seq or 'encoder/decoder tokens'})")
        w = _stack("attentions", given["attentions"], batch_index)  # (layers, heads, L, L)
        toks = _tokens("tokens", tokens, w.shape[2], "attentions", 2)
        _tokens("tokens", tokens, w.shape[3], "attentions", 3)
        if sentence_b_start is None:
            return [View("attention", "attention", w, toks, list(toks))], "attention"
        return _split(w, toks, sentence_b_start), "attention (sentence A + sentence B)"
    if not seq2seq:
        raise ValueError("attentions is required: a tuple of per-layer (batch, heads, q, k) tensors, e.g. "
                         "model(..., output_attentions=True).attentions (or encoder_attentions/decoder_attentions/"
                         "cross_attentions for an encoder-decoder)")
    if tokens is not None:
        raise ValueError("tokens goes with attentions; an encoder-decoder takes encoder_tokens and decoder_tokens")
    if sentence_b_start is not None:
        raise ValueError("sentence_b_start splits attentions of one sequence; it does not apply to an encoder-decoder")
    views = []
    for kind, q_name, q_toks, k_name, k_toks in (
            ("encoder", "encoder_tokens", enc_tokens, "encoder_tokens", enc_tokens),
            ("decoder", "decoder_tokens", dec_tokens, "decoder_tokens", dec_tokens),
            ("cross", "decoder_tokens", dec_tokens, "encoder_tokens", enc_tokens)):
        arg = f"{kind}_attentions"
        if given[arg] is None:
            continue
        w = _stack(arg, given[arg], batch_index)
        tq, tk = _tokens(q_name, q_toks, w.shape[2], arg, 2), _tokens(k_name, k_toks, w.shape[3], arg, 3)
        views.append(View(kind, KIND_LABELS[kind], w, tq, tk))
    return views, "encoder-decoder"


def _stack(name: str, layers, batch_index: int) -> Tensor:
    """``layers`` (per-layer ``(batch, heads, q, k)`` tensors) -> ``(layers, heads, q, k)`` float32 of one example."""
    expected = f"a tuple of per-layer (batch, heads, q, k) tensors (model(..., output_attentions=True).{name})"
    if isinstance(layers, Tensor) or not isinstance(layers, (tuple, list)):
        raise TypeError(f"{name} must be {expected}, got {type(layers).__name__}")
    if not layers:
        raise ValueError(f"{name} must be {expected}, got an empty {type(layers).__name__}")
    for i, a in enumerate(layers):
        if not isinstance(a, Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor of shape (batch, heads, q, k), got {type(a).__name__}")
        if a.dim() != 4 or 0 in a.shape or not a.is_floating_point():
            raise ValueError(f"{name}[{i}] must be a non-empty float tensor of shape (batch, heads, q, k), got "
                             f"{a.dtype} {tuple(a.shape)}")
        if a.shape != layers[0].shape:
            raise ValueError(f"{name}[{i}] has shape {tuple(a.shape)} but {name}[0] has {tuple(layers[0].shape)}: "
                             "every layer must be (batch, heads, q, k) of the same shape")
    batch = layers[0].shape[0]
    if not 0 <= batch_index < batch:
        raise ValueError(f"batch_index must be in [0, {batch}) for {name} of batch size {batch}, got {batch_index}")
    eps = 4 * torch.finfo(layers[0].dtype).eps  # a softmax's round-off in the stored dtype
    w = torch.stack([a[batch_index].detach().to("cpu", torch.float32) for a in layers])  # (layers, heads, q, k)
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{name} holds NaN or inf")
    lo, hi = float(w.min()), float(w.max())
    if lo < 0 or hi > 1 + eps:
        raise ValueError(f"{name} must hold attention weights in [0, 1] (softmax outputs, not scores), "
                         f"got values in [{lo:.4g}, {hi:.4g}]")
    return w.clamp_(max=1.0)


def _tokens(name: str, tokens, n: int, of: str, dim: int) -> list[str]:
    """``tokens`` as a list of ``n`` strings (the size of ``of``'s dimension ``dim``)."""
    axis = "q" if dim == 2 else "k"
    if tokens is None:
        raise ValueError(f"{name} is required with {of}: {n} token strings, one per {axis} position")
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, (list, tuple)):
        raise TypeError(f"{name} must be a list of {n} str (one per {axis} position of {of}), "
                        f"got {type(tokens).__name__}")
    bad = next((t for t in tokens if not isinstance(t, str)), None)
    if bad is not None:
        raise TypeError(f"{name} must hold str tokens, got a {type(bad).__name__}: {bad!r}")
    if len(tokens) != n:
        raise ValueError(f"{name} has {len(tokens)} tokens but {of} is (batch, heads, q, k) with {axis}={n}: "
                         f"give one token per {axis} position")
    return list(tokens)


def _split(w: Tensor, tokens: list[str], b) -> list[View]:
    """bertviz's ``sentence_b_start``: "All", then the blocks A→A, B→B, A→B, B→A of ``w``
    ``(layers, heads, L, L)``."""
    L = w.shape[2]
    if isinstance(b, bool) or not isinstance(b, int) or not 0 < b < L:
        raise ValueError(f"sentence_b_start must be an int in [1, {L}) (the index of sentence B's first token "
                         f"among the {L} tokens), got {b!r}")
    part = {"a": slice(0, b), "b": slice(b, L)}
    views = [View("all", "All", w, tokens, list(tokens))]
    for name, label in SPLIT_LABELS[1:]:
        q, k = part[name[0]], part[name[1]]
        views.append(View(name, label, w[:, :, q, k].contiguous(), tokens[q], tokens[k]))
    return views
