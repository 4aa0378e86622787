"""bertviz's neuron view: the query and key vectors of one head, their elementwise product, the dot
product and the softmax, for any attnlab BERT / GPT-2 / Llama model or a transformers BERT / RoBERTa /
GPT-2, with no patched model; and for attnlab's encoder–decoders (T5, BART, their task heads, a
``Seq2SeqTransformer``), one of their three attentions at a time.

::

    from attnlab.viz import neuron_view
    neuron_view(model, "bert", tokenizer, "the cat sat on the mat", "the cat lay on the rug", layer=2, head=0)

The arguments are those of bertviz's ``neuron_view.show``, in its order. q and k are read through
forward hooks during one ordinary forward of the model, as the attention computes them (after QK-norm and
RoPE where the model has them; GQA's shared key heads repeated per query head)::

    q_i, k_j  (head_dim,)     the head's query of token i and key of token j
    q_i ∘ k_j                 elementwise product (its sum is the dot product)
    s_ij = κ q_i · k_j        κ = the attention's scale (1/√head_dim by default); -inf where the mask forbids
    w_ij = softmax_j(s_ij)    equal to the model's attention weights (output_attentions)

T5's attention adds its relative position bias: ``s_ij = κ q_i · k_j + b_ij`` (the page shows ``b_ij`` in its own
column). An encoder–decoder reads ``sentence_a`` as the source and ``sentence_b`` as the target, fed to the
decoder teacher-forced (shifted right behind ``decoder_start_token_id``), and ``attention`` picks the
encoder's self-attention (queries and keys: source tokens), the decoder's causal self-attention (target tokens)
or the cross-attention (target queries over source keys) — bertviz's ``encoder`` / ``decoder`` / ``cross``.

The page is self-contained as the other views (no request, tokens as text, a Content-Security-Policy).
"""
from __future__ import annotations

import html
import math
from typing import Optional

import torch
from torch import Tensor, nn

from attnlab.viz.html import _json_for_script, page_head
from attnlab.viz.notebook import AttentionView, _act, _check_action, prettify
from attnlab.viz.page import DOM_HELPERS

MAX_TOKENS = 128  # the page embeds layers × heads × tokens × head_dim numbers twice
HF_FAMILIES = ("bert", "roberta", "gpt2")  # transformers' model_type values whose q/k projections are read
ATTENTIONS = ("encoder", "decoder", "cross")  # an encoder-decoder's three (bertviz's names)


@torch.no_grad()
def neuron_view(model, model_type: Optional[str] = None, tokenizer=None, sentence_a: Optional[str] = None,
                sentence_b: Optional[str] = None, display_mode: str = "dark", layer: Optional[int] = None,
                head: Optional[int] = None, html_action: str = "view", *, attention: str = "encoder",
                prettify_tokens: bool = True, title: str = "attnlab neuron view") -> Optional[AttentionView]:
    """Show how one head's query and key vectors produce its attention weights (bertviz's neuron view).

    Args:
        model: an attnlab BERT (or a head on it), GPT-2 or Llama model, an attnlab T5, BART (or a task head on
            one) or Seq2SeqTransformer, or a transformers BERT, RoBERTa or GPT-2 model (any attention
            implementation: q and k come from hooks, not ``output_attentions``).
        model_type: bertviz's ``"bert"``, ``"roberta"`` or ``"gpt2"``; checked against the model when given.
        tokenizer: a transformers tokenizer, a ``tokenizers.Tokenizer``, or attnlab's ``TextTokenizer`` /
            ``CharTokenizer``; special tokens are added as the tokenizer does.
        sentence_a: the text; ``sentence_b``: a second sentence (token types 0 then 1, as BERT pairs). An
            encoder–decoder's source and target (the target is needed for ``"decoder"`` and ``"cross"``).
        display_mode: ``"dark"`` (bertviz's default) or ``"light"``.
        layer, head: the layer and head shown first (default 0 and 0; the page's menus select the others).
        html_action: ``"view"`` shows the page in the notebook and returns None; ``"return"`` returns the
            :class:`AttentionView` (``.data``: the HTML, ``.save(path)``).
        attention: an encoder–decoder's ``"encoder"`` (default), ``"decoder"`` or ``"cross"`` attention; other
            models have one and take only ``"encoder"``'s default.
        prettify_tokens: as :func:`attnlab.viz.head_view`.
        title: the page title.

    Raises:
        TypeError: an unsupported model, tokenizer or text.
        ValueError: ``model_type`` not matching the model, no text, more than ``MAX_TOKENS`` tokens, a bad
            ``layer``/``head``/``display_mode``/``html_action``/``attention``, an encoder–decoder's
            ``"decoder"`` or ``"cross"`` without ``sentence_b``.
    """
    _check_action(html_action)
    if display_mode not in ("dark", "light"):
        raise ValueError(f"display_mode must be 'dark' or 'light', got {display_mode!r}")
    if not isinstance(sentence_a, str) or not sentence_a:
        raise ValueError(f"sentence_a must be a non-empty str, got {sentence_a!r}")
    if sentence_b is not None and not isinstance(sentence_b, str):
        raise TypeError(f"sentence_b must be a str or None, got {type(sentence_b).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    family = _family(model, model_type)
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {list(ATTENTIONS)}, got {attention!r}")
    if family == "seq2seq":
        q, k, bias, mask, scale, tokens, tokens_k = _seq2seq(model, tokenizer, sentence_a, sentence_b, attention)
    else:
        if attention != "encoder":
            raise ValueError(f"attention={attention!r} is for encoder-decoders (T5, BART); {type(model).__name__} "
                             "has one stack of self-attention: leave attention at its default")
        ids, tokens, types = _encode(tokenizer, sentence_a, sentence_b)
        if len(ids) > MAX_TOKENS:
            raise ValueError(f"sentence_a/sentence_b give {len(ids)} tokens; the neuron view shows at most "
                             f"{MAX_TOKENS}")
        q, k, bias, mask, scale = query_key(model, family, ids, types)  # (layers, heads, L, D) each; (layers, L, L)
        tokens_k = tokens
    n_layers, n_heads = q.shape[:2]
    layer = 0 if layer is None else layer
    head = 0 if head is None else head
    for name, v, n in (("layer", layer, n_layers), ("head", head, n_heads)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < n:
            raise ValueError(f"{name} must be an int in [0, {n}), got {v!r}")
    scores = q @ k.transpose(-1, -2) * scale  # (layers, heads, Lq, Lk)
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    weights = scores.softmax(-1)
    if prettify_tokens:
        tokens, tokens_k = prettify(tokens), prettify(tokens_k)
    data = {"layer": layer, "head": head, "theme": display_mode, "tokens": tokens, "tokens_k": tokens_k,
            "model": type(model).__name__, "attention": attention if family == "seq2seq" else None,
            "q": _rounded(q), "k": _rounded(k), "scores": _rounded(scores.masked_fill(~mask[:, None], 0.0)),
            "bias": None if bias is None else _rounded(bias), "w": _rounded(weights), "mask": mask.int().tolist(),
            "scale": scale}
    rows = max(len(tokens), len(tokens_k))
    view = AttentionView(_page(title, _json_for_script(data), data["attention"]), height=min(1000, 320 + 22 * rows))
    return _act(view, html_action)


def _rounded(t: Tensor) -> list:
    return (t.float() * 1e4).round().div(1e4).tolist()


def _family(model: nn.Module, model_type: Optional[str]) -> str:
    """``"ours"`` or transformers' ``model_type`` of ``model`` (checked against bertviz's ``model_type``)."""
    from attnlab.modules.multihead import MultiheadAttention

    config = getattr(model, "config", None)
    hf_type = getattr(config, "model_type", None) if type(model).__module__.startswith("transformers.") else None
    if hf_type is None:
        if not any(isinstance(m, MultiheadAttention) for m in model.modules()):
            raise TypeError(f"model must be an attnlab BERT, GPT-2 or Llama model or a transformers "
                            f"{'/'.join(HF_FAMILIES)} model, got {type(model).__name__}")
        got = "seq2seq" if any(name.endswith("cross_attn") for name, _ in model.named_modules()) \
            or hasattr(model, "_decoder_states") else "ours"  # (T5ForTokenClassification: an encoder alone)
    elif hf_type not in HF_FAMILIES:
        raise TypeError(f"the neuron view reads transformers models of type {list(HF_FAMILIES)}, got {hf_type!r}")
    else:
        got = hf_type
    if model_type is not None:
        if model_type not in HF_FAMILIES:
            raise ValueError(f"model_type must be one of {list(HF_FAMILIES)} or None, got {model_type!r}")
        ours_type = getattr(config, "model_type", None)
        actual = hf_type if got not in ("ours", "seq2seq") else ours_type
        if actual is not None and actual != model_type and {actual, model_type} != {"bert", "roberta"}:
            raise ValueError(f"model_type={model_type!r} but the model is a {actual!r} model ({type(model).__name__})")
    return got


def _encode(tokenizer, a: str, b: Optional[str]) -> tuple[list[int], list[str], list[int]]:
    """``(ids, tokens, token types)`` from a transformers tokenizer or one of ours."""
    if hasattr(tokenizer, "convert_ids_to_tokens") and callable(tokenizer):  # transformers
        enc = tokenizer(a, b) if b is not None else tokenizer(a)
        ids = list(enc["input_ids"])
        types = list(enc.get("token_type_ids") or [0] * len(ids))
        return ids, list(tokenizer.convert_ids_to_tokens(ids)), types
    from attnlab.viz.extract import _as_tokenizer
    from attnlab.viz.extract import _encode as encode

    return encode(_as_tokenizer(tokenizer), a, "sentence_a", b)


def query_key(model: nn.Module, family: str, ids: list[int], types: list[int]) -> tuple[Tensor, Tensor, Tensor, float]:
    """Every layer's per-head ``q, k (layers, heads, L, head_dim)``, the allowed-key mask ``(layers, L, L)`` and
    the scale κ, read by forward hooks during one forward of ``model`` on one sequence."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    tt = torch.tensor([types], device=device)
    L = len(ids)
    if family == "ours":
        from attnlab.models.causal_lm import DecoderOnlyLM

        return _ours(model, lambda: model(x) if isinstance(model, DecoderOnlyLM) else model(x, token_type_ids=tt),
                     lambda name: name.endswith("self_attn"))
    cfg = model.config
    H = cfg.num_attention_heads if family != "gpt2" else cfg.n_head
    captured: dict[str, list[Tensor]] = {"q": [], "k": []}
    hooks = []
    for name, m in model.named_modules():
        if family == "gpt2" and name.endswith("attn.c_attn"):
            def split(mod, args, out):
                q, k, _ = out.float().split(out.shape[-1] // 3, dim=-1)
                captured["q"].append(q)
                captured["k"].append(k)
            hooks.append(m.register_forward_hook(split))
        elif family != "gpt2" and name.endswith("attention.self.query"):
            hooks.append(m.register_forward_hook(lambda mod, args, out: captured["q"].append(out.float())))
        elif family != "gpt2" and name.endswith("attention.self.key"):
            hooks.append(m.register_forward_hook(lambda mod, args, out: captured["k"].append(out.float())))
    try:
        model(input_ids=x) if family == "gpt2" else model(input_ids=x, token_type_ids=tt)
    finally:
        for h in hooks:
            h.remove()
    q, k = (torch.stack([t[0].view(L, H, -1).transpose(0, 1) for t in captured[n]]) for n in ("q", "k"))
    allowed = torch.ones(L, L, dtype=torch.bool, device=device)
    if family == "gpt2":
        allowed = allowed.tril()
    return q, k, None, allowed.expand(q.shape[0], L, L), 1.0 / math.sqrt(q.shape[-1])


def _seq2seq(model: nn.Module, tokenizer, source: str, target: Optional[str], attention: str):
    """``(q, k, bias, mask, scale, query tokens, key tokens)`` of an encoder–decoder's ``attention``."""
    from attnlab.viz.extract import _as_tokenizer, seq2seq_tokens
    from attnlab.viz.extract import _encode as encode

    name = type(model).__name__
    if attention != "encoder" and not hasattr(model, "decoder"):
        raise ValueError(f"{name} is an encoder alone: attention must be 'encoder', got {attention!r}")
    if not hasattr(model, "decoder") and target is not None:
        raise ValueError(f"{name} is an encoder alone: give sentence_a only (sentence_b is an encoder-decoder's "
                         "target)")
    if attention != "encoder" and target is None:
        raise ValueError(f"{name} is an encoder-decoder: attention={attention!r} needs sentence_b, the target the "
                         "decoder reads (sentence_a is the source)")
    tokenizer = _as_tokenizer(tokenizer)
    if target is None:
        src, src_toks, _ = encode(tokenizer, source, "sentence_a")
        dec, dec_toks = [], []
    else:
        src, src_toks, dec, dec_toks = seq2seq_tokens(model, tokenizer, source, target, ("sentence_a", "sentence_b"))
    if max(len(src), len(dec)) > MAX_TOKENS:
        raise ValueError(f"sentence_a/sentence_b give {len(src)}/{len(dec)} tokens; the neuron view shows at most "
                         f"{MAX_TOKENS} a side")
    device = next(model.parameters()).device
    src_t, dec_t = torch.tensor([src], device=device), torch.tensor([dec], device=device)

    def run() -> None:
        if getattr(model.config, "decoder_start_token_id", None) is None:  # a Seq2SeqTransformer
            return model.encode(src_t) if not dec else model(src_t, dec_t)
        memory = model._encode(src_t, None, False)[0]
        if dec:
            model._decoder_states(dec_t, memory, None, None, None, False)

    stack, kind = ("encoder.", "self_attn") if attention == "encoder" else \
        ("decoder.", "self_attn" if attention == "decoder" else "cross_attn")
    q, k, bias, mask, scale = _ours(model, run, lambda n: n.startswith(stack) and n.endswith(kind))
    tokens = src_toks if attention == "encoder" else dec_toks
    return q, k, bias, mask, scale, tokens, src_toks if attention != "decoder" else dec_toks


def _ours(model: nn.Module, run, chosen) -> tuple[Tensor, Tensor, Optional[Tensor], Tensor, float]:
    """q and k of every :class:`MultiheadAttention` whose name ``chosen(name)`` accepts, as its forward computes
    them during ``run()``: ``(q (layers, H, Lq, D), k (layers, H, Lk, D), additive position bias (layers, H, Lq,
    Lk) or None, allowed keys (layers, Lq, Lk), κ)``."""
    from attnlab.modules.multihead import MultiheadAttention

    attns = [m for name, m in model.named_modules() if isinstance(m, MultiheadAttention) and chosen(name)]
    for m in attns:
        if m.normalize != "softmax" or m.top_k is not None:
            raise TypeError("the neuron view shows softmax(κ q·k + bias) attention; this model uses another "
                            "normaliser")
    seen: list[tuple] = []

    def grab(mod, args, kwargs):
        query = args[0] if args else kwargs["query"]
        key = args[1] if len(args) > 1 and args[1] is not None else kwargs.get("key")
        seen.append((mod, query, query if key is None else key, kwargs.get("is_causal", False),
                     kwargs.get("attn_mask"), getattr(mod, "window", None)))

    hooks = [m.register_forward_pre_hook(grab, with_kwargs=True) for m in attns]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    qs, ks, biases, masks, scales = [], [], [], [], set()
    for m, hq, hk, causal, attn_mask, window in seen:
        Lq, Lk = hq.shape[1], hk.shape[1]
        q, k, _, _ = m._project(hq, hk, hk, False)
        H, Hkv, D = m.num_heads, m.num_kv_heads, m.head_dim
        q, k = q.view(1, Lq, H, D).transpose(1, 2), k.view(1, Lk, Hkv, D).transpose(1, 2)  # (1, H, L, D)
        if m.k_norm is not None:
            q, k = m.q_norm(q).to(q.dtype), m.k_norm(k).to(k.dtype)
        if m.rotary is not None:
            q, k = m.rotary(q, torch.arange(Lq, device=q.device)), m.rotary(k, torch.arange(Lk, device=k.device))
        qs.append(q[0].float())
        ks.append(k[0].float().repeat_interleave(H // Hkv, dim=0))  # GQA: each query head's shared key head
        if m.position_bias is not None:  # T5: b (1, H, Lq, Lk) added to the scores
            biases.append(m.position_bias(torch.arange(Lq, device=q.device), torch.arange(Lk, device=q.device))
                          .reshape(H, Lq, Lk).float())
        allowed = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device)
        if causal is True:
            allowed = allowed.tril(Lk - Lq)
        if window is not None:
            allowed &= ~torch.ones_like(allowed).tril(-window)
        if isinstance(attn_mask, Tensor):
            am = attn_mask.reshape(-1, Lq, Lk)[0]
            allowed &= am if am.dtype == torch.bool else am > float("-inf")
        masks.append(allowed)
        scales.add(m.scale if m.scale is not None else 1.0 / math.sqrt(D))
    if len(scales) != 1:
        raise TypeError("the neuron view needs one scale κ for every layer")
    if biases and len(biases) != len(qs):
        raise TypeError("the neuron view needs the position bias in every layer or in none")
    return torch.stack(qs), torch.stack(ks), torch.stack(biases) if biases else None, torch.stack(masks), scales.pop()


STYLE = r"""
body { font: 14px/1.4 system-ui, sans-serif; margin: 16px 24px; color: #222; background: #fff; }
body.dark { color: #ddd; background: #111; }
h1 { font-size: 20px; margin: 0 0 4px; }
.sub { color: #777; margin: 0 0 8px; max-width: 900px; }
.controls { display: flex; gap: 12px; align-items: center; margin: 8px 0; }
table.nv { border-collapse: collapse; font: 12px monospace; }
table.nv td { padding: 1px 4px; white-space: nowrap; }
table.nv td.tok { cursor: pointer; }
table.nv tr.sel td.tok { font-weight: bold; text-decoration: underline; }
table.nv tr.masked { opacity: 0.35; }
.vec { display: inline-flex; }
.vec span { display: inline-block; width: 5px; height: 14px; }
.bar { display: inline-block; height: 10px; background: #2a7ab0; }
"""

SCRIPT = r"""
(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("attnlab-data").textContent);
  if (D.theme === "dark") document.body.classList.add("dark");
  var state = { layer: D.layer, head: D.head, q: 0 };
""" + DOM_HELPERS + r"""  function shade(v, m) {  // blue for positive, orange for negative, opacity |v| / max
    var a = m > 0 ? Math.min(1, Math.abs(v) / m) : 0;
    return (v >= 0 ? "rgba(42,122,176," : "rgba(230,120,20,") + a.toFixed(3) + ")";
  }
  function vec(parent, values, m, cls) {
    var box = make("span", { "class": "vec " + cls }, parent);
    values.forEach(function (v) { var s = make("span", { "data-v": v }, box); s.style.background = shade(v, m); });
  }
  function absMax(rows) {
    var m = 0;
    rows.forEach(function (r) { r.forEach(function (v) { m = Math.max(m, Math.abs(v)); }); });
    return m;
  }
  function draw() {
    var l = state.layer, h = state.head, i = state.q, q = D.q[l][h], k = D.k[l][h], tb = $("nv"); clear(tb);
    var mq = absMax(q.concat(k)), qi = q[i];
    var prods = k.map(function (kj) { return kj.map(function (v, d) { return v * qi[d]; }); });
    var mp = absMax(prods), hdr = make("tr", {}, tb);
    var cols = ["query", "q", "key", "k", "q \u2218 k"];
    if (D.bias) cols.push("bias b");
    cols.push(D.bias ? "q \u00b7 k \u00d7 \u03ba + b" : "q \u00b7 k \u00d7 \u03ba", "softmax");
    cols.forEach(function (t) { make("th", {}, hdr, t); });
    var rows = Math.max(D.tokens.length, D.tokens_k.length);  // cross-attention: target queries, source keys
    for (var j = 0; j < rows; j++) (function (j) {
      var key = j < D.tokens_k.length, ok = key && D.mask[l][i][j];
      var row = make("tr", { "class": (j === i ? "sel" : "") + (ok ? "" : " masked"), "data-j": j }, tb);
      if (j < D.tokens.length) {
        var tq = make("td", { "class": "tok tok-q", "data-i": j }, row, D.tokens[j]);
        tq.addEventListener("mouseenter", function () { if (state.q !== j) { state.q = j; draw(); } });
      } else make("td", {}, row);
      var cq = make("td", {}, row); if (j === i) vec(cq, qi, mq, "q");
      if (!key) return;
      make("td", { "class": "tok tok-k" }, row, D.tokens_k[j]);
      vec(make("td", {}, row), k[j], mq, "k");
      vec(make("td", {}, row), prods[j], mp, "qk");
      if (D.bias) make("td", { "class": "bias" }, row, D.bias[l][h][i][j].toFixed(3));
      make("td", { "class": "score" }, row, ok ? D.scores[l][h][i][j].toFixed(3) : "masked");
      var w = D.w[l][h][i][j], c = make("td", { "class": "w", "data-w": w }, row);
      make("span", { "class": "bar" }, c).style.width = Math.round(100 * w) + "px";
      make("span", {}, c, " " + w.toFixed(4));
    })(j);
  }
  var ls = $("layer"), hs = $("head");
  for (var l = 0; l < D.q.length; l++) make("option", { value: l }, ls, String(l));
  for (var h = 0; h < D.q[0].length; h++) make("option", { value: h }, hs, String(h));
  ls.value = String(state.layer); hs.value = String(state.head);
  ls.addEventListener("change", function () { state.layer = +ls.value; draw(); });
  hs.addEventListener("change", function () { state.head = +hs.value; draw(); });
  draw();
})();
"""


def _page(title: str, data_json: str, attention: Optional[str] = None) -> str:
    t = html.escape(title, quote=True)
    stack = "" if attention is None else {
        "encoder": " Encoder self-attention: source tokens over source tokens.",
        "decoder": " Decoder self-attention (causal): target tokens over target tokens.",
        "cross": " Cross-attention: target queries over source keys."}[attention]
    return f"""{page_head(title, STYLE, SCRIPT)}
<body>
<h1>{t}</h1>
<p class="sub">Hover a query token (left) to see its query vector q against every key vector k: the elementwise
product q &#8728; k (blue positive, orange negative), the dot product times the scale (plus the position bias b where
the model adds one), and the softmax weight.{stack}</p>
<div class="controls"><label>Layer <select id="layer"></select></label>
<label>Head <select id="head"></select></label></div>
<table class="nv" id="nv"></table>
<script type="application/json" id="attnlab-data">{data_json}</script>
<script>{SCRIPT}</script>
</body>
</html>
"""
