"""Smoke test of ``benchmarks/generate.py``: ``--quick`` runs both families (GPT-2, Llama) in the three scenarios
(b1 p32, b8 p32, b1 p512) and writes JSON of the documented shape; the fp32 tokens equal transformers' (and
CTranslate2's, when installed). No timing assertions: only that every speed is there and positive and that the
ratios are the quotients of the speeds. The full-size configs are built on the meta device and counted."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
CT2 = importlib.util.find_spec("ctranslate2") is not None


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """Run ``--quick --threads 1 --no-bf16`` once (``--no-ct2`` when ctranslate2 is absent); its JSON."""
    out = tmp_path_factory.mktemp("bench") / "generate.json"
    cmd = [sys.executable, str(BENCH / "generate.py"), "--quick", "--threads", "1", "--no-bf16", "--out", str(out)]
    proc = subprocess.run(cmd + ([] if CT2 else ["--no-ct2"]), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "targets met:" in proc.stdout and "Llama: hidden 128" in proc.stdout
    return json.loads(out.read_text())


def test_rows_cover_families_scenarios_and_dtypes(data):
    assert data["quick"] is True and data["new_tokens"] == 8 and data["environment"]["threads"] == 1
    assert data["families"] == ["gpt2", "llama"] and data["scenarios"] == ["b1 p32", "b8 p32", "b1 p512"]
    keys = [(r["family"], r["scenario"], r["batch"], r["prompt"], r["dtype"]) for r in data["rows"]]
    assert keys == [(f, s, b, p, dt) for f in ("gpt2", "llama")
                    for s, b, p in (("b1 p32", 1, 32), ("b8 p32", 8, 32), ("b1 p512", 1, 512))
                    for dt in ("plain", "float32", "int8", "int4")]
    assert data["models"]["gpt2"]["parameters"] == 2048 * 128 + 1024 * 128 + 2 * (12 * 128**2 + 13 * 128) + 2 * 128
    # Llama: embedding + head, per layer q, o (128²) and k, v (128 × 64), 3 FFN matrices, 2 norms; final norm
    assert data["models"]["llama"]["parameters"] == (
        2 * 2048 * 128 + 2 * (2 * 128**2 + 2 * 128 * 64 + 3 * 128 * 352 + 2 * 128) + 128)


def test_speeds_and_ratios(data):
    for r in data["rows"]:
        for k in ("ours_tok_s", "theirs_fp32_tok_s", "prefill_tok_s", "theirs_prefill_tok_s", "copy_gbs",
                  "weight_mb", "kv_mb", "bound_ms"):
            assert r[k] > 0, (r["family"], r["scenario"], r["dtype"], k)
        assert r["ratio"] == pytest.approx(r["ours_tok_s"] / r["theirs_fp32_tok_s"])
        assert r["prefill_ratio"] == pytest.approx(r["prefill_tok_s"] / r["theirs_prefill_tok_s"])
        if CT2:  # (int4's peer: CTranslate2's int8)
            assert r["ratio_ct2"] == pytest.approx(r["ours_tok_s"] / r["ct2_tok_s"])
            assert r["prefill_ratio_ct2"] == pytest.approx(r["prefill_tok_s"] / r["ct2_prefill_tok_s"])
        else:
            assert r["ct2_tok_s"] is None and r["ratio_ct2"] is None
        # int8 stores 1 byte per weight (+ a scale per row) where fp32 stores 4; int4 half a byte (+ a scale per 64)
        same = [x for x in data["rows"] if x["family"] == r["family"] and x["scenario"] == r["scenario"]]
        fp32, int8 = (next(x for x in same if x["dtype"] == dt) for dt in ("float32", "int8"))
        if r["dtype"] in ("int8", "int4"):
            assert r["weight_mb"] < fp32["weight_mb"] / (2 if r["dtype"] == "int8" else 4)
            assert 0 <= r["top1_agree_fp32"] <= 1
        if r["dtype"] == "int4":
            assert r["weight_mb"] < int8["weight_mb"] * 0.6
            assert r["x_our_int8"] == pytest.approx(r["ours_tok_s"] / int8["ours_tok_s"])


def test_tokens_and_targets(data):
    for r in data["rows"]:
        if r["dtype"] in ("float32", "plain"):  # (plain: no optimize call, generate's own fast path)
            assert r["tokens_equal_theirs"] is True, (r["family"], r["scenario"], r["dtype"])
            if CT2:
                assert r["ct2_tokens_equal_theirs"] is True, (r["family"], r["scenario"])
        want = {"b1 p32": {"plain": {"ratio"}, "float32": {"ratio", "ratio_ct2", "pct_of_bound"},
                           "int8": {"x_our_fp32", "ratio_ct2"}, "int4": {"x_our_int8"}},
                "b8 p32": {"plain": {"ratio"}, "float32": {"ratio", "ratio_ct2"}, "int8": {"ratio", "ratio_ct2"},
                           "int4": {"ratio"}}}.get(
            r["scenario"], {"plain": {"ratio", "prefill_ratio"},
                            "float32": {"ratio", "ratio_ct2", "prefill_ratio", "prefill_ratio_ct2"},
                            "int8": {"ratio", "ratio_ct2", "prefill_ratio", "prefill_ratio_ct2"},
                            "int4": {"ratio", "prefill_ratio"}})[r["dtype"]]  # (int4's CT2 peer: int8, no target)
        if not CT2:
            want = {k for k in want if "ct2" not in k}
        assert set(r["targets"]) == want
        assert r["met"] == all(r[k] >= v for k, v in r["targets"].items())
    assert len(data["targets"]) == sum(len(r["targets"]) for r in data["rows"])


def test_full_size_configs_build_with_equal_parameter_counts():
    """The full-size checkpoints (built on the meta device: no memory) and ours from the same config."""
    sys.path.insert(0, str(BENCH))
    from _generate_peers import hf_config

    from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel
    from attnlab.models.llama import LlamaConfig, LlamaForCausalLM

    counts = {}
    for family, ours_cls, config_cls in (("gpt2", GPT2LMHeadModel, GPT2Config),
                                         ("llama", LlamaForCausalLM, LlamaConfig)):
        config = hf_config(family, quick=False)
        with torch.device("meta"):
            theirs = transformers.AutoModelForCausalLM.from_config(config)
            ours = ours_cls(config_cls.from_hf(config.to_dict()))
        counts[family] = sum(p.numel() for p in theirs.parameters())
        assert sum(p.numel() for p in ours.parameters()) == counts[family]
    assert counts["gpt2"] == 124_439_808  # GPT-2 small
    # Llama: 2 · 32000 · 1024 (embedding, untied head) + 4 · (2 · 1024² + 2 · 1024 · 256 + 3 · 1024 · 2816 + 2 · 1024)
    # + 1024 (final norm)
    assert counts["llama"] == 2 * 32000 * 1024 + 4 * (2 * 1024**2 + 2 * 1024 * 256 + 3 * 1024 * 2816 + 2048) + 1024
    config = hf_config("llama", quick=False)
    assert config.num_attention_heads // config.num_key_value_heads == 4  # GQA: 4 query heads per kv head
