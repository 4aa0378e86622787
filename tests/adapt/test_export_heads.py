"""Task heads export as ONNX graphs of their logits: a BERT sequence / token classifier and QA head (the encoder's
three inputs) and a GPT-2 sequence classifier (``input_ids``, ``attention_mask``; no cache), each equal to the
model's forward on a padded batch of another length than the traced example; ``analyze`` prunes their heads by the
KL divergence of their outputs. ViTs export with ``pixel_values`` in and a dynamic batch; a Seq2SeqTransformer as
its teacher-forced logits, source and target lengths dynamic."""
import pytest
import torch

from attnlab.adapt.export import export_onnx, input_names, output_names
from attnlab.models.bert import BertConfig
from attnlab.models.classifier import ClassifierConfig
from attnlab.models.decoder_heads import GPT2ForSequenceClassification
from attnlab.models.gpt import GPT2Config
from attnlab.models.heads import BertForQuestionAnswering, BertForSequenceClassification, BertForTokenClassification

BERT = dict(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=32)


def _heads():
    torch.manual_seed(0)
    yield BertForSequenceClassification(ClassifierConfig(BertConfig(**BERT), num_labels=3)).eval()
    yield BertForTokenClassification(ClassifierConfig(BertConfig(**BERT), num_labels=4)).eval()
    yield BertForQuestionAnswering(ClassifierConfig(BertConfig(**BERT))).eval()
    yield GPT2ForSequenceClassification(ClassifierConfig(GPT2Config(vocab_size=40, n_positions=32, n_embd=32,
                                                                    n_layer=2, n_head=2), pad_token_id=0)).eval()


@pytest.mark.parametrize("model", list(_heads()), ids=lambda m: type(m).__name__)
def test_head_graph_matches_the_forward(tmp_path, model):
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed")
    path = export_onnx(model, tmp_path / "head.onnx", example_length=8)
    names, outs = input_names(model), output_names(model)
    ids = torch.tensor([[5, 9, 11, 13, 17, 19, 23, 29, 31, 33, 3], [5, 7, 9, 3, 0, 0, 0, 0, 0, 0, 0]])
    mask = (ids != 0).long()
    feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        list(outs), {n: feed[n].numpy() for n in names})
    with torch.no_grad():
        ref = model(ids, attention_mask=mask)
    for name, g in zip(outs, got):
        r = getattr(ref, name)
        tol = 64 * torch.finfo(torch.float32).eps * max(1.0, float(r.abs().max()))
        assert g.shape == tuple(r.shape) and (torch.from_numpy(g) - r).abs().max() <= tol, name
    if isinstance(model, GPT2ForSequenceClassification):
        assert names == ("input_ids", "attention_mask") and outs == ("logits",)
    elif isinstance(model, BertForQuestionAnswering):
        assert outs == ("start_logits", "end_logits")


@pytest.mark.parametrize("model", list(_heads()), ids=lambda m: type(m).__name__)
def test_analyze_prunes_task_heads_by_output_divergence(model):
    from attnlab.evaluation.analysis import Batch, analyze

    ids = torch.tensor([[5, 9, 11, 13, 3], [5, 7, 9, 3, 0]])
    batch = Batch(ids, (ids != 0).long(), torch.zeros_like(ids, dtype=torch.bool))
    result = analyze(model, batch)
    assert result.loss_name.startswith("KL(unpruned") and result.base_loss == 0.0
    assert result.prune_delta.shape == (2, model.config.base.num_attention_heads
                                        if hasattr(model.config.base, "num_attention_heads") else 2)
    assert bool(torch.isfinite(result.prune_delta).all()) and float(result.prune_delta.min()) >= 0
    assert float(result.prune_delta.max()) > 0


@pytest.mark.parametrize("classifier", [False, True])
def test_vit_graph_matches_the_forward(tmp_path, classifier):
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed")
    from attnlab.models.vit import ViTConfig, ViTForImageClassification, ViTModel

    torch.manual_seed(0)
    cfg = ViTConfig(image_size=8, patch_size=2, num_channels=1, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=64)
    model = (ViTForImageClassification(cfg) if classifier else ViTModel(cfg)).eval()
    path = export_onnx(model, tmp_path / "vit.onnx")
    assert input_names(model) == ("pixel_values",)
    x = torch.randn(3, 1, 8, 8)  # another batch size than the traced example's
    outs = output_names(model)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(list(outs), {"pixel_values": x.numpy()})
    with torch.no_grad():
        ref = model(x)
    for name, g in zip(outs, got):
        r = getattr(ref, name)
        tol = 64 * torch.finfo(torch.float32).eps * max(1.0, float(r.abs().max()))
        assert (torch.from_numpy(g) - r).abs().max() <= tol, name
    assert outs == (("logits",) if classifier else ("last_hidden_state", "pooler_output"))


@pytest.mark.parametrize("position", ["sinusoidal", "rope"])
def test_seq2seq_transformer_graph_matches_the_forward(tmp_path, position):
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed")
    from attnlab.models.config import TransformerConfig
    from attnlab.models.transformer import Seq2SeqTransformer

    torch.manual_seed(0)
    model = Seq2SeqTransformer(TransformerConfig(src_vocab_size=30, dim=32, num_heads=4, ffn_dim=64,
                                                 num_encoder_layers=2, num_decoder_layers=2, max_positions=64,
                                                 position=position, pad_id=0)).eval()
    path = export_onnx(model, tmp_path / "s2s.onnx", example_length=8)
    assert input_names(model) == ("input_ids", "attention_mask", "decoder_input_ids")
    src = torch.tensor([[5, 9, 11, 13, 17, 19, 23, 2, 4, 6, 8], [5, 7, 9, 3, 0, 0, 0, 0, 0, 0, 0]])
    mask = (src != 0).long()
    tgt = torch.tensor([[1, 4, 6, 8, 10], [1, 3, 5, 7, 9]])  # lengths other than the traced example's
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(["logits"], {"input_ids": src.numpy(), "attention_mask": mask.numpy(),
                                     "decoder_input_ids": tgt.numpy()})
    with torch.no_grad():
        ref = model(src, tgt)
    tol = 64 * torch.finfo(torch.float32).eps * max(1.0, float(ref.abs().max()))
    assert got.shape == (2, 5, 30) and (torch.from_numpy(got) - ref).abs().max() <= tol
