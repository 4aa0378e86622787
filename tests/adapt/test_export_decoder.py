"""ONNX export of decoder-only models (GPT-2, Llama with GQA) with an explicit KV cache, run in onnxruntime.

The graph has Optimum's decoder layout; its logits and presents equal our forward and the same weights in
``transformers`` (max abs ≤ 1e-4 and within the float32 rounding model of ``tests/_tolerance.py``) at batch sizes
and lengths other than the traced example's, from an empty past, over a cached past, one token or a chunk; a plain
numpy greedy loop over the session gives our ``generate``'s tokens, token for token, with left padding;
:class:`OnnxDecoder` runs ``generate`` itself (greedy with an end token, beams) on the graph; a sliding-window model
keeps its window. Then the ``attnlab export`` command and the errors.
"""
import numpy as np
import pytest
import torch

from attnlab.adapt.export import OnnxDecoder, export_onnx
from attnlab.cli import main

from _tolerance import tolerance

ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed")
transformers = pytest.importorskip("transformers")
V = 97  # the vocabulary of tests/adapt/conftest.py's tiny models (2 layers, width 32, 4 heads; Llama: 2 kv heads)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def exported(request, tmp_path_factory, make_gpt2, make_llama):
    """(name, our model, the .onnx file, a session on it), one export per model for the whole module."""
    model = (make_gpt2 if request.param == "gpt2" else make_llama)()
    assert model.config.vocab_size == V
    path = export_onnx(model, tmp_path_factory.mktemp(request.param) / "decoder.onnx", example_length=5)
    return request.param, model, path, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _prompts(seed: int = 1):
    """Three prompts of 8, 5 and 7 tokens, left-padded to 8."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (3, 8), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :1] = 0
    return ids, mask


def _run(session, ids, mask, past):
    """One call of the graph: ``past`` is a list of numpy arrays (key, value per layer); returns torch tensors."""
    names = [i.name for i in session.get_inputs()][2:]
    logits, *present = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy(),
                                          **dict(zip(names, past))})
    return torch.from_numpy(logits), present


def _empty_past(model, batch):
    attn = model.layers[0].self_attn
    return [np.zeros((batch, attn.num_kv_heads, 0, attn.head_dim), np.float32) for _ in range(2 * len(model.layers))]


def test_the_graph_has_optimums_decoder_layout(exported):
    name, model, _, session = exported
    L, hkv = len(model.layers), model.layers[0].self_attn.num_kv_heads
    assert hkv == (4 if name == "gpt2" else 2)
    inputs = {i.name: i.shape for i in session.get_inputs()}
    outputs = {o.name: o.shape for o in session.get_outputs()}
    assert list(inputs) == ["input_ids", "attention_mask"] + [f"past_key_values.{i}.{kv}" for i in range(L)
                                                                for kv in ("key", "value")]
    assert list(outputs) == ["logits"] + [f"present.{i}.{kv}" for i in range(L) for kv in ("key", "value")]
    total = "past_sequence_length + sequence_length"
    assert inputs["input_ids"] == ["batch_size", "sequence_length"]
    assert inputs["attention_mask"] == ["batch_size", total]
    assert inputs["past_key_values.1.value"] == ["batch_size", hkv, "past_sequence_length", 8]
    assert outputs["logits"] == ["batch_size", "sequence_length", V]
    assert outputs["present.0.key"] == ["batch_size", hkv, total, 8]


def _transformers_logits(model, tmp_path, ids, mask):
    """The same weights in ``transformers``, positions as its ``generate`` passes them (``cumsum(mask) - 1``)."""
    model.save_pretrained(tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    with torch.no_grad():
        return theirs(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits


def test_logits_and_presents_equal_ours_and_transformers(exported, tmp_path):
    _, model, _, session = exported
    ids, mask = _prompts()
    more = torch.randint(0, V, (3, 4), generator=torch.Generator().manual_seed(2))
    full_ids, full_mask = torch.cat([ids, more], 1), torch.cat([mask, torch.ones_like(more)], 1)
    with torch.no_grad():
        cache = model.new_cache()
        ours = [model(ids, attention_mask=mask, past_key_values=cache).logits]  # prefill: 8 tokens, no past
        ours.append(model(more[:, :3], attention_mask=full_mask[:, :11], past_key_values=cache).logits)  # a chunk
        ours.append(model(more[:, 3:], attention_mask=full_mask, past_key_values=cache).logits)  # one token
    got, past = [], _empty_past(model, 3)
    for chunk, m in ((ids, mask), (more[:, :3], full_mask[:, :11]), (more[:, 3:], full_mask)):
        logits, past = _run(session, chunk, m, past)
        got.append(logits)
    got, ours = torch.cat(got, 1), torch.cat(ours, 1)
    real = full_mask.bool()  # rows of padding queries are arbitrary in transformers (zeros in ours)
    theirs = _transformers_logits(model, tmp_path, full_ids, full_mask)
    tol = min(1e-4, tolerance(ours, n=128, depth=len(model.layers)))  # n: the widest product (FFN)
    assert (got - ours)[real].abs().max() <= tol
    assert (got - theirs)[real].abs().max() <= tol
    for i, layer_cache in enumerate(cache):  # present = every key and value of the 12 positions
        for j, expected in enumerate(layer_cache.self_attn.stored()):
            present = torch.from_numpy(past[2 * i + j])
            assert present.shape == expected.shape == (3, model.layers[0].self_attn.num_kv_heads, 12, 8)
            assert (present - expected).abs().max() <= min(1e-4, tolerance(expected, n=32, depth=i + 1))


def test_a_numpy_greedy_loop_on_onnxruntime_gives_generates_tokens(exported):
    _, model, _, session = exported
    ids, mask = _prompts(seed=3)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=24)
    tokens, m, past, step = [], mask.clone(), _empty_past(model, 3), ids
    for _ in range(24):
        logits, past = _run(session, step, m, past)
        step = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        tokens.append(step)
        m = torch.cat([m, torch.ones_like(step)], 1)
    got = torch.cat([ids, *tokens], 1)
    assert got.shape == (3, 32) and torch.equal(got, expected)
    assert all(len(set(row.tolist())) > 3 for row in got[:, 8:])  # a real continuation, not one token repeated


def test_onnx_decoder_runs_generate_greedy_and_beams(exported):
    _, model, path, _ = exported
    decoder = OnnxDecoder(path)
    ids, mask = _prompts(seed=4)
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=20)
    eos = int(greedy[0, 12])  # row 0 ends at its 5th new token; the others are padded after theirs, if any
    stopping = dict(max_new_tokens=20, eos_token_id=eos, pad_token_id=0)
    stopped = model.generate(ids, attention_mask=mask, **stopping)
    assert not torch.equal(stopped, greedy) and (stopped[0, 13:] == 0).all()  # the end token took effect
    for kwargs, expected in ((dict(max_new_tokens=20), greedy), (stopping, stopped),
                             (dict(max_new_tokens=10, num_beams=3), None)):
        expected = model.generate(ids, attention_mask=mask, **kwargs) if expected is None else expected
        assert torch.equal(decoder.generate(ids, attention_mask=mask, **kwargs), expected), kwargs
    one = decoder(ids[:1])  # no mask, no cache: logits of a fresh call
    with torch.no_grad():
        assert (one.logits - model(ids[:1]).logits).abs().max() <= 1e-4 and one.past_key_values is None


def test_a_sliding_window_model_exports_with_its_window(tmp_path, make_llama):
    from attnlab.adapt.deploy import set_window

    model = make_llama(seed=7)
    set_window(model, 4)
    decoder = OnnxDecoder(export_onnx(model, tmp_path / "window.onnx"))
    ids, mask = _prompts(seed=8)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=20, cache="window")
    assert not torch.equal(expected, make_llama(seed=7).generate(ids, attention_mask=mask, max_new_tokens=20))
    assert torch.equal(decoder.generate(ids, attention_mask=mask, max_new_tokens=20), expected)


def test_attnlab_export_writes_a_decoder_that_decodes_like_the_model(tmp_path, capsys, make_llama):
    model = make_llama(seed=5)
    model.save_pretrained(tmp_path / "llama")
    assert main(["export", "--model", str(tmp_path / "llama"), "--out", str(tmp_path / "out" / "llama.onnx")]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM" in out and "past_key_values.{0..1}.key/.value" in out and "present." in out
    ids, mask = _prompts(seed=6)
    decoder = OnnxDecoder(tmp_path / "out" / "llama.onnx")
    assert torch.equal(decoder.generate(ids, attention_mask=mask, max_new_tokens=8),
                       model.generate(ids, attention_mask=mask, max_new_tokens=8))


def _one_line_error(capsys, argv, fragment):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnlab export: error:") and fragment in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_attnlab_export_errors_are_one_line(tmp_path, capsys, make_gpt2):
    from attnlab.models.clip import CLIPConfig, CLIPModel

    CLIPModel(CLIPConfig(text_config=dict(vocab_size=V, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                          num_attention_heads=2, max_position_embeddings=10),
                         vision_config=dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                            num_attention_heads=2, image_size=16, patch_size=8),
                         projection_dim=8)).save_pretrained(tmp_path / "clip")
    make_gpt2().save_pretrained(tmp_path / "gpt2")
    out = str(tmp_path / "x.onnx")
    _one_line_error(capsys, ["export", "--model", str(tmp_path / "clip"), "--out", out], "holds a CLIPModel")
    _one_line_error(capsys, ["export", "--model", str(tmp_path / "gpt2"), "--out", out, "--dtype", "bfloat16"],
                    "float32")
    _one_line_error(capsys, ["export", "--model", str(tmp_path / "gpt2"), "--out", out, "--opset", "12"], "opset")
    _one_line_error(capsys, ["export", "--model", str(tmp_path / "gpt2"), "--out", str(tmp_path)], "is a folder")
    assert not (tmp_path / "x.onnx").exists()


@pytest.mark.parametrize("how", ["int8", "int4", "packed"])
def test_a_quantised_or_packed_decoder_is_refused_with_what_to_do(tmp_path, how, make_gpt2):
    from attnlab.adapt.quantize import quantize

    model = make_gpt2()
    if how in ("int8", "int4"):
        model = quantize(model, how)
    else:
        model.optimize_for_inference(dtype=torch.float32)
    with pytest.raises(ValueError, match="export the float model first, then quantise the ONNX file"):
        export_onnx(model, tmp_path / "q.onnx")
    assert not (tmp_path / "q.onnx").exists()


def test_errors(tmp_path, make_gpt2, make_bert):
    with pytest.raises(ValueError, match=r"example_length must be an int in \[2, 63\]"):
        export_onnx(make_gpt2(), tmp_path / "x.onnx", example_length=64)  # 1 cached + 64 > n_positions=64
    with pytest.raises(TypeError, match="decoder-only LMs"):
        export_onnx(torch.nn.Linear(2, 2), tmp_path / "x.onnx")
    with pytest.raises(FileNotFoundError, match="no such file"):
        OnnxDecoder(tmp_path / "missing.onnx")
    bert = export_onnx(make_bert(), tmp_path / "bert.onnx")
    with pytest.raises(ValueError, match="is not a decoder exported by export_onnx"):
        OnnxDecoder(bert)
