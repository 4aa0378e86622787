"""``attnlab predict``: classify texts (or text pairs) with a sequence-classification model folder or Hub id.

One line per text: the predicted label, its probability, every label's probability, the text —
tab-separated (regression: the value; multi-label: each label's sigmoid, labels ≥ 0.5 listed), with a tab, a new
line, a carriage return and a backslash inside a label or a text written ``\\t``, ``\\n``, ``\\r``, ``\\\\``, so
every line has its four fields whatever the labels hold; or ``--format jsonl``: one JSON object a line.

The texts come from ``--text`` (repeatable) or ``--file PATH`` (one text a line, split at ``\\n`` only, as every
text input: :func:`attnlab._io.text_lines`; ``-`` reads standard input as it comes, ``--batch-size`` lines at a time,
each batch printed before the next is read).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import BinaryIO, Iterable, Iterator

EPILOG = """examples:
  attnlab predict --model runs/classify/model --text "ein Hund läuft im Schnee" --text "a dog runs in the snow"
  attnlab predict --model textattack/bert-base-uncased-SST-2 --text "a gorgeous, witty film"
  attnlab predict --model DIR --text "A man plays a guitar." --text-b "Someone makes music."   # a text pair
  attnlab predict --model DIR --file reviews.txt --format jsonl > predictions.jsonl          # one text a line
  cat reviews.txt | attnlab predict --model DIR --file -                                     # standard input
The model is an HF-format folder (config.json naming a *ForSequenceClassification architecture, weights,
tokenizer.json) or a Hub id. Output, tab-separated: label, probability, label=probability for each label, text
(a tab, new line, carriage return or backslash in a label or text escaped as \\t \\n \\r \\\\); --format jsonl:
{"label", "probability", "probabilities": {label: p}, "text"} a line (regression: "value"; multi-label: "labels")."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``attnlab predict`` (the common flags are added by :mod:`attnlab.cli`)."""
    p.add_argument("--model", required=True, help="sequence-classification model folder or Hub id")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", action="append", help="a text to classify (repeat for several)")
    source.add_argument("--file", metavar="PATH", help="classify each line of this UTF-8 file (- = standard input)")
    p.add_argument("--format", choices=("tsv", "jsonl"), default="tsv",
                   help="tsv: label, probability, every label's, text, escaped (default); "
                        "jsonl: one JSON object a line")
    p.add_argument("--text-b", action="append", default=None,
                   help="the second text of a pair, one per --text (repeat in the same order)")
    p.add_argument("--max-length", type=int, default=512, help="tokens per text (pair), longest-first (default 512)")
    p.add_argument("--batch-size", type=int, default=32, help="texts per forward (default 32)")


_TSV_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def tsv_field(text: str) -> str:
    """``text`` as one TSV field: backslash, tab, new line and carriage return escaped (``\\\\ \\t \\n \\r``)."""
    return str(text).translate(_TSV_ESCAPES)


def format_line(probs, config, text: str) -> str:
    """One output line: ``label<TAB>p<TAB>l0=p0 l1=p1 …<TAB>text``, each label and the text escaped by
    :func:`tsv_field` (see the module docstring)."""
    names = [tsv_field(config.id2label[i]) for i in range(config.num_labels)]
    text = tsv_field(text)
    if config.num_labels == 1 or config.problem_type == "regression":
        return "\t".join([names[0] if len(names) == 1 else "value",
                          " ".join(f"{v:.4f}" for v in probs.tolist()), "", text])
    every = " ".join(f"{n}={p:.4f}" for n, p in zip(names, probs.tolist()))
    if config.problem_type == "multi_label_classification":
        chosen = [n for n, p in zip(names, probs.tolist()) if p >= 0.5]
        return "\t".join([",".join(chosen) or "-", f"{max(probs.tolist()):.4f}", every, text])
    i = int(probs.argmax())
    return "\t".join([names[i], f"{float(probs[i]):.4f}", every, text])


def format_json(probs, config, text: str) -> str:
    """One JSON line: ``{"label", "probability", "probabilities", "text"}`` (regression: ``{"value", "text"}``;
    multi-label: ``"labels"`` ≥ 0.5 in place of ``"label"``), probabilities rounded to 6 decimals."""
    names = [config.id2label[i] for i in range(config.num_labels)]
    values = [round(v, 6) for v in probs.tolist()]
    if config.num_labels == 1 or config.problem_type == "regression":
        record = {"value": values[0] if len(values) == 1 else values}
    elif config.problem_type == "multi_label_classification":
        record = {"labels": [n for n, p in zip(names, values) if p >= 0.5], "probabilities": dict(zip(names, values))}
    else:
        i = int(probs.argmax())
        record = {"label": names[i], "probability": values[i], "probabilities": dict(zip(names, values))}
    return json.dumps({**record, "text": text}, ensure_ascii=False)


def _stdin_lines(stream: BinaryIO) -> Iterator[str]:
    """The lines of ``stream`` as they come, split at ``"\n"`` only, as a file's (:func:`attnlab._io.text_lines`).

    Raises:
        ValueError: a line is not UTF-8 text (naming ``--file -`` and the line).
    """
    for n, raw in enumerate(stream, 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"--file - (standard input) is not UTF-8 text ({e.reason} at byte {e.start} of line "
                             f"{n})") from None
        yield (line.removeprefix("\ufeff") if n == 1 else line).removesuffix("\n")


def _batches(lines: Iterable[str], size: int) -> Iterator[list[str]]:
    """``lines``, ``size`` at a time."""
    batch = []
    for line in lines:
        batch.append(line)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def main(args: argparse.Namespace) -> int:
    from attnlab._runtime import model_dtype
    from attnlab.adapt.classify import is_sequence_classifier, logits_of, probabilities
    from attnlab.data.tokenizers import TextTokenizer, load_tokenizer
    from attnlab.models.heads import SEQUENCE_CLASSIFIERS
    from attnlab.models.hub import from_pretrained, resolve_pretrained

    if args.text_b is not None and args.text is None:
        raise ValueError("--text-b pairs with --text: give the pairs as --text A --text-b B")
    if args.text_b is not None and len(args.text_b) != len(args.text):
        raise ValueError(f"--text-b must be given once per --text: {len(args.text)} --text, "
                         f"{len(args.text_b)} --text-b")
    from attnlab._limits import BATCH_LIMIT, LENGTH_LIMIT, max_positions

    for flag, v, limit in (("--max-length", args.max_length, LENGTH_LIMIT), ("--batch-size", args.batch_size,
                                                                            BATCH_LIMIT)):
        if not 1 <= v <= limit:
            raise ValueError(f"{flag} must be an int in [1, {limit:,}], got {v}")
    folder = resolve_pretrained(args.model)
    model = from_pretrained(folder, dtype=model_dtype(args)).to(args.device or "cpu")
    if not is_sequence_classifier(model):
        names = sorted(c.__name__ for c in SEQUENCE_CLASSIFIERS.values())
        raise ValueError(f"--model {args.model} holds a {type(model).__name__}; predict needs a sequence classifier "
                         f"(config.json's architectures: one of {', '.join(names)})")
    tokenizer = load_tokenizer(folder)
    if not isinstance(tokenizer, TextTokenizer):
        raise ValueError(f"--model {args.model} must hold a subword tokenizer.json, not a character tokenizer")
    fmt = format_json if args.format == "jsonl" else format_line

    positions = max_positions(model.config)  # a longer --max-length cuts at the model's positions
    length = args.max_length if positions is None else min(args.max_length, positions)

    def classify(texts: list[str], pairs) -> None:
        logits = logits_of(model, tokenizer, texts, pairs, batch_size=args.batch_size, max_length=length)
        for row, text in zip(probabilities(logits, model.config), texts):
            print(fmt(row, model.config, text))
        sys.stdout.flush()  # a batch is out before the next is read (a pipe reader sees it as it comes)

    if args.text is not None:
        classify(args.text, args.text_b)
    else:
        from attnlab._io import read_text_arg, text_lines

        lines = _stdin_lines(sys.stdin.buffer) if args.file == "-" else text_lines(read_text_arg("--file", args.file))
        for texts in _batches(lines, args.batch_size):
            classify(texts, None)
    return 0
