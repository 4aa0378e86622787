"""``attnlab predict``: classify texts (or text pairs) with a sequence-classification model folder or Hub id.

One line per text: the predicted label, its probability, every label's probability, the text —
tab-separated (regression: the value; multi-label: each label's sigmoid, labels ≥ 0.5 listed).
"""
from __future__ import annotations

import argparse

EPILOG = """examples:
  attnlab predict --model runs/classify/model --text "ein Hund läuft im Schnee" --text "a dog runs in the snow"
  attnlab predict --model textattack/bert-base-uncased-SST-2 --text "a gorgeous, witty film"
  attnlab predict --model DIR --text "A man plays a guitar." --text-b "Someone makes music."   # a text pair
The model is an HF-format folder (config.json naming a *ForSequenceClassification architecture, weights,
tokenizer.json) or a Hub id. Output, tab-separated: label, probability, label=probability for each label, text."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``attnlab predict`` (the common flags are added by :mod:`attnlab.cli`)."""
    p.add_argument("--model", required=True, help="sequence-classification model folder or Hub id")
    p.add_argument("--text", action="append", required=True, help="a text to classify (repeat for several)")
    p.add_argument("--text-b", action="append", default=None,
                   help="the second text of a pair, one per --text (repeat in the same order)")
    p.add_argument("--max-length", type=int, default=512, help="tokens per text (pair), longest-first (default 512)")
    p.add_argument("--batch-size", type=int, default=32, help="texts per forward (default 32)")


def format_line(probs, config, text: str) -> str:
    """One output line: ``label<TAB>p<TAB>l0=p0 l1=p1 …<TAB>text`` (see the module docstring)."""
    names = [config.id2label[i] for i in range(config.num_labels)]
    if config.num_labels == 1 or config.problem_type == "regression":
        return "\t".join([names[0] if len(names) == 1 else "value",
                          " ".join(f"{v:.4f}" for v in probs.tolist()), "", text])
    every = " ".join(f"{n}={p:.4f}" for n, p in zip(names, probs.tolist()))
    if config.problem_type == "multi_label_classification":
        chosen = [n for n, p in zip(names, probs.tolist()) if p >= 0.5]
        return "\t".join([",".join(chosen) or "-", f"{max(probs.tolist()):.4f}", every, text])
    i = int(probs.argmax())
    return "\t".join([names[i], f"{float(probs[i]):.4f}", every, text])


def main(args: argparse.Namespace) -> int:
    from attnlab._runtime import model_dtype
    from attnlab.adapt.classify import is_sequence_classifier, logits_of, probabilities
    from attnlab.data.tokenizers import TextTokenizer, load_tokenizer
    from attnlab.models.heads import SEQUENCE_CLASSIFIERS
    from attnlab.models.hub import from_pretrained, resolve_pretrained

    if args.text_b is not None and len(args.text_b) != len(args.text):
        raise ValueError(f"--text-b must be given once per --text: {len(args.text)} --text, "
                         f"{len(args.text_b)} --text-b")
    for flag, v in (("--max-length", args.max_length), ("--batch-size", args.batch_size)):
        if v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")
    folder = resolve_pretrained(args.model)
    model = from_pretrained(folder, dtype=model_dtype(args)).to(args.device or "cpu")
    if not is_sequence_classifier(model):
        names = sorted(c.__name__ for c in SEQUENCE_CLASSIFIERS.values())
        raise ValueError(f"--model {args.model} holds a {type(model).__name__}; predict needs a sequence classifier "
                         f"(config.json's architectures: one of {', '.join(names)})")
    tokenizer = load_tokenizer(folder)
    if not isinstance(tokenizer, TextTokenizer):
        raise ValueError(f"--model {args.model} must hold a subword tokenizer.json, not a character tokenizer")
    logits = logits_of(model, tokenizer, args.text, args.text_b, batch_size=args.batch_size,
                       max_length=args.max_length)
    for row, text in zip(probabilities(logits, model.config), args.text):
        print(format_line(row, model.config, text))
    return 0
