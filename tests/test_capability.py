"""attnlab._runtime.probe / resolve_dtype and ``attnlab env``: the machine's facts, the precision they imply,
and the standard overrides (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA) really changing both."""
import json
import re
import os
import subprocess
import sys
import warnings

import pytest
import torch

from attnlab import _runtime
from attnlab._runtime import check_dtype_name, probe, resolve_dtype
from attnlab.cli import main

AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def _run(code: str, env: dict) -> str:
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True, timeout=300)
    return out.stdout + out.stderr


def test_probe_reports_what_torch_reports_and_is_cached():
    cap = probe()
    assert cap.isa == torch.backends.cpu.get_cpu_capability()
    flags = _runtime._cpu_flags()
    assert cap.bf16_native == (bool({"avx512_bf16", "amx_bf16"} & flags)
                               and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert cap.torch_version == torch.__version__ and cap.threads == torch.get_num_threads() and cap.cores >= 1
    assert cap.fp32_gflops is None  # nothing measured unless asked
    assert probe() is cap
    m = probe(measure=True)
    assert (m.fp32_gflops, m.bf16_gflops) == _runtime.product_rates()  # the figures auto compares
    assert m.fp32_gflops > 0 and m.bf16_gflops > 0 and m.copy_gbps > 0
    assert probe(measure=True) is m
    assert cap.isa in m.line() and "threads" in m.line()


@pytest.mark.parametrize("value, expected", [("auto", "auto"), ("fp32", "fp32"), ("float32", "fp32"),
                                             ("bf16", "bf16"), ("bfloat16", "bf16"), ("FP16", "fp16"),
                                             (torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_dtype_names(value, expected):
    assert check_dtype_name(value) == expected


@pytest.mark.parametrize("bad", ["fp8", "float64", "", None, 3, "Auto "])
def test_bad_dtype_names_the_setting_and_the_valid_values(bad):
    with pytest.raises(ValueError, match=r"eval_dtype must be one of auto, fp32, bf16, fp16"):
        check_dtype_name(bad, name="eval_dtype")


def test_resolve_dtype_follows_the_capabilities_never_a_timing(monkeypatch):
    native = _runtime.Capability("t", "cpu", "AVX512", True, False, False, 2, 2, None)
    none = _runtime.Capability("t", "cpu", "AVX2", False, False, False, 2, 2, None)
    for cap, want in ((native, "bf16"), (none, "fp32")):
        monkeypatch.setattr(_runtime, "probe", lambda measure=False, cap=cap: cap)
        for rates in ((100.0, 300.0), (300.0, 1.0), (50.0, 55.0)):  # fast, starved, noisy: the same choice
            monkeypatch.setattr(_runtime, "product_rates", lambda rates=rates: rates)
            dtype, reason = resolve_dtype("auto")
            assert dtype == want and reason and "GFLOP" not in reason
    assert resolve_dtype("auto")[1] == "no native bf16 (AVX2)"
    assert resolve_dtype("fp32") == ("fp32", "asked for")
    with pytest.raises(ValueError, match="fp16 needs a CUDA device"):
        resolve_dtype("fp16", "cpu")


def test_explicit_bf16_without_native_support_warns_once(monkeypatch):
    none = _runtime.Capability("t", "cpu", "AVX2", False, False, False, 2, 2, None, 100.0, 1.25, 20.0)
    monkeypatch.setattr(_runtime, "probe", lambda measure=False: none)
    monkeypatch.setattr(_runtime, "product_rates", lambda: (100.0, 1.25))
    monkeypatch.setattr(_runtime, "_WARNED", set())
    with pytest.warns(UserWarning, match=r"dtype=bf16 on a CPU without native bf16 \(AVX2\).*80x slower"):
        assert resolve_dtype("bf16") == ("bf16", "asked for")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_dtype("bf16")  # once per process
    starved = _runtime.Capability("t", "cpu", "AVX2", False, False, False, 2, 2, None, 100.0, 1e-6, 20.0)
    monkeypatch.setattr(_runtime, "probe", lambda measure=False: starved)  # a probe that read ~nothing under load
    monkeypatch.setattr(_runtime, "product_rates", lambda: (100.0, 1e-6))
    monkeypatch.setattr(_runtime, "_WARNED", set())
    with pytest.warns(UserWarning, match=r"run over 100x slower than fp32"):
        resolve_dtype("bf16")


def test_avx2_emulation_changes_the_probe_and_the_choice():
    code = ("from attnlab._runtime import probe, resolve_dtype; c = probe(); "
            "print(c.isa, c.bf16_native, *resolve_dtype('auto'), sep='|')")
    isa, native, dtype, reason = _run(code, AVX2).strip().splitlines()[-1].split("|")
    assert (isa, native, dtype, reason) == ("AVX2", "False", "fp32", "no native bf16 (AVX2)")


def test_env_command_text_and_json(capsys):
    assert main(["env", "--no-measure"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"instruction set \(torch\) +{torch.backends.cpu.get_cpu_capability()}\n", out)
    assert "dtype=auto" in out and "native bf16" in out
    assert main(["env", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["isa"] == torch.backends.cpu.get_cpu_capability() and r["fp32_gflops"] > 0
    assert r["auto_dtype"] in ("fp32", "bf16") and r["auto_dtype_reason"]


def test_env_command_under_the_avx2_override():
    out = _run("import sys; from attnlab.cli import main; sys.exit(main(['env', '--json', '--no-measure']))", AVX2)
    r = json.loads(out[out.index("{"):])
    assert r["isa"] == "AVX2" and r["bf16_native"] is False and r["auto_dtype"] == "fp32"
    assert r["overrides"] == AVX2


def test_cli_dtype_auto_resolves_for_model_commands():
    from attnlab.cli import build_parser, model_dtype

    args = build_parser().parse_args(["analyze", "--model", "x", "--dtype", "auto"])
    assert model_dtype(args) == {"fp32": torch.float32, "bf16": torch.bfloat16}[resolve_dtype("auto")[0]]


def test_optimize_for_inference_auto_follows_resolve_dtype():
    from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    model.optimize_for_inference()
    want = {"fp32": torch.float32, "bf16": torch.bfloat16}[resolve_dtype("auto")[0]]
    assert {m.dtype for m in model.modules() if type(m).__name__ == "PackedLinear"} == {want}
    with pytest.raises(ValueError, match="dtype must be one of auto"):
        GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=1, n_head=2)) \
            .optimize_for_inference(dtype="fp8")


def test_bf16_inference_where_bf16_is_emulated_is_right_and_warns():
    """optimize_for_inference(bfloat16) on an AVX2-only CPU: the plain (non-oneDNN) path, logits within
    bf16 rounding of fp32, one warning naming the slowdown."""
    code = r"""
import warnings, torch
from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=4)
ref = GPT2LMHeadModel(cfg).eval()
ids = torch.randint(0, 64, (2, 12))
with torch.no_grad():
    want = ref(ids).logits if hasattr(ref(ids), 'logits') else ref(ids)
    m = GPT2LMHeadModel(cfg).eval(); m.load_state_dict(ref.state_dict())
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        m.optimize_for_inference(dtype=torch.bfloat16)
    got = m(ids).logits if hasattr(m(ids), 'logits') else m(ids)
packed = {mod.packed for mod in m.modules() if type(mod).__name__ == "PackedLinear"}
err = ((got - want).abs().max() / want.abs().max()).item()
print(packed, any("without native bf16" in str(x.message) for x in w), err)
"""
    packed, warned, err = _run(code, AVX2).strip().splitlines()[-1].rsplit(" ", 2)
    assert packed == "{False}" and warned == "True"
    # weight-only bf16: each product rounds its inputs to 8 significant bits (2^-8 relative) -> a few 2^-8
    assert float(err) < 8 * 2.0 ** -8
