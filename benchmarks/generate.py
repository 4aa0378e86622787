"""Greedy decoding speed of GPT-2 small (124M): attnlab ``generate`` against ``transformers.generate``.

Both models hold the same random weights (``GPT2Config()`` defaults, GPT-2's N(0, 0.02) init); one
32-token prompt (batch 1) is continued by 128 greedy tokens, with no EOS, so every run decodes all
128. Tokens/s = 128 / (median wall time of a whole ``generate`` call, prefill included). Ours uses
the preallocated (static) KV cache and :meth:`~attnlab.models.causal_lm.DecoderOnlyLM.optimize_for_inference`:

- ``float32``: the same weights, the q/k/v, FFN-up and LM-head matrices stored column-major;
- ``bfloat16``: weight-only bf16 (every linear layer's weight in bf16, pre-packed for oneDNN;
  embeddings, norms, attention and the KV cache in fp32), compared with ``transformers`` **fp32**.

Every function is timed round-robin in one loop (``_common.compare``), so all rows see the same
machine load: ours fp32, ours bf16, transformers fp32, our two prefills (1 new token) and a copy.

Decoding one token at batch 1 is a chain of matrix–vector products, so it must read every weight
once: the **bandwidth bound** is ``t_min = weight bytes / copy bandwidth``. Weight bytes = every
linear layer's weight and bias (in its stored dtype; the tied LM head reads the token table whole),
the norm parameters, and one row of each embedding table; the bandwidth is that of a 256 MB
``copy_`` counting the bytes read plus written (STREAM's convention). "% of bound" = ``t_min /
t_token`` with ``t_token`` the decode time per token (the whole call's time minus the prefill's,
/ 127). The KV cache reads (≤ 12 MB at 160 positions) are left out of the bound.

Peer 2, **CTranslate2** (the CPU inference engine a user would pick for these models; ``pip install
ctranslate2``, skipped with a note when absent or with ``--no-ct2``): the very same HF checkpoint converted by
its ``TransformersConverter`` to float32 and int8 (a word-level tokenizer over GPT-2's ids is saved beside it, so
token ``i`` is the string ``t{i}``), greedy with ``min_length = max_length`` (every run decodes all tokens), the
same thread count. Our int8 row is :func:`attnlab.adapt.quantize` ``"int8"`` (dynamic: int8 weights and
activations), compared with CTranslate2 int8.

"top1_agree_fp32" (bf16 and int8 rows) is the fraction of the 128 fp32 greedy positions where the bf16 model,
fed the fp32 sequence (teacher forcing), ranks the same token first.

Run: ``python benchmarks/generate.py [--quick] [--threads 2] [--out PATH] [--no-bf16]``.
"""
from __future__ import annotations

import copy
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import compare, parser, print_table, setup, write_json  # noqa: E402

import transformers  # noqa: E402

from attnlab.generation import generate  # noqa: E402
from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel, state_dict_from_hf  # noqa: E402
from attnlab.nn.inference import PackedLinear, decode_weight_bytes as weight_bytes  # noqa: E402

PROMPT, NEW = 32, 128
TARGETS = {"float32": 1.25, "bfloat16": 2.2}  # tokens/s ratio to transformers fp32
INT8_OVER_FP32 = 3.0  # our int8 tokens/s over our fp32
BOUND_TARGET = 75.0  # % of the bandwidth bound, fp32


def copy_fn(mbytes: int):
    """``dst.copy_(src)`` on ``mbytes`` MB, and the bytes it moves (read + written)."""
    n = mbytes * 10**6 // 4
    src, dst = torch.randn(n), torch.empty(n)
    return (lambda: dst.copy_(src)), 2 * n * 4


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


def ct2_generators(theirs, threads: int, folder: Path) -> dict:
    """CTranslate2 float32 and int8 generators converted from ``theirs`` (saved with a word-level tokenizer whose
    token ``i`` is ``t{i}``); empty when ctranslate2 is not installed."""
    try:
        import ctranslate2
    except ImportError:
        return {}
    from tokenizers import Tokenizer, models as tok_models
    from transformers import PreTrainedTokenizerFast

    n = theirs.config.vocab_size
    vocab = {f"t{i}": i for i in range(n - 1)} | {"<|endoftext|>": n - 1}
    end = "<|endoftext|>"
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tok_models.WordLevel(vocab, unk_token=end)),
                                  bos_token=end, eos_token=end, unk_token=end)
    theirs.save_pretrained(folder / "hf")
    tok.save_pretrained(folder / "hf")
    out = {}
    for q in ("float32", "int8"):
        ctranslate2.converters.TransformersConverter(str(folder / "hf")).convert(str(folder / q), quantization=q,
                                                                                 force=True)
        out[q] = ctranslate2.Generator(str(folder / q), device="cpu", compute_type=q, intra_threads=threads,
                                       inter_threads=1)
    return out


def run_ct2(gen, ids: torch.Tensor, new: int) -> torch.Tensor:
    """Greedy decoding of exactly ``new`` tokens; the prompt and the new ids as one ``(1, T + new)`` tensor."""
    start = [f"t{i}" for i in ids[0].tolist()]
    r = gen.generate_batch([start], max_length=new, min_length=new, sampling_topk=1, beam_size=1,
                           include_prompt_in_result=False, end_token=[])
    return torch.cat([ids[0], torch.tensor(r[0].sequences_ids[0])]).unsqueeze(0)


def top1_agreement(model, seq: torch.Tensor, ref_next: torch.Tensor) -> float:
    """Fraction of positions where ``model``'s argmax on ``seq`` (teacher forced) equals ``ref_next``."""
    with torch.inference_mode():
        logits = model(seq[:, :-1]).logits[:, -ref_next.shape[1]:]
    return float((logits.argmax(-1) == ref_next).float().mean())


def main() -> None:
    p = parser(__doc__.splitlines()[0], "generate.json")
    p.add_argument("--no-bf16", action="store_true", help="skip the bfloat16 row")
    p.add_argument("--no-ct2", action="store_true", help="skip the CTranslate2 peer")
    args = p.parse_args()
    setup(args)
    transformers.logging.set_verbosity_error()
    config = GPT2Config(n_layer=2) if args.quick else GPT2Config()
    new, repeat = (16, 2) if args.quick else (NEW, 5)
    base, theirs = models(config)
    ids = torch.randint(0, config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    copy_run, copy_bytes = copy_fn(64 if args.quick else 256)

    ours = {"float32": copy.deepcopy(base).optimize_for_inference(dtype=torch.float32)}
    from attnlab._runtime import resolve_dtype

    native_bf16 = resolve_dtype("auto", "cpu")[0] == "bf16"
    if not args.no_bf16 and not native_bf16:
        print(f"bfloat16 row skipped: {resolve_dtype('auto', 'cpu')[1]} (emulated bf16 is many times slower; "
              "auto chooses fp32 here)")
    if not args.no_bf16 and native_bf16:
        ours["bfloat16"] = copy.deepcopy(base).optimize_for_inference(dtype=torch.bfloat16)
    from attnlab.adapt.quantize import quantize

    ours["int8"] = quantize(copy.deepcopy(base), "int8")  # its Int8Linear layers replace nn.Linear
    del base
    ref = run_theirs(theirs, ids, new)
    fns = {"theirs": lambda: run_theirs(theirs, ids, new), "copy": copy_run}
    tmp = tempfile.TemporaryDirectory()
    ct2 = {} if args.no_ct2 else ct2_generators(theirs, args.threads, Path(tmp.name))
    if not args.no_ct2 and not ct2:
        print("CTranslate2 is not installed (pip install ctranslate2): its rows are skipped")
    for q, g in ct2.items():
        fns[f"ct2 {q}"] = lambda g=g: run_ct2(g, ids, new)
    for dt, m in ours.items():
        fns[dt] = lambda m=m: run_ours(m, ids, new)
        fns[f"{dt} prefill"] = lambda m=m: run_ours(m, ids, 1)
    ms = compare(fns, repeat=repeat, warmup=1)
    bw = copy_bytes / (ms["copy"] * 1e-3) / 1e9

    rows = []
    for dt, m in ours.items():
        per_token_ms = (ms[dt] - ms[f"{dt} prefill"]) / (new - 1)
        bound_ms = weight_bytes(m) / (bw * 1e9) * 1e3
        ratio = ms["theirs"] / ms[dt]
        tokens = run_ours(m, ids, new)
        peer = {"float32": "ct2 float32", "int8": "ct2 int8"}.get(dt)
        ct2_ms = ms.get(peer)
        over_fp32 = ms["float32"] / ms[dt]
        target = INT8_OVER_FP32 if dt == "int8" else TARGETS[dt]
        row = {"dtype": dt, "ours_tok_s": new / (ms[dt] * 1e-3), "theirs_fp32_tok_s": new / (ms["theirs"] * 1e-3),
               "ratio": ratio, "x_our_fp32": over_fp32, "target": target,
               "met": (over_fp32 if dt == "int8" else ratio) >= target,
               "ct2_tok_s": None if ct2_ms is None else new / (ct2_ms * 1e-3),
               "ratio_ct2": None if ct2_ms is None else ct2_ms / ms[dt], "ms_per_token": per_token_ms,
               "copy_gbs": bw, "weight_mb": weight_bytes(m) / 1e6, "bound_ms": bound_ms,
               "pct_of_bound": 100 * bound_ms / per_token_ms, "tokens_equal_theirs": bool(torch.equal(tokens, ref))}
        if dt in ("bfloat16", "int8"):
            row["top1_agree_fp32"] = top1_agreement(m, ref, ref[:, PROMPT:])
        if peer is not None and peer.split()[1] in ct2:
            row["ct2_tokens_equal_theirs"] = bool(torch.equal(run_ct2(ct2[peer.split()[1]], ids, new), ref))
        rows.append(row)

    print(f"GPT-2 {'(2 layers, quick)' if args.quick else '124M'}: prompt {PROMPT}, {new} new tokens, batch 1, "
          f"greedy, static cache; copy bandwidth of {copy_bytes // 2 // 10**6} MB, read + write; "
          f"threads {args.threads}; peers: transformers {transformers.__version__} fp32"
          + (f", CTranslate2 {__import__('ctranslate2').__version__} (same dtype)" if ct2 else ""))
    print("target: ratio to transformers fp32 (fp32 >= 1.25, bf16 >= 2.2); int8: x_our_fp32 >= 3")
    print_table(rows, ["dtype", "ours_tok_s", "theirs_fp32_tok_s", "ratio", "x_our_fp32", "target", "met", "ct2_tok_s",
                       "ratio_ct2",
                       "ms_per_token", "weight_mb", "copy_gbs", "bound_ms", "pct_of_bound", "tokens_equal_theirs",
                       "ct2_tokens_equal_theirs", "top1_agree_fp32"])
    fp32 = rows[0]
    met = {"fp32 ratio >= 1.25": fp32["met"], f"fp32 % of bound >= {BOUND_TARGET:.0f}": fp32["pct_of_bound"] >= BOUND_TARGET}
    for r in rows[1:]:
        what = "x our fp32" if r["dtype"] == "int8" else "ratio"
        met[f"{r['dtype']} {what} >= {r['target']}"] = r["met"]
    for r in rows:
        if r["ratio_ct2"] is not None:
            met[f"{r['dtype']} >= {1.0 if r['dtype'] == 'float32' else 1.5}x CTranslate2"] = \
                r["ratio_ct2"] >= (1.0 if r["dtype"] == "float32" else 1.5)
    print("targets met:", ", ".join(f"{k}: {v}" for k, v in met.items()))
    write_json(args.out, rows, quick=args.quick, prompt=PROMPT, new_tokens=new, repeat=repeat,
               transformers=transformers.__version__, targets=met)


if __name__ == "__main__":
    main()
