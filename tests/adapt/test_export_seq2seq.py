"""T5 and BART export as ONNX graphs: the LMs (``…ForConditionalGeneration``) as their teacher-forced ``logits``
(``input_ids``, ``attention_mask``, ``decoder_input_ids``), the task heads as their head's outputs (``input_ids``,
``attention_mask``). Each graph, run by ONNX Runtime on a padded batch of other lengths than the traced example,
equals our forward and transformers' (random tiny checkpoints written by transformers, no download) within the
float32 tolerance of the logits' magnitude."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed")

import attnlab  # noqa: E402
from attnlab.adapt.export import export_onnx, input_names, output_names  # noqa: E402
from tests._seq2seq import NAMES, padded_rows, save_hf  # noqa: E402


@pytest.mark.parametrize("name", NAMES)
def test_t5_bart_graph_equals_ours_and_transformers(tmp_path, name):
    hf = save_hf(name, tmp_path / "model")
    ours = attnlab.from_pretrained(tmp_path / "model").eval()
    path = export_onnx(ours, tmp_path / "model.onnx", example_length=8)
    ids, mask = padded_rows(name)
    feed = {"input_ids": ids, "attention_mask": mask}
    if name.endswith("ConditionalGeneration"):
        assert input_names(ours) == ("input_ids", "attention_mask", "decoder_input_ids")
        feed["decoder_input_ids"] = torch.tensor([[0, 5, 7, 9, 11], [0, 4, 6, 8, 10]])  # 5 != 8 - 1 traced
    else:
        assert input_names(ours) == ("input_ids", "attention_mask")
    outs = output_names(ours)
    assert outs == (("start_logits", "end_logits") if name.endswith("QuestionAnswering") else ("logits",))
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        list(outs), {k: v.numpy() for k, v in feed.items()})
    with torch.no_grad():
        mine, theirs = ours(**feed), hf(**feed)
    for out, g in zip(outs, got):
        for ref in (getattr(mine, out), getattr(theirs, out)):
            tol = 64 * torch.finfo(torch.float32).eps * max(1.0, float(ref.abs().max()))
            assert g.shape == tuple(ref.shape) and float((torch.from_numpy(g) - ref).abs().max()) <= tol, out


def test_cli_exports_a_t5_head_folder(tmp_path, capsys):
    from attnlab.cli import main

    save_hf("T5ForSequenceClassification", tmp_path / "model")
    assert main(["export", "--model", str(tmp_path / "model"), "--out", str(tmp_path / "cls.onnx")]) == 0
    out = capsys.readouterr().out
    assert "T5ForSequenceClassification" in out and "inputs input_ids, attention_mask; outputs logits" in out
    assert (tmp_path / "cls.onnx").stat().st_size > 0
