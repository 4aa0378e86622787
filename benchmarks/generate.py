"""Greedy decoding speed of GPT-2 small (124M): attnlab ``generate`` against ``transformers.generate``.

Both models hold the same random weights (``GPT2Config()`` defaults, GPT-2's N(0, 0.02) init); one
32-token prompt (batch 1) is continued by 128 greedy tokens, with no EOS, so every run decodes all
128. Tokens/s = 128 / (median wall time of a whole ``generate`` call, prefill included); the two
are timed round-robin. Ours uses the preallocated (static) KV cache.

Decoding one token at batch 1 is a chain of matrix–vector products, so it must read every weight
once: the **bandwidth bound** is ``t_min = weight bytes / copy bandwidth``, where the weight bytes
are all parameters but the position table (of which one row is read; the tied token table is read
whole by the LM head), and the bandwidth is that of a 256 MB ``copy_`` timed round-robin with the
``generate`` calls (so it sees the same machine load), counting the bytes read plus written
(STREAM's convention). "% of bound" = ``t_min / t_token``
with ``t_token`` the decode time per token (the whole call's time minus the prefill's, / 127).
The KV cache reads (≤ 12 MB at 160 positions) are left out of the bound.

bf16 rows (one timed run each: bf16 matrix products are slow on CPUs without native bf16): the same models cast with ``model.to(torch.bfloat16)``; "top-1 agree" is the fraction of
the 128 fp32 greedy positions where the bf16 model, fed the fp32 sequence (teacher forcing), ranks
the same token first.

Run: ``python benchmarks/generate.py [--quick] [--threads 2] [--out PATH] [--no-bf16]``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import compare, parser, print_table, setup, write_json  # noqa: E402

import transformers  # noqa: E402

from attnlab.generation import generate  # noqa: E402
from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel, state_dict_from_hf  # noqa: E402

PROMPT, NEW = 32, 128


def copy_fn(mbytes: int):
    """``dst.copy_(src)`` on ``mbytes`` MB, and the bytes it moves (read + written)."""
    n = mbytes * 10**6 // 4
    src, dst = torch.randn(n), torch.empty(n)
    return (lambda: dst.copy_(src)), 2 * n * 4


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes read per decoded token: every unique parameter except the position table (one row)."""
    unique = {p.data_ptr(): p for p in model.parameters()}.values()
    total = sum(p.numel() * p.element_size() for p in unique)
    wpe = model.wpe.weight
    return total - wpe.numel() * wpe.element_size() + wpe.shape[1] * wpe.element_size()


def models(config: GPT2Config):
    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(**config.to_hf())
    theirs = transformers.GPT2LMHeadModel(hf_config).eval()
    theirs.generation_config.eos_token_id = None  # decode all NEW tokens
    theirs.generation_config.pad_token_id = None
    ours = GPT2LMHeadModel(config).eval()
    ours.load_state_dict(state_dict_from_hf(theirs.state_dict()))
    return ours, theirs


def run_ours(model, ids, new):
    return generate(model, ids, max_new_tokens=new, cache="static")


def run_theirs(model, ids, new):
    with torch.inference_mode():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                              num_beams=1)


def top1_agreement(model, seq: torch.Tensor, ref_next: torch.Tensor) -> float:
    """Fraction of positions where ``model``'s argmax on ``seq`` (teacher forced) equals ``ref_next``."""
    with torch.inference_mode():
        logits = model(seq[:, :-1]).logits[:, -ref_next.shape[1]:]
    return float((logits.argmax(-1) == ref_next).float().mean())


def main() -> None:
    p = parser(__doc__.splitlines()[0], "generate.json")
    p.add_argument("--no-bf16", action="store_true", help="skip the bfloat16 rows")
    args = p.parse_args()
    setup(args)
    transformers.logging.set_verbosity_error()
    config = GPT2Config(n_layer=2) if args.quick else GPT2Config()
    new, repeat = (16, 2) if args.quick else (NEW, 5)
    ours, theirs = models(config)
    ids = torch.randint(0, config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    copy, copy_bytes = copy_fn(64 if args.quick else 256)

    ref = run_ours(ours, ids, new)
    same_as_theirs = bool(torch.equal(ref, run_theirs(theirs, ids, new)))
    rows = []
    for dtype in ([torch.float32] if args.no_bf16 else [torch.float32, torch.bfloat16]):
        ours.to(dtype)
        theirs.to(dtype)
        ms = compare({"ours": lambda: run_ours(ours, ids, new), "theirs": lambda: run_theirs(theirs, ids, new),
                      "prefill": lambda: run_ours(ours, ids, 1), "copy": copy},
                     repeat=repeat if dtype == torch.float32 else 1, warmup=1 if dtype == torch.float32 else 0)
        bw = copy_bytes / (ms["copy"] * 1e-3) / 1e9
        per_token_ms = (ms["ours"] - ms["prefill"]) / (new - 1)
        bound_ms = weight_bytes(ours) / (bw * 1e9) * 1e3
        row = {
            "dtype": str(dtype).removeprefix("torch."), "ours_tok_s": new / (ms["ours"] * 1e-3),
            "theirs_tok_s": new / (ms["theirs"] * 1e-3), "ratio": ms["theirs"] / ms["ours"], "copy_gbs": bw,
            "ms_per_token": per_token_ms, "bound_ms": bound_ms, "pct_of_bound": 100 * bound_ms / per_token_ms,
            "weight_mb": weight_bytes(ours) / 1e6, "tokens_equal_theirs": same_as_theirs,
        }
        if dtype == torch.bfloat16:
            row["top1_agree_fp32"] = top1_agreement(ours, ref, ref[:, PROMPT:])
            row["tokens_equal_theirs"] = bool(torch.equal(run_ours(ours, ids, new), run_theirs(theirs, ids, new)))
        rows.append(row)
    ours.float()

    print(f"GPT-2 {'(2 layers, quick)' if args.quick else '124M'}: prompt {PROMPT}, {new} new tokens, batch 1, "
          f"greedy; copy bandwidth of {copy_bytes // 2 // 10**6} MB, read + write; threads {args.threads}")
    print_table(rows, ["dtype", "ours_tok_s", "theirs_tok_s", "ratio", "ms_per_token", "copy_gbs", "bound_ms",
                       "pct_of_bound",
                       "tokens_equal_theirs", "top1_agree_fp32"])
    fp32 = rows[0]
    met = {"ratio >= 1.25": fp32["ratio"] >= 1.25, "% of bound >= 75": fp32["pct_of_bound"] >= 75}
    print("targets met:", ", ".join(f"{k}: {v}" for k, v in met.items()))
    write_json(args.out, rows, quick=args.quick, prompt=PROMPT, new_tokens=new, targets=met)


if __name__ == "__main__":
    main()
