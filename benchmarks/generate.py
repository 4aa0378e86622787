"""Greedy decoding speed of GPT-2 124M and a ~111M Llama: attnlab ``generate`` against ``transformers`` and
CTranslate2.

Each family (``--family gpt2|llama|all``) is one random Hugging Face checkpoint read by all three libraries
(ours through :func:`attnlab.from_pretrained`; see ``_generate_peers.py`` for the configs). Three scenarios
(``--scenario``), each continued by 128 greedy tokens with no EOS, so every run decodes all of them:

- ``b1 p32``: one 32-token prompt (batch 1), the single-stream case;
- ``b8 p32``: 8 different 32-token prompts in one batch (equal lengths, no padding): batched decode;
- ``b1 p512``: one 512-token prompt: prefill throughput, then decode with a long cache.

Tokens/s = batch · 128 / (median wall time of a whole ``generate`` call, prefill included). Each peer is also
timed for 1 new token (its "prefill": the prompt's forward pass and one argmax): prefill tokens/s = batch ·
prompt / that time; decode tokens/s = batch · 127 / (whole call − prefill). Ours uses the preallocated
(static) KV cache and :meth:`~attnlab.models.causal_lm.DecoderOnlyLM.optimize_for_inference`, except ``plain``:

- ``plain``: the model as loaded, no optimize call: ``generate``'s own fast path
  (:func:`attnlab.nn.inference.decode_view`: the float32 weights read in place by attnlab's matvec);
- ``float32``: the same weights; decoding steps multiply by attnlab's C++ matvec (:mod:`attnlab._native`,
  where it is built; oneDNN's packed inner product otherwise), prefill by ``F.linear``;
- ``bfloat16`` (only where the CPU computes it natively): weight-only bf16, compared with transformers **fp32**;
- ``int8``: :func:`attnlab.adapt.quantize` ``"int8"``: int8 weights; decoding steps in attnlab's int8 matvec
  (activations rounded to int16 per row), prefill in fbgemm's dynamic int8 or ``torch._int_mm`` (activations int8
  per row; the ``int8_linear`` choice, probed by ``quantize`` before any timing);
- ``int4``: :func:`attnlab.adapt.quantize` ``"int4"``: int4 weights in groups of 64 (embeddings too); decoding
  steps in attnlab's int4 matvec (activations rounded to int16 per row), prefill on panels of the dequantised
  weights (float32). CTranslate2 has no int4 on the CPU: its columns in this row are CTranslate2's int8.

``ATTNLAB_NATIVE=0`` runs ours without attnlab's C++ kernels (PyTorch's only), for the same table before them.

**CTranslate2** (``pip install ctranslate2``; skipped with a note when absent or with ``--no-ct2``) converts the
same checkpoint by its ``TransformersConverter`` to float32 and int8, decodes greedily with ``min_length =
max_length``, all prompts in one ``generate_batch``, with the same thread count; its columns sit in our row
of the same dtype. Every function of a scenario (ours, transformers, CTranslate2, whole calls and prefills, and a
copy) is timed round-robin in one loop (``_common.compare``), so all see the same machine load. CTranslate2 runs
in a child process of its own (``_generate_peers.CT2Process``): its OpenMP runtime beside torch's in one process
slowed both (our int8 step 7.8 → 11 ms once it had run), which no user running either library meets; where torch
runs AVX2 kernels it is held to AVX2 too (``CT2_FORCE_CPU_ISA=AVX2``).

A decoding step reads every weight once, so its **bandwidth bound** is ``t_min = weight bytes / copy
bandwidth`` (weight bytes: :func:`~attnlab.nn.inference.decode_weight_bytes`; bandwidth: a 256 MB ``copy_``
counting bytes read plus written, STREAM's convention). "% of bound" = ``t_min / t_step`` with ``t_step`` =
(whole call − prefill) / 127, one step for the whole batch. The KV cache is left out of the bound; ``kv_mb``
shows what a step reads of it on average (float32 keys and values at prompt + 64 positions).

"tokens_equal_theirs": our tokens (every stream) equal transformers' greedy tokens. "top1_agree_fp32" (bf16
and int8 rows): the fraction of transformers' greedy positions where the model, fed that sequence (teacher
forcing), ranks the same token first.

Targets, both families. ``b1 p32``: plain and fp32 ≥ 1.25× transformers, ≥ 1.0× CTranslate2 fp32, ≥ 75 % of the bound;
bf16 ≥ 2.2× transformers fp32; int8 ≥ 3× our fp32 and ≥ 1.5× CTranslate2 int8; int4 (ours: it pays only if
it beats our int8) ≥ 1.0× our int8 (``x_our_int8``). ``b8 p32`` and ``b1 p512``
(no loss hidden by the single-stream win): ≥ 1.0× transformers fp32 and ≥ 1.0× CTranslate2 (same dtype; int4:
none, its CTranslate2 columns are reported only) in tokens/s; ``b1 p512`` also in prefill tokens/s.

Run: ``python benchmarks/generate.py [--quick] [--family gpt2|llama|all] [--scenario b1p32|b8p32|b1p512|all]
[--threads 2] [--out PATH] [--no-bf16] [--no-ct2]``. ``--quick``: tiny models, 8 new tokens, 2 timed rounds.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import compare, parser, print_table, setup, write_json  # noqa: E402
from _generate_peers import (Family, build, copy_fn, describe, run_ct2, run_ours, run_theirs,  # noqa: E402
                             top1_agreement)

import transformers  # noqa: E402

from attnlab.nn.inference import decode_weight_bytes as weight_bytes  # noqa: E402

NEW = 128
SCENARIOS = {"b1 p32": (1, 32), "b8 p32": (8, 32), "b1 p512": (1, 512)}  # (batch, prompt)
SINGLE_STREAM = {"plain": {"ratio": 1.25}, "float32": {"ratio": 1.25, "ratio_ct2": 1.0, "pct_of_bound": 75.0},
                 "bfloat16": {"ratio": 2.2}, "int8": {"x_our_fp32": 3.0, "ratio_ct2": 1.5}, "int4": {"x_our_int8": 1.0}}
NO_LOSS = {"ratio": 1.0, "ratio_ct2": 1.0}
PREFILL_NO_LOSS = {"prefill_ratio": 1.0, "prefill_ratio_ct2": 1.0}
COLUMNS = ["scenario", "dtype", "ours_tok_s", "theirs_fp32_tok_s", "ratio", "ct2_tok_s", "ratio_ct2",
           "prefill_tok_s", "prefill_ratio", "prefill_ratio_ct2", "decode_tok_s", "x_our_fp32", "x_our_int8",
           "pct_of_bound",
           "met", "tokens_equal_theirs", "ct2_tokens_equal_theirs", "top1_agree_fp32"]
BOUND_COLUMNS = ["scenario", "dtype", "ms_per_step", "weight_mb", "kv_mb", "copy_gbs", "bound_ms", "pct_of_bound"]


def targets(scenario: str, dtype: str) -> dict[str, float]:
    """``{row field: least value}`` for one row (see the module docstring)."""
    if scenario == "b1 p32":
        return SINGLE_STREAM[dtype]
    no_loss = NO_LOSS | (PREFILL_NO_LOSS if scenario == "b1 p512" else {})
    if dtype in ("int4", "plain"):  # CTranslate2's columns are reported, not targets: int4's are another dtype's
        # (int8), and plain's race a converted model without the optimize call
        return {k: v for k, v in no_loss.items() if "ct2" not in k}
    return no_loss


def our_models(fam: Family, no_bf16: bool) -> dict[str, torch.nn.Module]:
    """Our plain (as loaded, no optimize call), fp32, bf16 (native only, unless ``no_bf16``), int8 and int4 models,
    from the loaded fp32 one."""
    import copy

    from attnlab._runtime import resolve_dtype
    from attnlab.adapt.quantize import quantize

    base = fam.ours
    ours = {"plain": copy.deepcopy(base).eval(),  # generate's default path (it probes the kernels as optimize does)
            "float32": copy.deepcopy(base).optimize_for_inference(dtype=torch.float32)}
    native_bf16, reason = resolve_dtype("auto", "cpu")
    if not no_bf16 and native_bf16 == "bf16":
        ours["bfloat16"] = copy.deepcopy(base).optimize_for_inference(dtype=torch.bfloat16)
    elif not no_bf16:
        print(f"{fam.name}: bfloat16 row skipped: {reason} (emulated bf16 is many times slower; auto chooses fp32)")
    ours["int8"] = quantize(base, "int8")  # a copy whose Int8Linear layers replace nn.Linear
    ours["int4"] = quantize(base, "int4")  # Int4Linear and Int4Embedding, groups of 64
    return ours


def time_scenario(fam: Family, ours: dict, ids: torch.Tensor, new: int, copy_run, repeat: int) -> dict[str, float]:
    """Median ms of every peer's whole call and prefill (1 new token) on ``ids``, and of the copy, round-robin."""
    fns = {"theirs": lambda: run_theirs(fam.theirs, ids, new), "theirs prefill": lambda: run_theirs(fam.theirs, ids, 1)}
    for q, g in fam.ct2.items():
        fns[f"ct2 {q}"] = lambda g=g: run_ct2(g, fam.names, ids, new)
        fns[f"ct2 {q} prefill"] = lambda g=g: run_ct2(g, fam.names, ids, 1)
    for dt, m in ours.items():
        fns[dt] = lambda m=m: run_ours(m, ids, new)
        fns[f"{dt} prefill"] = lambda m=m: run_ours(m, ids, 1)
    fns["copy"] = copy_run
    return compare(fns, repeat=repeat, warmup=1)


def scenario_rows(fam: Family, ours: dict, scenario: str, new: int, ms: dict, copy_bytes: int,
                  ids: torch.Tensor, ref: torch.Tensor) -> list[dict]:
    """One row per dtype of ours: speeds, ratios to the peers, bound, token checks, targets."""
    B, P = ids.shape
    bw = copy_bytes / (ms["copy"] * 1e-3) / 1e9  # GB/s

    def per_s(n, t_ms):
        return None if t_ms is None else n / (t_ms * 1e-3)

    def over(a, b):
        return None if a is None or b is None else a / b

    rows = []
    for dt, m in ours.items():
        ct2_dt = {"int4": "int8", "plain": "float32"}.get(dt, dt)  # (CTranslate2 has no int4 on the CPU)
        peer = f"ct2 {ct2_dt}" if ct2_dt in fam.ct2 else None
        ct2_ms, ct2_prefill = (ms[peer], ms[f"{peer} prefill"]) if peer else (None, None)
        step_ms = (ms[dt] - ms[f"{dt} prefill"]) / (new - 1)
        bound_ms = weight_bytes(m) / (bw * 1e9) * 1e3
        row = {"family": fam.name, "scenario": scenario, "batch": B, "prompt": P, "dtype": dt,
               "ours_tok_s": per_s(B * new, ms[dt]), "theirs_fp32_tok_s": per_s(B * new, ms["theirs"]),
               "ratio": ms["theirs"] / ms[dt], "ct2_tok_s": per_s(B * new, ct2_ms), "ratio_ct2": over(ct2_ms, ms[dt]),
               "prefill_tok_s": per_s(B * P, ms[f"{dt} prefill"]),
               "theirs_prefill_tok_s": per_s(B * P, ms["theirs prefill"]),
               "ct2_prefill_tok_s": per_s(B * P, ct2_prefill),
               "prefill_ratio": ms["theirs prefill"] / ms[f"{dt} prefill"],
               "prefill_ratio_ct2": over(ct2_prefill, ms[f"{dt} prefill"]),
               "decode_tok_s": per_s(B, step_ms) if step_ms > 0 else None, "x_our_fp32": ms["float32"] / ms[dt],
               "x_our_int8": ms["int8"] / ms[dt] if dt == "int4" else None,
               "ms_per_step": step_ms, "weight_mb": weight_bytes(m) / 1e6,
               "kv_mb": fam.kv_bytes(B, P + new / 2) / 1e6, "copy_gbs": bw, "bound_ms": bound_ms,
               "pct_of_bound": 100 * bound_ms / step_ms if step_ms > 0 else None,
               "tokens_equal_theirs": bool(torch.equal(run_ours(m, ids, new), ref))}
        if dt not in ("float32", "plain"):
            row["top1_agree_fp32"] = top1_agreement(m, ref, ref[:, P:])
        if peer:
            row["ct2_tokens_equal_theirs"] = bool(torch.equal(run_ct2(fam.ct2[ct2_dt], fam.names, ids, new), ref))
        row["targets"] = {k: v for k, v in targets(scenario, dt).items() if row[k] is not None}
        row["met"] = all(row[k] >= v for k, v in row["targets"].items())
        rows.append(row)
    return rows


def main() -> None:
    p = parser(__doc__.splitlines()[0], "generate.json")
    p.add_argument("--family", choices=["gpt2", "llama", "all"], default="all", help="which model(s) (default all)")
    p.add_argument("--scenario", choices=[*(s.replace(" ", "") for s in SCENARIOS), "all"], default="all",
                   help="which batch/prompt row(s) (default all)")
    p.add_argument("--no-bf16", action="store_true", help="skip the bfloat16 rows")
    p.add_argument("--no-ct2", action="store_true", help="skip the CTranslate2 peer")
    args = p.parse_args()
    setup(args)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    families = ["gpt2", "llama"] if args.family == "all" else [args.family]
    scenarios = [s for s in SCENARIOS if args.scenario in ("all", s.replace(" ", ""))]
    new, repeat = (8, 2) if args.quick else (NEW, 5)
    copy_run, copy_bytes = copy_fn(64 if args.quick else 256)
    ct2_version = None
    if not args.no_ct2:
        try:
            import ctranslate2
            ct2_version = ctranslate2.__version__
        except ImportError:
            print("CTranslate2 is not installed (pip install ctranslate2): its rows are skipped")
    print(f"greedy, static cache, {new} new tokens; threads {args.threads}; copy bandwidth of "
          f"{copy_bytes // 2 // 10**6} MB, read + write; peers: transformers {transformers.__version__} fp32"
          + (f", CTranslate2 {ct2_version} (same dtype)" if ct2_version else ""))
    print("ratio, ratio_ct2: our tokens/s over transformers fp32's, CTranslate2's; prefill_ratio*: the same in "
          "prefill tokens/s; x_our_fp32: over our fp32's")

    rows, models = [], {}
    for name in families:
        with tempfile.TemporaryDirectory() as tmp:
            fam = build(name, args.quick, Path(tmp), threads=args.threads, ct2=ct2_version is not None)
            ours = our_models(fam, args.no_bf16)
            models[name] = {"config": describe(fam.theirs.config), "parameters": fam.parameters}
            family_rows = []
            for scenario in scenarios:
                B, P = SCENARIOS[scenario]
                seed = list(SCENARIOS).index(scenario)  # the same prompts whichever scenarios run
                ids = torch.randint(0, fam.theirs.config.vocab_size, (B, P),
                                    generator=torch.Generator().manual_seed(seed))
                ref = run_theirs(fam.theirs, ids, new)
                ms = time_scenario(fam, ours, ids, new, copy_run, repeat)
                family_rows += scenario_rows(fam, ours, scenario, new, ms, copy_bytes, ids, ref)
            del fam, ours  # free this family's models before the next one is built
        print(f"\n{models[name]['config']}; {models[name]['parameters'] / 1e6:.1f}M parameters"
              f"{' (quick)' if args.quick else ''}")
        print_table(family_rows, COLUMNS)
        print()
        print_table(family_rows, BOUND_COLUMNS)
        rows += family_rows

    print("\ntargets met:")
    met = {}
    for r in rows:
        for k, v in r["targets"].items():
            name = f"{r['family']} {r['scenario']} {r['dtype']} {k} >= {v}"
            met[name] = r[k] >= v
            print(f"  {name}: {met[name]} ({r[k]:.3g})")
    write_json(args.out, rows, quick=args.quick, families=families, scenarios=scenarios, new_tokens=new,
               repeat=repeat, models=models, transformers=transformers.__version__, ctranslate2=ct2_version,
               targets=met)


if __name__ == "__main__":
    main()
