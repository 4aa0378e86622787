"""Attention views inside a notebook, for any model: bertviz's ``head_view``, ``model_view`` and
``neuron_view``, called as bertviz documents them (same names, same positional order).

::

    from attnlab.viz import head_view, model_view
    out = model(ids, output_attentions=True)           # transformers (attn_implementation="eager"), attnlab, ...
    head_view(out.attentions, tokens)                   # shows inline in Jupyter / VS Code / Colab
    html = model_view(out.attentions, tokens, html_action="return")   # html.data: the page; html.save(path)

``attention`` is bertviz's argument: a tuple with one ``(batch, heads, q, k)`` tensor of softmax
weights per layer (``A[l][b, h, i, j]``: how much query token ``i`` attends to key token ``j``).
Encoder–decoder models give three such tuples instead: ``encoder_attention`` (over
``encoder_tokens``), ``decoder_attention`` (over ``decoder_tokens``) and ``cross_attention``
(decoder queries over encoder keys). The plural spellings of transformers' outputs
(``attentions=``, ``encoder_attentions=``, ...) are accepted too.

The :class:`AttentionView` (``html_action="return"``) is the page ``attnlab viz`` writes (one renderer,
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

# render_views' options a view passes on
PAGE_OPTIONS = ("top_k", "min_weight", "max_tokens", "max_lines", "max_map", "max_layers", "max_heads")
SPLIT_LABELS = (("all", "All"), ("aa", "Sentence A \u2192 Sentence A"), ("bb", "Sentence B \u2192 Sentence B"),
                ("ab", "Sentence A \u2192 Sentence B"), ("ba", "Sentence B \u2192 Sentence A"))


class AttentionView:
    """A rendered attention page: shown inline by Jupyter, VS Code and Colab (``_repr_html_``), written
    to a file by :meth:`save`.

    Attributes:
        html: the whole self-contained page (``<!DOCTYPE html>`` ...), as ``attnlab viz`` writes it;
            ``data`` is the same string (bertviz's ``html_action="return"`` object has ``.data``).
        height: the inline frame's height in CSS pixels (the page scrolls inside it).
    """

    def __init__(self, page: str, *, height: int = 600):
        if not isinstance(page, str):
            raise TypeError(f"page must be a str, got {type(page).__name__}")
        self.html, self.height = page, int(height)

    @property
    def data(self) -> str:
        """The page's HTML (as ``.html``)."""
        return self.html

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


def head_view(attention=None, tokens=None, sentence_b_start: Optional[int] = None, prettify_tokens: bool = True,
              layer: Optional[int] = None, heads: Optional[Sequence[int]] = None, encoder_attention=None,
              decoder_attention=None, cross_attention=None, encoder_tokens=None, decoder_tokens=None,
              include_layers: Optional[Sequence[int]] = None, html_action: str = "view", *, batch_index: int = 0,
              title: str = "attnlab head view", **options) -> Optional[AttentionView]:
    """bertviz's head view: per layer, a line from query token ``i`` to key token ``j`` in head ``h``'s
    colour with opacity ``A[l][batch_index, h, i, j]``. The arguments are bertviz's, in bertviz's order.

    Args:
        attention: tuple of per-layer ``(batch, heads, L, L)`` tensors (``outputs.attentions``).
        tokens: the ``L`` token strings (e.g. ``tokenizer.convert_ids_to_tokens(ids)``); shown as text.
        sentence_b_start: index of sentence B's first token: the page adds the four blocks
            A→A, B→B, A→B and B→A (the weights as given, not renormalised) beside "All".
        prettify_tokens: show byte-level BPE's ``Ġ``/``Ċ`` and SentencePiece's ``▁`` as the space / line
            break they stand for, and drop a trailing ``</w>`` (:func:`prettify`).
        layer: the layer shown first (default: the first of ``include_layers``).
        heads: the heads drawn first (default all; the others are a click away).
        encoder_attention, decoder_attention, cross_attention, encoder_tokens, decoder_tokens:
            an encoder–decoder model's maps instead of ``attention`` (any of the three).
        include_layers: the layers the layer menu offers (default all).
        html_action: ``"view"``: show the view in the notebook (``IPython.display``) and return None;
            ``"return"``: return the :class:`AttentionView` (``.data`` is the page's HTML, ``.save(path)``).
        batch_index: which example of the batch to show.
        title: the page title.
        **options: the plural spellings ``attentions=``, ``encoder_attentions=``, ... (``outputs``' field
            names), or the page's thinning options (``min_weight``, ``top_k``, ``max_tokens``, ...; see
            :func:`attnlab.viz.html.render_views`).

    Raises:
        TypeError: an attention that is not a tuple/list of ``torch.Tensor``, tokens that are not strings.
        ValueError: an empty attention tuple (a transformers model running SDPA returns ``()``: load it with
            ``attn_implementation="eager"``), layers of different shapes, tokens of the wrong length, weights
            outside ``[0, 1]``, a bad ``layer``/``heads``/``include_layers``/``sentence_b_start``/
            ``batch_index``/``html_action``.
    """
    given = {"attentions": attention, "encoder_attentions": encoder_attention,
             "decoder_attentions": decoder_attention, "cross_attentions": cross_attention}
    views, name = _views(given, tokens, sentence_b_start, encoder_tokens, decoder_tokens, batch_index,
                         prettify_tokens, options)
    _check_action(html_action)
    page = render_views(views, model_name=name, layer=layer, heads=heads, menu_layers=include_layers, tab="head",
                        title=title, **options)
    n = max(len(v.tokens_q) for v in views)
    return _act(AttentionView(page, height=min(1000, 260 + 20 * min(n, options.get("max_tokens", 256)))),
                html_action)


def model_view(attention=None, tokens=None, sentence_b_start: Optional[int] = None, prettify_tokens: bool = True,
               display_mode: str = "dark", encoder_attention=None, decoder_attention=None, cross_attention=None,
               encoder_tokens=None, decoder_tokens=None, include_layers: Optional[Sequence[int]] = None,
               include_heads: Optional[Sequence[int]] = None, html_action: str = "view", *, batch_index: int = 0,
               title: str = "attnlab model view", **options) -> Optional[AttentionView]:
    """bertviz's model view: a layers × heads grid of maps ``A[l][batch_index, h]`` (rows are queries,
    columns keys; shade = weight); click a map to enlarge it. The page's head view is one tab away.
    The arguments are bertviz's, in bertviz's order.

    Args:
        display_mode: ``"dark"`` (bertviz's default: light text on near-black) or ``"light"``.
        include_layers, include_heads: exactly the layers and heads of the grid (default: every layer up
            to ``max_layers`` = 12, spread evenly, and the first ``max_heads`` = 16 heads).
        Others: as :func:`head_view`.

    Raises:
        TypeError, ValueError: as :func:`head_view`; an index outside the model's layers or heads; a
            ``display_mode`` other than "dark" and "light".
    """
    given = {"attentions": attention, "encoder_attentions": encoder_attention,
             "decoder_attentions": decoder_attention, "cross_attentions": cross_attention}
    views, name = _views(given, tokens, sentence_b_start, encoder_tokens, decoder_tokens, batch_index,
                         prettify_tokens, options)
    _check_action(html_action)
    n_layers, n_heads = (min(v.weights.shape[i] for v in views) for i in (0, 1))
    include_layers = _indices("include_layers", include_layers, n_layers)
    include_heads = _indices("include_heads", include_heads, n_heads)
    page = render_views(views, model_name=name, grid_layers=include_layers, grid_heads=include_heads,
                        tab="model", theme=display_mode, title=title, **options)
    rows = len(include_layers) if include_layers is not None else min(n_layers, options.get("max_layers", 12))
    return _act(AttentionView(page, height=min(1000, 320 + 80 * rows)), html_action)


def prettify(tokens: Sequence[str]) -> list[str]:
    """Tokens as the text they stand for: byte-level BPE's ``Ġ`` (space) and ``Ċ`` (line break) and
    SentencePiece's ``▁`` (space) become those characters; a word-final ``</w>`` marker is dropped."""
    out = []
    for t in tokens:
        t = t.replace("\u0120", " ").replace("\u010a", "\n").replace("\u2581", " ")
        out.append(t[:-4] if t.endswith("</w>") and len(t) > 4 else t)
    return out


def _check_action(html_action) -> None:
    if html_action not in ("view", "return"):
        raise ValueError(f"html_action must be 'view' (show it in the notebook) or 'return' (return the "
                         f"AttentionView), got {html_action!r}")


def _act(view: AttentionView, html_action: str) -> Optional[AttentionView]:
    """bertviz's ``html_action``: ``"view"`` displays ``view`` through IPython and returns None."""
    if html_action == "return":
        return view
    try:
        from IPython.display import display
    except ImportError:
        raise ImportError("html_action='view' shows the view in a notebook and needs IPython; outside one, "
                          "pass html_action='return' and call .save(path) on the result") from None
    display(view)
    return None


def _views(given: dict, tokens, sentence_b_start, enc_tokens, dec_tokens, batch_index, prettify_tokens,
           options: dict) -> tuple[list[View], str]:
    """The page's menu entries from the user's arguments (the plural spellings popped from ``options``)."""
    for ours in ("attentions", "encoder_attentions", "decoder_attentions", "cross_attentions"):
        if ours in options:
            if given[ours] is not None:
                raise ValueError(f"give {ours[:-1]} or {ours}, not both")
            given[ours] = options.pop(ours)
    unknown = sorted(set(options) - set(PAGE_OPTIONS))
    if unknown:
        raise TypeError(f"unexpected argument(s) {unknown}: a view takes bertviz's arguments (attention, tokens, "
                        "sentence_b_start, prettify_tokens, layer/heads (head_view), display_mode and include_heads "
                        "(model_view), the encoder-decoder triples, include_layers, html_action), batch_index, title "
                        f"and the page options {list(PAGE_OPTIONS)}")
    if isinstance(batch_index, bool) or not isinstance(batch_index, int):
        raise ValueError(f"batch_index must be an int, got {batch_index!r}")
    if not isinstance(prettify_tokens, bool):
        raise ValueError(f"prettify_tokens must be True or False, got {prettify_tokens!r}")
    seq2seq = [k for k in ("encoder_attentions", "decoder_attentions", "cross_attentions") if given[k] is not None]
    if given["attentions"] is not None:
        if seq2seq or enc_tokens is not None or dec_tokens is not None:
            raise ValueError("give attention + tokens, or the encoder/decoder/cross attention with encoder_tokens/"
                             f"decoder_tokens, not both (got attention and {seq2seq or 'encoder/decoder tokens'})")
        w = _stack("attention", given["attentions"], batch_index)  # (layers, heads, L, L)
        toks = _tokens("tokens", tokens, w.shape[2], "attention", 2, prettify_tokens)
        _tokens("tokens", tokens, w.shape[3], "attention", 3, prettify_tokens)
        if sentence_b_start is None:
            return [View("attention", "attention", w, toks, list(toks))], "attention"
        return _split(w, toks, sentence_b_start), "attention (sentence A + sentence B)"
    if not seq2seq:
        raise ValueError("attention is required: a tuple of per-layer (batch, heads, q, k) tensors, e.g. "
                         "model(..., output_attentions=True).attentions (or encoder_attention/decoder_attention/"
                         "cross_attention for an encoder-decoder)")
    if tokens is not None:
        raise ValueError("tokens goes with attention; an encoder-decoder takes encoder_tokens and decoder_tokens")
    if sentence_b_start is not None:
        raise ValueError("sentence_b_start splits attention of one sequence; it does not apply to an encoder-decoder")
    views = []
    for kind, q_name, q_toks, k_name, k_toks in (
            ("encoder", "encoder_tokens", enc_tokens, "encoder_tokens", enc_tokens),
            ("decoder", "decoder_tokens", dec_tokens, "decoder_tokens", dec_tokens),
            ("cross", "decoder_tokens", dec_tokens, "encoder_tokens", enc_tokens)):
        arg = f"{kind}_attention"
        if given[arg + "s"] is None:
            continue
        w = _stack(arg, given[arg + "s"], batch_index)
        tq = _tokens(q_name, q_toks, w.shape[2], arg, 2, prettify_tokens)
        tk = _tokens(k_name, k_toks, w.shape[3], arg, 3, prettify_tokens)
        views.append(View(kind, KIND_LABELS[kind], w, tq, tk))
    return views, "encoder-decoder"


def _stack(name: str, layers, batch_index: int) -> Tensor:
    """``layers`` (per-layer ``(batch, heads, q, k)`` tensors) -> ``(layers, heads, q, k)`` float32 of one example."""
    expected = f"a tuple of per-layer (batch, heads, q, k) tensors (model(..., output_attentions=True).{name}s)"
    if isinstance(layers, Tensor) or not isinstance(layers, (tuple, list)):
        raise TypeError(f"{name} must be {expected}, got {type(layers).__name__}")
    if not layers:
        raise ValueError(f"{name} is an empty {type(layers).__name__}: it must be {expected}. A transformers model "
                         "running SDPA or flash attention returns attentions == (): load it with "
                         'attn_implementation="eager" (e.g. AutoModel.from_pretrained(name, attn_implementation='
                         '"eager")) and call it with output_attentions=True; and take outputs.attentions, as '
                         "outputs[-1] may be another field (a transformers 5 BERT ends with cross_attentions == ())")
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


def _tokens(name: str, tokens, n: int, of: str, dim: int, pretty: bool = False) -> list[str]:
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
    return prettify(tokens) if pretty else list(tokens)


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
