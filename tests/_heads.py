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
