"""A real notebook, executed headless by nbclient in a fresh ipykernel: it builds a transformers BERT and an
attnlab GPT-2 from random configs, calls both views, shows them inline and saves them. Marked ``slow``
(a kernel start and a transformers import: ~10-30 s); the browser half lives in ``test_browser.py``."""
import json
import re
import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat is a dev dependency (pip install -e .[dev])")
nbclient = pytest.importorskip("nbclient", reason="nbclient is a dev dependency (pip install -e .[dev])")
pytest.importorskip("ipykernel", reason="ipykernel is a dev dependency (pip install -e .[dev])")
pytest.importorskip("transformers")

CELLS = [
    """import attnlab, torch, transformers
from attnlab.viz import head_view, model_view
print(attnlab.__file__)""",
    """cfg = transformers.BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=64, max_position_embeddings=32, attn_implementation="eager")
torch.manual_seed(0)
bert = transformers.BertModel(cfg).eval()
with torch.no_grad():
    out = bert(torch.tensor([[2, 5, 9, 11, 3, 7, 3]]), output_attentions=True)
tokens = ["[CLS]", "the", "cat", "</script><img src=x onerror=alert(1)>", "[SEP]", "sat", "[SEP]"]
head_view(out.attentions, tokens, 5)   # bertviz's call: shown inline, returns None
html = head_view(out.attentions, tokens, 5, html_action="return")
with open("bert_head.html", "w", encoding="utf-8") as f:
    f.write(html.data)""",
    """model_view(out.attentions, tokens, html_action="return").save("bert_model.html")""",
    """from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
gpt = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=2)).eval()
with torch.no_grad():
    att = gpt(torch.tensor([[1, 4, 9, 16]]), output_attentions=True).attentions
head_view(att, ["a", "b", "c", "d"], layer=1, html_action="return").save("gpt_head.html")
model_view(att, ["a", "b", "c", "d"], html_action="return").save("gpt_model.html")
model_view(att, ["a", "b", "c", "d"])""",
]


def _data(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="attnlab-data">(.*?)</script>', page, re.S)
    return json.loads(m.group(1))


@pytest.mark.slow
def test_notebook_executes_headless(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in CELLS]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, with the traceback, if a cell fails
    import attnlab  # the kernel (ipykernel's native spec: this interpreter, this PYTHONPATH) runs this attnlab

    stdout = [o.text for o in nb.cells[0].outputs if o.output_type == "stream" and o.name == "stdout"]
    assert stdout == [attnlab.__file__ + "\n"]
    nbformat.write(nb, tmp_path / "executed.ipynb")
    assert nbformat.read(tmp_path / "executed.ipynb", as_version=4).cells[1].outputs  # the saved notebook keeps them
    shown = [o for c in (nb.cells[1], nb.cells[3]) for o in c.outputs if o.output_type == "display_data"]
    assert len(shown) == 2  # html_action="view": displayed, and None returned (no execute_result)
    assert not [o for c in (nb.cells[1], nb.cells[3]) for o in c.outputs if o.output_type == "execute_result"]
    for out in shown:
        frame = out.data["text/html"]
        assert frame.startswith("<iframe srcdoc=") and 'sandbox="allow-scripts"' in frame
        assert "<script" not in frame  # the page is an escaped attribute: nothing runs in the notebook itself
    for name, n_kinds, tab in (("bert_head", 5, "head"), ("bert_model", 1, "model"), ("gpt_head", 1, "head"),
                               ("gpt_model", 1, "model")):
        data = _data((tmp_path / f"{name}.html").read_text(encoding="utf-8"))
        assert len(data["kinds"]) == n_kinds and data["tab"] == tab
    bert = _data((tmp_path / "bert_head.html").read_text(encoding="utf-8"))
    assert bert["kinds"][0]["tokens_q"][3] == "</script><img src=x onerror=alert(1)>"
    assert _data((tmp_path / "gpt_head.html").read_text(encoding="utf-8"))["layer"] == 1
