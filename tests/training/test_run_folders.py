"""Every folder ``attnlab train`` writes is a model folder for ``attnlab viz``, ``analyze``, ``export`` and
``predict``: each recipe trains two steps at its tiny size, then the commands read the run folder itself (its
newest checkpoint, or the HF-format ``model/`` the recipe wrote) and write their outputs elsewhere, leaving the
run folder as it was. The ONNX graph of a trained classifier gives the model's own logits."""
import json
import re
import warnings

import pytest
import torch

from attnlab.cli import main
from attnlab.training.recipes import run_recipe

STEPS = {"progress": False, "max_steps": 2}


def _listing(folder):
    return sorted((str(p.relative_to(folder)), p.stat().st_mtime_ns) for p in folder.rglob("*"))


def _data(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="attnlab-data">(.*?)</script>', page, re.S)
    return json.loads(m.group(1))


def _commands(run, tmp_path, capsys, viz_args, *, export=True):
    """viz, analyze and (optionally) export on ``run``; the run folder untouched. Returns the page's data."""
    before = _listing(run)
    assert main(["viz", "--model", str(run), *viz_args, "--out", str(tmp_path / "view.html")]) == 0
    text = viz_args[1]
    assert main(["analyze", "--model", str(run), "--text", text, "--text", text + " " + text, "--no-prune"]) == 0
    if export:
        assert main(["export", "--model", str(run), "--out", str(tmp_path / "model.onnx")]) == 0
    out = capsys.readouterr().out
    assert "wrote" in out and "layers" in out
    assert _listing(run) == before  # nothing written into what the commands read
    return _data((tmp_path / "view.html").read_text(encoding="utf-8"))


def test_shakespeare_char_run(shakespeare, tmp_path, capsys):
    run = tmp_path / "run"
    run_recipe("shakespeare-char", out=run, preset="tiny", overrides=STEPS)
    data = _commands(run, tmp_path, capsys, ["--text", "ROMEO: hi"])
    assert data["kinds"][0]["name"] == "decoder" and data["kinds"][0]["tokens_q"] == list("ROMEO: hi")
    # the view shows the checkpoint's model: its attention equals the run's model's own
    from attnlab.models.hub import from_pretrained
    from attnlab.training.recipes import load_run
    a, b = load_run(run).model, from_pretrained(run)
    assert type(a) is type(b) and all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                                          b.state_dict().values()))


@pytest.fixture(scope="module")
def multi30k():
    from attnlab.data.datasets import DataUnavailableError, load_parallel
    try:
        return load_parallel("train")[:10]
    except DataUnavailableError as e:
        pytest.skip(f"Multi30k unavailable: {e}")


def test_mlm_run(multi30k, tmp_path, capsys):
    run = tmp_path / "run"
    run_recipe("mlm", out=run, preset="tiny", overrides=STEPS)
    data = _commands(run, tmp_path, capsys, ["--text", "a dog runs in the snow"])
    assert data["kinds"][0]["name"] == "encoder" and data["kinds"][0]["tokens_q"][0] == "[CLS]"


def test_multi30k_run(multi30k, tmp_path, capsys):
    run = tmp_path / "run"
    run_recipe("multi30k-de-en", out=run, preset="tiny", overrides=STEPS)
    before = _listing(run)
    assert main(["viz", "--model", str(run), "--src", "ein Hund läuft", "--tgt", "a dog runs",
                 "--out", str(tmp_path / "view.html")]) == 0
    kinds = _data((tmp_path / "view.html").read_text(encoding="utf-8"))["kinds"]
    assert [k["name"] for k in kinds] == ["encoder", "decoder", "cross"]
    assert kinds[2]["tokens_k"] == kinds[0]["tokens_q"] and kinds[1]["tokens_q"][0] == "<s>"
    assert main(["export", "--model", str(run), "--out", str(tmp_path / "s2s.onnx")]) == 0
    assert _listing(run) == before


def _tiny_bert(folder):
    """A 2-layer random BERT with a WordPiece tokenizer, in HF format: the base model of a classify run."""
    from attnlab.data.tokenizers import train_wordpiece
    from attnlab.models.bert import BertConfig, BertModel

    texts = ["ein hund läuft im schnee", "a dog runs in the snow", "eine frau liest", "a woman reads"] * 20
    tok = train_wordpiece(texts, vocab_size=80)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=64)).save_pretrained(folder)
    tok.save(folder / "tokenizer.json")
    return texts


def test_classify_run(tmp_path, capsys):
    base = tmp_path / "base"
    texts = _tiny_bert(base)
    data = tmp_path / "lang.jsonl"
    data.write_text("".join(json.dumps({"text": t, "label": "de" if i % 2 == 0 else "en"}) + "\n"
                            for i, t in enumerate(texts)), encoding="utf-8")
    run = tmp_path / "run"
    run_recipe("classify", out=run, overrides={**STEPS, "model": str(base), "data": str(data), "max_len": 16,
                                                "batch_size": 8})
    page = _commands(run, tmp_path, capsys, ["--text", "a dog runs"])
    assert page["kinds"][0]["tokens_q"][0] == "[CLS]"
    assert main(["predict", "--model", str(run), "--text", "a dog runs"]) == 0
    label, p = capsys.readouterr().out.split("\t")[:2]
    assert label in ("de", "en") and 0.5 <= float(p) <= 1
    # the exported graph computes the classifier's logits
    ort = pytest.importorskip("onnxruntime")
    from attnlab.models.hub import from_pretrained
    model = from_pretrained(run / "model")
    ids = torch.tensor([[2, 10, 11, 12, 3], [2, 13, 3, 0, 0]])
    mask = (ids != 0).long()
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
    got = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"]).run(
        ["logits"], {"input_ids": ids.numpy(), "attention_mask": mask.numpy(),
                     "token_type_ids": torch.zeros_like(ids).numpy()})[0]
    tol = 64 * torch.finfo(torch.float32).eps * max(1.0, float(ref.abs().max()))
    assert (torch.from_numpy(got) - ref).abs().max() <= tol


def test_digits_vit_run(tmp_path, capsys):
    pytest.importorskip("sklearn")
    image = pytest.importorskip("PIL.Image")
    run = tmp_path / "run"
    run_recipe("digits-vit", out=run, preset="tiny", overrides=STEPS)
    picture = tmp_path / "digit.png"
    image.fromarray((torch.rand(8, 8) * 255).to(torch.uint8).numpy()).save(picture)
    before = _listing(run)
    assert main(["viz", "--model", str(run), "--image", str(picture), "--out", str(tmp_path / "digit.html")]) == 0
    assert (tmp_path / "digit.html").stat().st_size > 0 and _listing(run) == before
    assert main(["export", "--model", str(run), "--out", str(tmp_path / "vit.onnx")]) == 0
    assert "inputs pixel_values; outputs logits" in capsys.readouterr().out
    assert main(["analyze", "--model", str(run), "--text", "x"]) == 2  # a ViT reads pictures: one clear error
    assert "reads pictures" in capsys.readouterr().err
    assert _listing(run) == before


def test_multi30k_run_analyze_reads_the_encoder(multi30k, tmp_path):
    from attnlab.data.tokenizers import load_tokenizer
    from attnlab.evaluation.analysis import analyze, self_attention_modules
    from attnlab.evaluation.analyze_cli import encode_texts
    from attnlab.models.hub import from_pretrained

    run = tmp_path / "run"
    run_recipe("multi30k-de-en", out=run, preset="tiny", overrides=STEPS)
    model = from_pretrained(run)
    batch = encode_texts(load_tokenizer(run), ["ein Hund läuft im Schnee", "zwei Männer"])
    result = analyze(model, batch)
    n_enc = len(model.encoder.layers)
    assert result.entropy.shape == (n_enc, model.config.num_heads) == tuple(result.prune_delta.shape)
    assert len(self_attention_modules(model)) > n_enc  # the decoder's self-attention is not analysed
    assert bool(torch.isfinite(result.prune_delta).all()) and result.loss_name.startswith("1 − cos")
    assert main(["analyze", "--model", str(run), "--text", "ein Hund"]) == 0


def test_classify_run_stopped_before_its_end_is_read_at_its_checkpoint(tmp_path, capsys, monkeypatch):
    import attnlab.training.recipes.classify as classify

    base = tmp_path / "base"
    texts = _tiny_bert(base)
    data = tmp_path / "lang.jsonl"
    data.write_text("".join(json.dumps({"text": t, "label": "de" if i % 2 == 0 else "en"}) + "\n"
                            for i, t in enumerate(texts)), encoding="utf-8")
    calls = []

    def killed_at_step_3(model, batch):  # the process dies during step 3, after ckpt-2 was written
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return loss(model, batch)

    loss = classify.classify_loss
    monkeypatch.setattr(classify, "classify_loss", killed_at_step_3)
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        run_recipe("classify", out=run, overrides={"progress": False, "max_steps": 10, "checkpoint_every": 2,
                                                    "eval_every": 100, "model": str(base), "data": str(data),
                                                    "max_len": 16, "batch_size": 8})
    monkeypatch.undo()
    assert not (run / "model").exists() and (run / "tokenizer.json").read_bytes() == (
        base / "tokenizer.json").read_bytes()
    assert not list(run.glob(".tokenizer.json.*"))  # written atomically: no temporary left
    before = _listing(run)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the checkpoint's head is read: no "freshly initialised" warning
        assert main(["predict", "--model", str(run), "--text", "a dog runs"]) == 0
    label, p = capsys.readouterr().out.split("\t")[:2]
    assert label in ("de", "en") and 0.5 <= float(p) <= 1
    assert main(["viz", "--model", str(run), "--text", "a dog runs", "--out", str(tmp_path / "view.html")]) == 0
    assert _data((tmp_path / "view.html").read_text(encoding="utf-8"))["kinds"][0]["tokens_q"][0] == "[CLS]"
    assert main(["analyze", "--model", str(run), "--text", "a dog runs", "--no-prune"]) == 0
    assert main(["export", "--model", str(run), "--out", str(tmp_path / "cls.onnx")]) == 0
    assert "BertForSequenceClassification" in capsys.readouterr().out
    assert _listing(run) == before
