"""One self-contained HTML page: a head view and a model view of an :class:`AttentionRecord`
(:func:`render_html`, for ``attnlab viz``) or of any list of :class:`View` (:func:`render_views`, for the
notebook views of :mod:`attnlab.viz.notebook`); the same renderer for both.

The page fetches nothing: CSS and plain JS are inline (allowed by a Content-Security-Policy that
lists their sha256 and forbids every other source), and the data sits in a
``<script type="application/json">`` block with ``< > &`` and U+2028/9 escaped, so no token can
close it. The script puts tokens into the page with ``textContent`` only.

- Head view (as bertviz): one layer; query tokens left, key tokens right, a line ``i -> j`` per
  head with opacity ``A[l, h, i, j]`` in that head's colour; hover a token to see only its lines;
  click a head's colour to toggle it (double-click: that head alone).
- Model view: a layers × heads grid of small maps; click one to enlarge it.

Long inputs stay usable and the page says what it leaves out: per query token only the ``top_k``
strongest keys with weight ≥ ``min_weight`` get a line (at most ``max_lines`` in all), the head view
covers the first ``max_tokens`` tokens, and the model view shows at most ``max_layers`` × ``max_heads``
maps pooled to ``max_map`` × ``max_map`` cells (:func:`attnlab.viz.extract.pool_attention`).
Weights are embedded in units of 1/``SCALE``.
"""
from __future__ import annotations

import base64
import hashlib
import html
import json
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

import torch

from attnlab._io import atomic_write_text
from attnlab.viz.extract import AttentionRecord, group_labels, pool_attention
from attnlab.viz.page import SCRIPT, STYLE

SCALE = 10_000  # weights are embedded as integers w·SCALE
KIND_LABELS = {"encoder": "encoder self-attention", "decoder": "decoder self-attention",
               "cross": "cross-attention (decoder queries, encoder keys)"}


def render_html(record: AttentionRecord, *, layer: Optional[int] = None, title: str = "attnlab attention view",
                **options) -> str:
    """The page of an :class:`AttentionRecord`: one entry of the page's "Attention" menu per kind
    (see the module docstring for the views and the thinning rules).

    Args:
        record: the attention maps (:func:`attnlab.viz.extract.extract_attention`).
        layer: the layer the head view opens on (default 0); must exist in every kind.
        title: page title (escaped).
        **options: ``top_k, min_weight, max_tokens, max_lines`` (head-view line thinning) and
            ``max_map, max_layers, max_heads`` (model-view caps), as :func:`render_views`.

    Raises:
        TypeError: ``record`` is not an :class:`AttentionRecord` or ``title`` not a ``str``.
        ValueError: as :func:`render_views`.
    """
    if not isinstance(record, AttentionRecord):
        raise TypeError(f"record must be an AttentionRecord, got {type(record).__name__}")
    views = [View(k, KIND_LABELS[k], record.attentions[k], record.tokens_q[k], record.tokens_k[k])
             for k in record.kinds]
    return render_views(views, model_name=record.model_name, layer=layer, title=title, **options)


class View(NamedTuple):
    """One entry of the page's "Attention" menu: ``weights (layers, heads, Lq, Lk)`` float32 on the CPU,
    ``len(tokens_q) == Lq`` and ``len(tokens_k) == Lk`` (checked by the callers that build it)."""

    name: str
    label: str
    weights: torch.Tensor
    tokens_q: list[str]
    tokens_k: list[str]


def render_views(views: Sequence[View], *, model_name: str = "", layer: Optional[int] = None,
                 heads: Optional[Sequence[int]] = None, grid_layers: Optional[Sequence[int]] = None,
                 grid_heads: Optional[Sequence[int]] = None, menu_layers: Optional[Sequence[int]] = None,
                 tab: str = "head", theme: str = "light", title: str = "attnlab attention view", top_k: int = 20,
                 min_weight: float = 0.005,
                 max_tokens: int = 256, max_lines: int = 300_000, max_map: int = 64, max_layers: int = 12,
                 max_heads: int = 16) -> str:
    """The page as a string: the one renderer behind ``attnlab viz``, :func:`render_html` and the
    notebook views (:mod:`attnlab.viz.notebook`).

    Args:
        views: the menu entries, in order (the page opens on the first).
        model_name: the page's subtitle (escaped; may be empty).
        layer: the layer the head view opens on (default 0); must exist in every view.
        heads: the heads drawn when the head view opens (default all; the others can be clicked on).
        grid_layers, grid_heads: exactly the layers / heads of the model view's grid (default: up to
            ``max_layers`` evenly spread layers and the first ``max_heads`` heads).
        menu_layers: the layers the head view's layer menu offers (default all); ``layer`` must be one of them.
        tab: ``"head"`` or ``"model"``, the view shown first.
        theme: ``"light"`` (dark text on white) or ``"dark"`` (light text on near-black; a map's weight 0
            is the background colour in both).
        title: page title (escaped).
        top_k, min_weight, max_tokens, max_lines: head-view line thinning.
        max_map, max_layers, max_heads: model-view caps (map cells per side, grid rows, grid columns).

    Raises:
        TypeError: ``title`` or ``model_name`` is not a ``str``.
        ValueError: no views; ``layer``, a head or a grid index outside the range every view has; a cap that
            is not a positive int (``min_weight`` must lie in ``[0, 1]``); ``tab`` not "head" or "model",
            ``theme`` not "light" or "dark"; ``layer`` not among ``menu_layers``.
    """
    for name, v in (("title", title), ("model_name", model_name)):
        if not isinstance(v, str):
            raise TypeError(f"{name} must be a str, got {type(v).__name__}")
    if not views:
        raise ValueError("views must hold at least one View")
    caps = dict(top_k=top_k, max_tokens=max_tokens, max_lines=max_lines, max_map=max_map,
                max_layers=max_layers, max_heads=max_heads)
    for name, v in caps.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if isinstance(min_weight, bool) or not isinstance(min_weight, (int, float)) or not 0.0 <= min_weight <= 1.0:
        raise ValueError(f"min_weight must be a float in [0, 1], got {min_weight!r}")
    if tab not in ("head", "model"):
        raise ValueError(f"tab must be 'head' or 'model', got {tab!r}")
    if theme not in ("light", "dark"):
        raise ValueError(f"display_mode must be 'light' or 'dark', got {theme!r}")
    n_layers = min(v.weights.shape[0] for v in views)
    n_heads = min(v.weights.shape[1] for v in views)
    menu_layers = _indices("include_layers", menu_layers, n_layers)
    if layer is None:
        layer = menu_layers[0] if menu_layers else 0
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n_layers:
        raise ValueError(f"layer must be an int in [0, {n_layers}), got {layer!r}")
    if menu_layers is not None and layer not in menu_layers:
        raise ValueError(f"layer {layer} is not in include_layers {menu_layers}")
    heads, grid_layers, grid_heads = (_indices(name, v, n) for name, v, n in
                                      (("heads", heads, n_heads), ("grid_layers", grid_layers, n_layers),
                                       ("grid_heads", grid_heads, n_heads)))
    data = {"scale": SCALE, "layer": layer, "layers": menu_layers, "heads": heads, "tab": tab, "theme": theme,
            "title": title, "model": model_name,
            "kinds": [_kind_payload(v, min_weight=float(min_weight), grid_layers=grid_layers,
                                    grid_heads=grid_heads, **caps) for v in views]}
    return _page(title, model_name, _json_for_script(data))


def _indices(name: str, value, n: int) -> Optional[list[int]]:
    """``value`` as a sorted list of distinct ints in ``[0, n)`` (None stays None)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} must be a list of ints in [0, {n}), got {value!r}")
    out = list(value)
    if not out or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n for i in out):
        raise ValueError(f"{name} must be a non-empty list of ints in [0, {n}), got {out!r}")
    return sorted(set(out))


def save_html(record: AttentionRecord, path, **kwargs) -> Path:
    """Write :func:`render_html` ``(record, **kwargs)`` to ``path`` atomically (temp file + ``os.replace``).

    Raises:
        FileNotFoundError: the parent directory of ``path`` does not exist.
        TypeError, ValueError: as :func:`render_html`.
    """
    path = _output_path(path)
    atomic_write_text(path, render_html(record, **kwargs))
    return path


def write_page(page: str, path) -> Path:
    """Write a rendered page (e.g. :func:`render_views`'s) to ``path`` atomically (temp file + ``os.replace``).

    Raises:
        FileNotFoundError: the parent directory of ``path`` does not exist.
        TypeError: ``page`` is not a ``str``.
    """
    if not isinstance(page, str):
        raise TypeError(f"page must be a str, got {type(page).__name__}")
    path = _output_path(path)
    atomic_write_text(path, page)
    return path


def _output_path(path) -> Path:
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"no such directory for the output file: {str(path.parent)!r}")
    return path


def head_colors(n: int) -> list[str]:
    """``n`` distinct hex colours: matplotlib's tab10 up to 10 heads, else ``n`` evenly spaced
    saturated hues (tab20's pale half would make maps hard to read)."""
    import matplotlib
    from matplotlib.colors import hsv_to_rgb, to_hex

    if n <= 10:
        return [to_hex(matplotlib.colormaps["tab10"](i)) for i in range(n)]
    return [to_hex(hsv_to_rgb((i / n, 0.85, 0.75))) for i in range(n)]


def _kind_payload(view: View, *, top_k: int, min_weight: float, max_tokens: int, max_lines: int, max_map: int,
                  max_layers: int, max_heads: int, grid_layers: Optional[list[int]],
                  grid_heads: Optional[list[int]]) -> dict:
    w = view.weights  # (layers, heads, Lq, Lk)
    n_layers, n_heads = w.shape[:2]
    tq, tk = list(view.tokens_q), list(view.tokens_k)
    layers = grid_layers if grid_layers is not None else _spread(n_layers, max_layers)
    heads = grid_heads if grid_heads is not None else list(range(min(n_heads, max_heads)))
    return {"name": view.name, "label": view.label, "n_layers": n_layers, "n_heads": n_heads,
            "tokens_q": tq, "tokens_k": tk, "colors": head_colors(n_heads),
            "head": _head_view(w, top_k=top_k, min_weight=min_weight, max_tokens=max_tokens, max_lines=max_lines),
            "model": _model_view(w, tq, tk, layers=layers, heads=heads, max_map=max_map, max_layers=max_layers,
                                 max_heads=max_heads)}


def _head_view(w: torch.Tensor, *, top_k: int, min_weight: float, max_tokens: int, max_lines: int) -> dict:
    """Lines ``[q, k, round(w·SCALE), …]`` per (layer, head): the ``top_k`` strongest keys of each
    query with weight ≥ ``min_weight``; and notes saying what was left out."""
    n_layers, n_heads, Lq, Lk = w.shape
    nq, nk = min(Lq, max_tokens), min(Lk, max_tokens)
    hw = w[:, :, :nq, :nk]  # (layers, heads, nq, nk)
    k = min(top_k, nk, max(1, max_lines // (n_layers * n_heads * nq)))
    vals, idx = hw.topk(k, dim=-1)  # (layers, heads, nq, k)
    keep = vals >= min_weight
    lines = []
    for layer in range(n_layers):
        per_head = []
        for h in range(n_heads):
            q, j = keep[layer, h].nonzero(as_tuple=True)
            cols = torch.stack([q, idx[layer, h, q, j], (vals[layer, h, q, j] * SCALE).round().long()], 1)
            per_head.append(cols.flatten().tolist())
        lines.append(per_head)
    notes = []
    if nq < Lq or nk < Lk:
        notes.append(f"The head view covers the first {nq} of {Lq} query tokens and the first {nk} of {Lk} "
                     f"key tokens (max_tokens={max_tokens}); the model view covers all of them.")
    total, drawn = hw.numel(), int(keep.sum())
    if drawn < total:
        kept = torch.zeros_like(hw, dtype=torch.bool).scatter_(-1, idx, keep)
        left_out = float(hw.masked_fill(kept, 0.0).max())
        why = f"its weight is below {min_weight:g}"
        if k < nk:
            why += f" or it is not among the {k} strongest of its query token"
        notes.append(f"Lines (all layers and heads): {drawn} of {total} drawn; a line is left out when {why}. "
                     f"The largest weight left out is {left_out:.4f}.")
        if k < min(top_k, nk):
            notes.append(f"top_k was lowered from {top_k} to {k} to keep at most max_lines={max_lines} lines.")
    else:
        notes.append(f"Lines (all layers and heads): all {total} drawn.")
    return {"n_q": nq, "n_k": nk, "lines": lines, "notes": notes}


def _model_view(w: torch.Tensor, tq: list[str], tk: list[str], *, layers: list[int], heads: list[int],
                max_map: int, max_layers: int, max_heads: int) -> dict:
    """Pooled maps for the shown ``layers`` × ``heads``, flattened row-major as ints ``round(P·SCALE)``."""
    n_layers, n_heads, Lq, Lk = w.shape
    pooled, rows, cols = pool_attention(w[layers][:, heads], max_map)  # (len(layers), len(heads), nr, nc)
    ints = (pooled * SCALE).round().long()
    maps = [[ints[i, j].flatten().tolist() for j in range(len(heads))] for i in range(len(layers))]
    notes = []
    if len(layers) < n_layers:
        notes.append(f"The grid shows {len(layers)} of {n_layers} layers ({', '.join(map(str, layers))}; "
                     f"max_layers={max_layers} or the layers asked for).")
    if heads != list(range(len(heads))):
        notes.append(f"The grid shows heads {', '.join(map(str, heads))} of {n_heads} (the heads asked for).")
    elif len(heads) < n_heads:
        notes.append(f"The grid shows heads 0\u2013{heads[-1]} of {n_heads} (max_heads={max_heads}).")
    if len(rows) < Lq or len(cols) < Lk:
        notes.append(f"Maps are pooled from {Lq}\u00d7{Lk} to {len(rows)}\u00d7{len(cols)} cells (max_map={max_map}): "
                     "a cell is the attention its key tokens receive, summed over them and averaged over "
                     "its query tokens; labels give token index ranges.")
    if not notes:
        notes.append(f"All {n_layers}\u00d7{n_heads} maps at full resolution ({Lq}\u00d7{Lk}).")
    return {"layers": layers, "heads": heads, "rows": group_labels(tq, rows), "cols": group_labels(tk, cols),
            "maps": maps, "notes": notes}


def _spread(n: int, cap: int) -> list[int]:
    """``range(n)``, or ``cap`` evenly spaced indices from 0 to ``n - 1`` when ``n > cap``."""
    if n <= cap:
        return list(range(n))
    if cap == 1:
        return [n - 1]
    return sorted({round(i * (n - 1) / (cap - 1)) for i in range(cap)})


def _json_for_script(obj) -> str:
    """JSON safe inside ``<script type="application/json">``: ``<``, ``>``, ``&``, U+2028 and U+2029
    become ``\\uXXXX`` escapes (they only occur inside strings), so ``</script>`` cannot appear."""
    s = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    for ch in ("&", "<", ">", "\u2028", "\u2029"):
        s = s.replace(ch, f"\\u{ord(ch):04x}")
    return s


def _csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii") + "'"


def page_head(title: str, style: str, script: str) -> str:
    """A page's ``<!DOCTYPE html>`` up to ``</head>``: a Content-Security-Policy that allows exactly ``style`` and
    ``script`` (by their sha256) and nothing else (no URL, no other script), the escaped ``title``, the style."""
    csp = (f"default-src 'none'; script-src {_csp_hash(script)}; style-src {_csp_hash(style)}; "
           "img-src data:; base-uri 'none'; form-action 'none'")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{csp}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>{html.escape(title, quote=True)}</title>
<style>{style}</style>
</head>"""


def _page(title: str, model_name: str, data_json: str) -> str:
    t = html.escape(title, quote=True)
    sub = html.escape(model_name or "attention", quote=True)
    return f"""{page_head(title, STYLE, SCRIPT)}
<body>
<header>
<h1>{t}</h1>
<p class="sub">{sub}. Hover a token to follow its lines; click a head's colour to toggle it (double-click:
only that head); in the model view click a map to enlarge it.</p>
<div class="controls">
<label>Attention <select id="kind"></select></label>
<span class="tabs"><button id="tab-head" class="tab active" type="button">Head view</button><button
id="tab-model" class="tab" type="button">Model view</button></span>
</div>
</header>
<section id="head-view">
<div class="controls"><label>Layer <select id="layer"></select></label>
<span id="heads" class="heads"></span><button id="all-heads" type="button">all heads</button></div>
<ul class="notes" id="head-notes"></ul>
<svg id="hv-svg" class="hv"></svg>
</section>
<section id="model-view" hidden>
<p class="sub">Rows are queries, columns keys. Shade: the background = 0 up to the head's colour = 1 (the weight
itself, not rescaled per map); hover a cell of an enlarged map for its value.</p>
<ul class="notes" id="model-notes"></ul>
<div id="grid" class="grid"></div>
<div id="zoom" class="zoom" hidden>
<div class="zoom-head"><h2 id="zoom-title"></h2><span id="zoom-value" class="value"></span>
<button id="zoom-close" type="button">close</button></div>
<svg id="zoom-svg"></svg>
</div>
</section>
<script type="application/json" id="attnlab-data">{data_json}</script>
<script>{SCRIPT}</script>
</body>
</html>
"""
