"""The inline CSS and plain JavaScript of the attention page (:mod:`attnlab.viz.html`).

The script reads the JSON data block and builds everything with ``createElement(NS)``,
``setAttribute`` and ``textContent`` (never ``innerHTML``), so tokens stay text. The SVG namespace
is read from the page's own ``<svg>`` element; the page names no URL at all.
"""

STYLE = r"""
body { font: 14px/1.4 system-ui, sans-serif; margin: 16px 24px; color: #222; background: #fff; }
h1 { font-size: 20px; margin: 0 0 4px; }
h2 { font-size: 15px; margin: 0; }
.sub { color: #555; margin: 0 0 8px; max-width: 900px; }
.controls { display: flex; flex-wrap: wrap; gap: 12px; align-items: center; margin: 8px 0; }
.tab { border: 1px solid #999; background: #f4f4f4; padding: 3px 10px; cursor: pointer; }
.tab.active { background: #333; color: #fff; }
.heads { display: inline-flex; flex-wrap: wrap; gap: 3px; }
.swatch { display: inline-block; width: 16px; height: 16px; cursor: pointer; border: 2px solid #fff;
          outline: 1px solid #999; }
.swatch.off { opacity: 0.2; }
.notes { color: #8a4b00; margin: 4px 0 8px; padding-left: 18px; max-width: 900px; }
.hv text, .zoom text { font: 13px monospace; fill: #222; cursor: default; }
.zoom text { font-size: 11px; }
.hv text.tok { cursor: pointer; }
.hv text.hl { font-weight: bold; fill: #000; }
.hv text.tok:hover { fill: #000; }
.grid { display: grid; gap: 4px; align-items: center; justify-items: center; justify-content: start; }
.grid .lab { font: 12px monospace; color: #555; }
canvas.thumb { width: 72px; height: 72px; image-rendering: pixelated; border: 1px solid #ccc; cursor: pointer; }
canvas.thumb.sel { border: 2px solid #000; }
.zoom { position: fixed; top: 8px; right: 8px; z-index: 10; max-width: calc(100vw - 16px);
        max-height: calc(100vh - 16px); overflow: auto; box-sizing: border-box; padding: 8px 12px;
        background: #fff; border: 1px solid #999; box-shadow: 0 2px 12px rgba(0, 0, 0, 0.3); }
body.dark { color: #ddd; background: #111; }
body.dark .sub, body.dark .grid .lab, body.dark .value { color: #bbb; }
body.dark .hv text, body.dark .zoom text { fill: #ddd; }
body.dark .hv text.hl, body.dark .hv text.tok:hover { fill: #fff; }
body.dark .tab { background: #333; color: #ddd; }
body.dark .tab.active { background: #ddd; color: #111; }
body.dark .swatch { border-color: #111; }
body.dark .notes { color: #f0b060; }
body.dark canvas.thumb.sel { border-color: #fff; }
body.dark .zoom { background: #111; }
.zoom-head { display: flex; gap: 16px; align-items: center; }
.value { font: 13px monospace; color: #333; }
"""

# The DOM helpers every page script shares (inside its function scope): $(id), clear(node) and
# make(tag, attrs, parent, text), which sets text with textContent only.
DOM_HELPERS = r"""
  function $(id) { return document.getElementById(id); }
  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }
  function make(tag, attrs, parent, text) {
    var e = document.createElement(tag);
    for (var a in attrs) e.setAttribute(a, attrs[a]);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
"""

SCRIPT = r"""
(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("attnlab-data").textContent);
  var SCALE = D.scale, ROW = 20, TOP = 24, GAP = 240, MAXCHARS = 60;
  var SVGNS = document.getElementById("hv-svg").namespaceURI;
  var BG = D.theme === "dark" ? [17, 17, 17] : [255, 255, 255];  // a map's weight 0: the page background
  if (D.theme === "dark") document.body.classList.add("dark");
  var state = { kind: 0, layer: D.layer, heads: [] };
  var lines = [];

""" + DOM_HELPERS + r"""  function svg(tag, attrs, parent, text) {
    var e = document.createElementNS(SVGNS, tag);
    for (var a in attrs) e.setAttribute(a, attrs[a]);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function shorten(t) {  // display form: visible line breaks and blank tokens, long ones cut
    t = t.replace(/\r/g, "\u240d").replace(/\n/g, "\u23ce").replace(/\t/g, "\u21e5");
    if (/^ *$/.test(t)) t = t.replace(/ /g, "\u2423") || "\u2205";
    return t.length > MAXCHARS ? t.slice(0, MAXCHARS - 1) + "\u2026" : t;
  }
  function rgb(hex) { var n = parseInt(hex.slice(1), 16); return [(n >> 16) & 255, (n >> 8) & 255, n & 255]; }
  function K() { return D.kinds[state.kind]; }
  function fillNotes(id, notes) {
    var ul = $(id); clear(ul);
    notes.forEach(function (n) { make("li", {}, ul, n); });
  }
  function colWidth(tokens, n) {
    var m = 1;
    for (var i = 0; i < n; i++) m = Math.max(m, Math.min(tokens[i].length, MAXCHARS));
    return 8 * m + 16;
  }

  // ---- head view -------------------------------------------------------------------
  function drawSwatches() {
    var k = K(), box = $("heads"); clear(box);
    for (var h = 0; h < k.n_heads; h++) {
      var s = make("span", { "class": "swatch" + (state.heads[h] ? "" : " off"), "data-head": h,
                             "title": "head " + h }, box);
      s.style.backgroundColor = k.colors[h];
      s.addEventListener("click", toggleHead.bind(null, h));
      s.addEventListener("dblclick", soloHead.bind(null, h));
    }
  }
  function markSwatches() {
    var s = $("heads").querySelectorAll(".swatch");
    for (var i = 0; i < s.length; i++) s[i].classList.toggle("off", !state.heads[i]);
  }
  function toggleHead(h) { state.heads[h] = !state.heads[h]; markSwatches(); drawHead(); }
  function soloHead(h) {
    for (var i = 0; i < state.heads.length; i++) state.heads[i] = (i === h);
    markSwatches(); drawHead();
  }

  function drawHead() {
    var k = K(), hv = k.head, root = $("hv-svg"); clear(root);
    var wq = colWidth(k.tokens_q, hv.n_q), wk = colWidth(k.tokens_k, hv.n_k);
    var x1 = wq, x2 = wq + GAP, n = Math.max(hv.n_q, hv.n_k);
    root.setAttribute("width", wq + GAP + wk);
    root.setAttribute("height", TOP + n * ROW + 8);
    svg("text", { x: x1, y: 14, "text-anchor": "end" }, root, "query");
    svg("text", { x: x2, y: 14 }, root, "key");
    function y(i) { return TOP + i * ROW + ROW / 2; }
    var g = svg("g", { id: "hv-lines" }, root);
    lines = [];
    var layerLines = hv.lines[state.layer];
    for (var h = 0; h < k.n_heads; h++) {
      if (!state.heads[h]) continue;
      var a = layerLines[h];
      for (var i = 0; i < a.length; i += 3) {
        var w = a[i + 2] / SCALE;
        var el = svg("line", { x1: x1 + 4, y1: y(a[i]), x2: x2 - 4, y2: y(a[i + 1]), stroke: k.colors[h],
                               "stroke-width": 2, "stroke-opacity": w, "data-q": a[i], "data-k": a[i + 1],
                               "data-head": h, "data-w": w }, g);
        lines.push({ el: el, q: a[i], k: a[i + 1], w: w });
      }
    }
    tokenColumn(root, k.tokens_q, hv.n_q, x1 - 4, "end", "q", y);
    tokenColumn(root, k.tokens_k, hv.n_k, x2 + 4, "start", "k", y);
  }
  function tokenColumn(root, tokens, n, x, anchor, side, y) {
    for (var i = 0; i < n; i++) {
      var t = svg("text", { x: x, y: y(i) + 4, "text-anchor": anchor, "class": "tok tok-" + side, "data-i": i },
                  root, shorten(tokens[i]));
      if (tokens[i].length > MAXCHARS) svg("title", {}, t, tokens[i]);  // the whole token as a tooltip
      t.addEventListener("mouseenter", focus.bind(null, side, i));
      t.addEventListener("mouseleave", focus.bind(null, null, -1));
    }
  }
  function focus(side, i) {
    lines.forEach(function (l) {
      var show = side === null || (side === "q" ? l.q === i : l.k === i);
      l.el.setAttribute("stroke-opacity", show ? l.w : 0);
    });
    var toks = $("hv-svg").querySelectorAll("text.tok");
    for (var j = 0; j < toks.length; j++) {
      var t = toks[j], on = side !== null && t.classList.contains("tok-" + side) && +t.getAttribute("data-i") === i;
      t.classList.toggle("hl", on);
    }
  }

  // ---- model view ------------------------------------------------------------------
  function drawGrid() {
    var k = K(), mv = k.model, grid = $("grid"); clear(grid);
    grid.style.gridTemplateColumns = "auto repeat(" + mv.heads.length + ", 76px)";
    make("span", { "class": "lab" }, grid, "");
    mv.heads.forEach(function (h) { make("span", { "class": "lab" }, grid, "head " + h); });
    mv.layers.forEach(function (l, li) {
      make("span", { "class": "lab" }, grid, "layer " + l);
      mv.heads.forEach(function (h, hj) {
        var c = make("canvas", { "class": "thumb", width: mv.cols.length, height: mv.rows.length,
                                 "data-layer": l, "data-head": h, title: "layer " + l + ", head " + h }, grid);
        paint(c, mv.maps[li][hj], rgb(k.colors[h]));
        c.addEventListener("click", zoom.bind(null, li, hj));
      });
    });
    $("zoom").hidden = true;
  }
  function paint(canvas, flat, c) {
    var ctx = canvas.getContext("2d"), img = ctx.createImageData(canvas.width, canvas.height);
    for (var i = 0; i < flat.length; i++) {
      var a = Math.min(1, Math.max(0, flat[i] / SCALE));
      for (var ch = 0; ch < 3; ch++) img.data[4 * i + ch] = Math.round(BG[ch] + a * (c[ch] - BG[ch]));
      img.data[4 * i + 3] = 255;
    }
    ctx.putImageData(img, 0, 0);
  }
  function zoom(li, hj) {
    var k = K(), mv = k.model, l = mv.layers[li], h = mv.heads[hj], box = $("zoom"), root = $("zoom-svg");
    var thumbs = $("grid").querySelectorAll("canvas.thumb");
    for (var t = 0; t < thumbs.length; t++) thumbs[t].classList.remove("sel");
    thumbs[li * mv.heads.length + hj].classList.add("sel");
    box.hidden = false;
    box.setAttribute("data-layer", l);
    box.setAttribute("data-head", h);
    $("zoom-title").textContent = k.label + " \u00b7 layer " + l + " \u00b7 head " + h;
    $("zoom-value").textContent = "";
    clear(root);
    var nr = mv.rows.length, nc = mv.cols.length, cell = Math.max(14, Math.min(28, Math.floor(640 / Math.max(nr, nc))));
    var left = colWidth(mv.rows, nr), top = colWidth(mv.cols, nc);
    root.setAttribute("width", left + nc * cell + 8);
    root.setAttribute("height", top + nr * cell + 8);
    var flat = mv.maps[li][hj];
    for (var r = 0; r < nr; r++) {
      svg("text", { x: left - 4, y: top + r * cell + cell / 2 + 4, "text-anchor": "end" }, root, shorten(mv.rows[r]));
      for (var c = 0; c < nc; c++) {
        var w = flat[r * nc + c] / SCALE;
        var rect = svg("rect", { x: left + c * cell, y: top + r * cell, width: cell, height: cell,
                                 fill: k.colors[h], "fill-opacity": w, "data-q": r, "data-k": c }, root);
        rect.addEventListener("mouseenter", showValue.bind(null, mv.rows[r], mv.cols[c], w));
      }
    }
    for (var j = 0; j < nc; j++) {
      var x = left + j * cell + cell / 2 + 4, y0 = top - 4;
      svg("text", { x: x, y: y0, "text-anchor": "start", transform: "rotate(-90 " + x + " " + y0 + ")" },
          root, shorten(mv.cols[j]));
    }
  }
  function showValue(q, key, w) {
    $("zoom-value").textContent = shorten(q) + " \u2192 " + shorten(key) + ": " + w.toFixed(4);
  }

  // ---- controls ----------------------------------------------------------------------
  function selectKind(i) {
    state.kind = i;
    var k = K();
    state.layer = Math.min(state.layer, k.n_layers - 1);
    state.heads = [];
    for (var h = 0; h < k.n_heads; h++) state.heads.push(!D.heads || D.heads.indexOf(h) >= 0);
    var sel = $("layer"); clear(sel);
    for (var l = 0; l < k.n_layers; l++) {
      if (!D.layers || D.layers.indexOf(l) >= 0) make("option", { value: l }, sel, String(l));
    }
    sel.value = String(state.layer);
    fillNotes("head-notes", k.head.notes);
    fillNotes("model-notes", k.model.notes);
    drawSwatches(); drawHead(); drawGrid();
  }
  function showTab(name) {
    $("head-view").hidden = name !== "head";
    $("model-view").hidden = name !== "model";
    $("tab-head").classList.toggle("active", name === "head");
    $("tab-model").classList.toggle("active", name === "model");
  }

  var kindSel = $("kind");
  D.kinds.forEach(function (k, i) { make("option", { value: i }, kindSel, k.label); });
  kindSel.addEventListener("change", function () { selectKind(+kindSel.value); });
  $("layer").addEventListener("change", function () { state.layer = +$("layer").value; drawHead(); });
  $("all-heads").addEventListener("click", function () {
    for (var h = 0; h < state.heads.length; h++) state.heads[h] = true;
    markSwatches(); drawHead();
  });
  $("tab-head").addEventListener("click", showTab.bind(null, "head"));
  $("tab-model").addEventListener("click", showTab.bind(null, "model"));
  $("zoom-close").addEventListener("click", function () { $("zoom").hidden = true; });
  selectKind(0);
  showTab(D.tab || "head");
})();
"""
