"""``attnlab analyze``: per-head statistics of a model on some texts, as a table, JSON and a plot.

The model is any directory :func:`attnlab.from_pretrained` loads (BERT-style encoders, decoder-only LMs,
T5 and BART — their encoder's self-attention — and the task heads on them), with its ``tokenizer.json`` beside
the weights (read with ``tokenizers``).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional, Sequence

import torch

from attnlab._io import check_output_dir, read_text_arg, text_lines
from attnlab._limits import check_forward_memory, max_positions
from attnlab.data.tokenizers import CharTokenizer, TextTokenizer, load_tokenizer
from attnlab.evaluation.analysis import AttentionAnalysis, Batch, analyze, plot_analysis


def encode_texts(tokenizer, texts: Sequence[str], *, max_length: Optional[int] = None) -> Batch:
    """Encode ``texts`` with a ``tokenizers.Tokenizer`` (its post-processor adds [CLS]/[SEP] etc.),
    right-padded; ``max_length`` truncates (default: the tokenizer's own truncation, if any). The
    caller's tokenizer is not modified (a copy is configured).

    Raises:
        ValueError: no texts, an empty text, or a text that encodes to no tokens.
    """
    if isinstance(texts, str) or not texts:
        raise ValueError("texts must be a non-empty list of strings")
    if any(not isinstance(t, str) or not t.strip() for t in texts):
        raise ValueError("texts must not contain empty strings")
    if isinstance(tokenizer, CharTokenizer):  # our character-level models: no special tokens
        ids = [tokenizer.encode(t)[:max_length] for t in texts]
        L = max(len(i) for i in ids)
        out = torch.zeros(2, len(ids), L, dtype=torch.long)
        for b, row in enumerate(ids):
            out[0, b, :len(row)] = torch.tensor(row)
            out[1, b, :len(row)] = 1
        return Batch(out[0], out[1], torch.zeros_like(out[0], dtype=torch.bool))
    if isinstance(tokenizer, TextTokenizer):
        tokenizer = tokenizer.tokenizer
    tokenizer = type(tokenizer).from_str(tokenizer.to_str())
    if max_length is not None:
        tokenizer.enable_truncation(max_length)
    tokenizer.no_padding()
    encs = tokenizer.encode_batch(list(texts))
    if any(len(e.ids) == 0 for e in encs):
        raise ValueError("a text encodes to no tokens")
    L = max(len(e.ids) for e in encs)
    out = torch.zeros(3, len(encs), L, dtype=torch.long)
    for b, e in enumerate(encs):
        n = len(e.ids)
        out[0, b, :n] = torch.tensor(e.ids)
        out[1, b, :n] = 1
        out[2, b, :n] = torch.tensor(e.special_tokens_mask)
    return Batch(out[0], out[1], out[2].bool())


def read_texts(texts: Optional[list[str]], file: Optional[str]) -> list[str]:
    """``--text`` values, then the non-empty lines of ``--file``.

    Raises:
        FileNotFoundError: ``file`` does not exist.
        ValueError: no text at all.
    """
    out = [t for t in (texts or []) if t.strip()]
    if file is not None:
        out += [line.strip() for line in text_lines(read_text_arg("--file", file)) if line.strip()]
    if not out:
        raise ValueError("give at least one non-empty --text or a --file with one text per line")
    return out


def format_table(result: AttentionAnalysis) -> str:
    """The per-head table as plain text (what :func:`print_table` shows without ``rich``)."""
    cols, rows = _table(result)
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def _table(result: AttentionAnalysis) -> tuple[list[str], list[list[str]]]:
    cols = ["layer", "head", "entropy", "distance", "→first", "→special", "most similar"]
    if result.prune_delta is not None:
        cols.append("Δloss pruned")
    rows = []
    for r in result.rows():
        sim = "-" if r["similar_head"] is None else f"h{r['similar_head']} ({r['similarity']:.2f})"
        row = [str(r["layer"]), str(r["head"]), f"{r['entropy']:.3f}", f"{r['distance']:.2f}",
               f"{r['first']:.3f}", f"{r['special']:.3f}", sim]
        if result.prune_delta is not None:
            row.append(f"{r['prune_delta']:+.4f}")
        rows.append(row)
    return cols, rows


def print_table(result: AttentionAnalysis, title: str) -> None:
    """Print the per-head table (with ``rich`` when installed)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print(format_table(result))
        return
    cols, rows = _table(result)
    table = Table(title=title)
    for c in cols:
        table.add_column(c, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(*r)
    console = Console()
    console.width = max(console.width, 110)  # the full table rather than wrapped headers on a narrow terminal
    console.print(table)


EPILOG = """examples:
  attnlab analyze --model path/to/all-MiniLM-L6-v2 --text "The quick brown fox jumps over the lazy dog."
  attnlab analyze --model gpt2-dir --file texts.txt --out runs/analysis   # + analysis.json, analysis.png
  attnlab analyze --model bert-dir --text "a" --text "b" --similarity js --no-prune"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``attnlab analyze`` (the common flags are added by :mod:`attnlab.cli`)."""
    p.add_argument("--model", required=True,
                   help="HF-format model directory (config.json, weights, tokenizer.json) or Hub id org/name")
    p.add_argument("--text", action="append", help="a text to analyse (repeatable)")
    p.add_argument("--file", default=None, help="a UTF-8 file with one text per line")
    p.add_argument("--out", default=None, help="folder for analysis.json and analysis.png (default: print only)")
    p.add_argument("--similarity", choices=("cosine", "js"), default="cosine",
                   help="head-pattern similarity: cosine of the maps or 1 - Jensen-Shannon of the rows")
    p.add_argument("--no-prune", action="store_true", help="skip the per-head pruning loss (layers x heads passes)")
    p.add_argument("--max-length", type=int, default=None, help="truncate texts to this many tokens")


def main(args: argparse.Namespace) -> int:
    """Run the analysis; print the table; with ``--out`` write ``analysis.json`` and ``analysis.png``."""
    from attnlab._io import atomic_write
    from attnlab.models.hub import from_pretrained, resolve_pretrained

    if args.max_length is not None and args.max_length < 2:
        raise ValueError(f"--max-length must be >= 2, got {args.max_length}")
    if args.out:
        check_output_dir("--out", args.out, inputs=[("--model", args.model), ("--file", args.file)])
    texts = read_texts(args.text, args.file)
    folder = resolve_pretrained(args.model)  # a folder, or a Hub id's snapshot
    from attnlab._runtime import model_dtype

    model = from_pretrained(folder, dtype=model_dtype(args)).to(args.device or "cpu")
    if hasattr(getattr(model, "config", None), "image_size"):
        raise ValueError(f"--model {args.model} holds a {type(model).__name__}, which reads pictures, not texts: "
                         "see its attention with attnlab viz --model ... --image FILE")
    tok = load_tokenizer(folder)
    seed = args.seed or 0
    torch.manual_seed(seed)
    batch = encode_texts(tok, texts, max_length=args.max_length)
    n, length = batch.input_ids.shape
    given = "--file" if args.file else "--text"
    positions = max_positions(model.config)
    if positions is not None and length > positions:
        raise ValueError(f"{given}: a text holds {length} tokens; the model takes at most {positions}: "
                         f"give --max-length {positions} to cut the texts")
    check_forward_memory(f"{given} ({n} texts of up to {length} tokens)", model.config, batch=n, seq=length,
                         maps=True, device=args.device or "cpu")  # every layer's weights are kept
    result = analyze(model, batch, similarity=args.similarity, prune=not args.no_prune,
                     mask_token_id=tok.token_to_id("[MASK]"), seed=seed)
    stack = " of encoder self-attention" if hasattr(model, "encoder") and hasattr(model, "encode") else ""
    title = (f"{type(model).__name__}: {result.shape[0]} layers × {result.shape[1]} heads{stack}, "
             f"{result.num_texts} text(s), {result.num_tokens} tokens")
    print_table(result, title)
    if result.prune_delta is not None:
        print(f"loss: {result.loss_name}; unpruned {result.base_loss:.4g}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        data = {"model": str(args.model), "architecture": type(model).__name__, "texts": texts, **result.to_dict()}
        atomic_write(out / "analysis.json",
                      lambda tmp: Path(tmp).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8"))
        plot_analysis(result, out / "analysis.png", title=title)
        print(f"wrote {out / 'analysis.json'} and {out / 'analysis.png'}")
    return 0
