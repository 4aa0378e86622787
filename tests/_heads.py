"""What the task-head tests of several families share: the sequence-classification loss checked against
transformers for the three problem types."""
import torch

import attnlab
from tests._tolerance import tolerance

LABELS = {"single": torch.tensor([2, 0, 1]), "regression": torch.tensor([0.5, -1.0, 2.0]),
          "multi": torch.tensor([[1.0, 0, 1], [0, 0, 1], [1, 1, 0]])}


def check_sequence_loss(hf, kind: str, ids, mask, tmp_path, *, depth: int) -> None:
    """``hf`` (a transformers ``*ForSequenceClassification`` with 3 labels, eval mode) and ours loaded from its
    saved folder give the same loss for ``kind`` labels (``"regression"``: the model rebuilt with one label)."""
    if kind == "regression":
        hf.config.id2label, hf.config.label2id = {0: "score"}, {"score": 0}
        hf = type(hf)(hf.config).eval()
    hf.save_pretrained(tmp_path)
    ours = attnlab.from_pretrained(tmp_path)
    with torch.no_grad():
        a = ours(ids, attention_mask=mask, labels=LABELS[kind]).loss
        b = hf(ids, attention_mask=mask, labels=LABELS[kind]).loss
    assert abs(float(a) - float(b)) <= tolerance(b, n=32, depth=depth)

ATOL = 1e-4  # logits of a head on a tiny random model (|logit| ~ 1, a few layers of float32)


def close(a, b) -> None:
    assert a.shape == b.shape
    assert (a - b).abs().max() <= ATOL


def head_outputs(model, name: str, ids, mask, call=None):
    """The head's logits, or ``[start; end]`` stacked for a question-answering head; ``call(model, ids, mask)``
    replaces the plain ``model(ids, attention_mask=mask)``."""
    out = call(model, ids, mask) if call is not None else model(ids, attention_mask=mask)
    if name.endswith("QuestionAnswering"):
        return torch.stack([out.start_logits, out.end_logits])
    return out.logits


def check_round_trip(hf, auto_class, ids, mask, tmp_path, call=None):
    """transformers' head ``hf`` → saved → loaded by us (same class name, same outputs) → saved by us → loaded by
    ``auto_class`` (same outputs again). Returns ``(ours, back)`` for the family's own checks of the config."""
    name = type(hf).__name__
    hf.save_pretrained(tmp_path / "hf")
    ours = attnlab.from_pretrained(tmp_path / "hf")
    assert type(ours).__name__ == name
    with torch.no_grad():
        expected = head_outputs(hf, name, ids, mask, call)
        close(head_outputs(ours, name, ids, mask, call), expected)
        ours.save_pretrained(tmp_path / "ours")
        back = auto_class.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
        assert type(back).__name__ == name
        close(head_outputs(back, name, ids, mask, call), expected)
    return ours, back
