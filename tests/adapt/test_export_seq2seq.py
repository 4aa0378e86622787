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

BART = dict(vocab_size=40, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=64)
T5 = dict(vocab_size=40, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
          relative_attention_max_distance=20, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
NAMES = ["BartForConditionalGeneration", "BartForSequenceClassification", "BartForQuestionAnswering",
         "T5ForConditionalGeneration", "T5ForSequenceClassification", "T5ForTokenClassification",
         "T5ForQuestionAnswering"]


def save_hf(name, path):
    """A random tiny transformers checkpoint of ``name`` (eager attention), biases and norms perturbed."""
    torch.manual_seed(0)
    labels = {0: "start", 1: "end"} if name.endswith("QuestionAnswering") else {0: "neg", 1: "neu", 2: "pos"}
    cfg = (transformers.T5Config(**T5, id2label=labels) if name.startswith("T5")
           else transformers.BartConfig(**BART, id2label=labels))
    cfg._attn_implementation = "eager"
    hf = getattr(transformers, name)(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(path)
    return hf


def padded_rows(name, lengths=(11, 6)):
    """Right-padded rows as the tokenizers write them (BART ``<s> x … </s>``, T5 ``x … </s>``): one eos each."""
    t5 = name.startswith("T5")
    bos, pad, eos = (None, 0, 1) if t5 else (0, 1, 2)
    g = torch.Generator().manual_seed(1)
    ids = torch.full((len(lengths), max(lengths)), pad)
    for b, n in enumerate(lengths):
        row = torch.randint(3, 40, (n,), generator=g)
        if bos is not None:
            row[0] = bos
        row[-1] = eos
        ids[b, :n] = row
    return ids, (torch.arange(ids.shape[1]) < torch.tensor(lengths)[:, None]).long()


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
