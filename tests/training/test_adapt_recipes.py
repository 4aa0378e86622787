"""shakespeare-char from a previous run: `init`, `lora` (only LoRA trains), `teacher` (distillation)."""
import json
import shutil

import pytest
import torch

from attnlab import cli
from attnlab.adapt.lora import lora_layers, parse_lora_spec
from attnlab.data.tokenizers import CharTokenizer
from attnlab.training.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from attnlab.training.distributed import DistInfo
from attnlab.training.losses import distillation_loss, token_cross_entropy
from attnlab.training.recipes import evaluate_checkpoint, get_recipe, resolve_settings, run_recipe
from attnlab.training.recipes.char_runs import load_run_model

RECIPE = "shakespeare-char"
FAST = {"progress": False}
# a 4-layer, 128-wide model (nanogpt-cpu's size) on short blocks and small batches: fast on one thread
WIDE = {**FAST, "n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 32, "batch_size": 4, "eval_batches": 1,
        "eval_batch_size": 4, "eval_every": 0, "log_every": 1}


def _build(overrides, out, *, preset="tiny", training=True):
    recipe = get_recipe(RECIPE)
    torch.manual_seed(0)
    return recipe.build(resolve_settings(recipe, preset=preset, overrides=overrides), out=out, dist=DistInfo(),
                        training=training)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, shakespeare):
    """A tiny-preset run of 10 steps (2 layers, 32 wide): the init and teacher of the tests below."""
    out = tmp_path_factory.mktemp("base") / "run"
    run_recipe(RECIPE, out=out, preset="tiny", overrides={**FAST, "max_steps": 10})
    return out


def test_init_loads_the_runs_latest_weights_exactly(base_run, tmp_path):
    model = _build({"init": str(base_run)}, tmp_path / "ft").model
    saved = load_checkpoint(latest_checkpoint(base_run))["model"]
    got = model.state_dict()
    assert got.keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(got[name], value), name  # bitwise: a copy, not a re-initialisation
    fresh = _build({}, tmp_path / "fresh").model.state_dict()  # without init: other weights
    assert not torch.equal(fresh["wte.weight"], saved["wte.weight"])


@pytest.mark.parametrize("overrides, match", [
    ({"n_layer": "3"}, r"init=.*: layers\.2\..* is absent there but \(.*\) in this model"),
    ({"n_embd": "64"}, r"init=.*: layers\.0\.ffn\.w1\.bias is \(128,\) there but \(256,\) in this model"),
    ({"block_size": "16"}, r"init=.*wpe.* is \(32, 32\) there but \(16, 32\) in this model"),
])
def test_init_shape_mismatch_names_the_parameter(base_run, tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        _build({"init": str(base_run), **overrides}, tmp_path / "x")


def test_init_and_teacher_folders_must_be_runs(tmp_path, base_run):
    with pytest.raises(FileNotFoundError, match=r"init=.*nothing: no config.json"):
        _build({"init": str(tmp_path / "nothing")}, tmp_path / "x")
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(base_run / "config.json", empty / "config.json")
    with pytest.raises(FileNotFoundError, match=r"teacher=.*empty: no checkpoint"):
        _build({"teacher": str(empty)}, tmp_path / "y")
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"recipe": "mlm", "settings": {}}))
    with pytest.raises(ValueError, match=r"teacher=.*other holds a 'mlm' run, not a shakespeare-char one"):
        _build({"teacher": str(other)}, tmp_path / "z")


@pytest.mark.parametrize("spec, match", [
    ("r=0", r"need r >= 1"),
    ("r=-2", r"need r >= 1"),
    ("rank=8", r"expected comma-separated r=INT.*got 'rank=8'"),
    ("8", r"expected comma-separated r=INT.*got '8'"),
    ("r=x", r"r must be int, got 'x'"),
    ("alpha=16", r"has no rank"),
    ("r=8,dropout=1.5", r"0 <= dropout < 1"),
    ("r=8,alpha=0", r"alpha > 0"),
])
def test_bad_lora_spec_is_a_clear_error(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_lora_spec(spec)
    with pytest.raises(ValueError, match=match):  # checked with the settings, before any data or model
        resolve_settings(get_recipe(RECIPE), preset="tiny", overrides={"lora": spec})


def test_lora_spec_parsing():
    assert parse_lora_spec("r=8") == {"r": 8, "alpha": 8.0, "dropout": 0.0}
    assert parse_lora_spec(" r=4 , alpha=16, dropout=0.1") == {"r": 4, "alpha": 16.0, "dropout": 0.1}


@pytest.mark.parametrize("overrides, match", [
    ({"distill_temperature": "0"}, r"distill_temperature must be > 0"),
    ({"distill_alpha": "1.5"}, r"distill_alpha must be in \[0, 1\]"),
])
def test_bad_distillation_settings(overrides, match):
    with pytest.raises(ValueError, match=match):
        resolve_settings(get_recipe(RECIPE), preset="tiny", overrides=overrides)


def test_lora_run_trains_only_lora_and_resumes_exactly(tmp_path, shakespeare):
    base = tmp_path / "base"
    run_recipe(RECIPE, out=base, preset="tiny", overrides={**WIDE, "max_steps": 2})
    out = tmp_path / "lora"
    m = run_recipe(RECIPE, out=out, preset="tiny", overrides={**WIDE, "max_steps": 4, "checkpoint_every": 2,
                                                              "init": str(base), "lora": "r=8,alpha=16"})
    # r = 8 on q and v of 4 layers: 4 · 2 · (8·128 + 128·8) = 16384 trainable of ~0.82 M
    total = sum(p.numel() for p in load_run_model(base).parameters()) + 16384
    assert (m["trainable_parameters"], m["total_parameters"]) == (16384, total)
    assert 0.01 < m["trainable_fraction"] == 16384 / total <= 0.02
    assert m["lora"] == "r=8,alpha=16" and m["init"] == str(base)

    before = load_checkpoint(latest_checkpoint(base))["model"]
    after = load_checkpoint(latest_checkpoint(out))["model"]
    lora_keys = {k for k in after if ".lora_" in k}
    assert len(lora_keys) == 4 * 2 * 2  # A and B for q and v of each layer
    for name, value in after.items():
        if name in lora_keys:
            continue
        assert torch.equal(value, before[name.replace(".base.", ".")]), name  # frozen: unchanged bitwise
    assert all(after[k].abs().max() > 0 for k in lora_keys if "lora_B" in k)  # B starts at 0: it trained

    # evaluation rebuilds the LoRA model from config.json; the merged model scores the same
    scored = evaluate_checkpoint(out)
    assert scored["val_loss"] == pytest.approx(m["val_loss"], rel=1e-6)
    merged = load_run_model(out)
    assert not lora_layers(merged)
    # resume from step 2 with LoRA: the same step-4 parameters, bitwise
    final = {k: v.clone() for k, v in after.items()}
    list_checkpoints(out)[-1].unlink()
    run_recipe(RECIPE, out=out, resume=True)
    again = load_checkpoint(latest_checkpoint(out))["model"]
    assert all(torch.equal(again[k], final[k]) for k in final)


def test_distillation_uses_the_teacher(base_run, tmp_path):
    # the student is a copy of the teacher: with alpha = 1 (soft term only) the loss is KL(p ‖ p) = 0
    same = _build({"init": str(base_run), "teacher": str(base_run), "distill_alpha": "1"}, tmp_path / "a")
    batch = next(same.train_batches)
    loss, n = same.loss_fn(same.model, batch)
    assert n == batch[1].numel() and abs(loss.item()) < 1e-6
    # a fresh student: the loss is the formula on the teacher's logits (T = 3, alpha = 0.7)
    student = _build({"teacher": str(base_run), "distill_alpha": "0.7", "distill_temperature": "3"}, tmp_path / "b")
    x, y = batch
    loss, _ = student.loss_fn(student.model, batch)
    teacher = load_run_model(base_run)
    with torch.no_grad():
        want = distillation_loss(student.model(x).logits, teacher(x).logits, y, temperature=3.0, alpha=0.7)
        hard = token_cross_entropy(student.model(x).logits, y)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    assert abs(loss.item() - hard.item()) > 1e-3  # the teacher's term changes the loss
    loss.backward()
    assert all(p.grad is not None for p in student.model.parameters())
    # the plain recipe (no teacher) is the hard loss
    plain = _build({}, tmp_path / "c")
    torch.testing.assert_close(plain.loss_fn(student.model, batch)[0], hard, rtol=1e-5, atol=1e-6)


def test_teacher_is_frozen_in_eval_mode(base_run):
    teacher = load_run_model(base_run, role="teacher")
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())


def test_teacher_must_share_the_vocabulary_and_context(base_run, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(base_run, other)
    tok = CharTokenizer.load(other / "tokenizer.json")
    CharTokenizer(list(reversed(tok.chars))).save(other / "tokenizer.json")
    with pytest.raises(ValueError, match=r"teacher=.*other: its vocabulary .* a teacher must share the tokenizer"):
        _build({"teacher": str(other)}, tmp_path / "x")
    with pytest.raises(ValueError, match=r"teacher=.*: its context \(32\) is shorter than block_size=64"):
        _build({"teacher": str(base_run), "block_size": "64"}, tmp_path / "y")


def test_distilled_run_end_to_end_and_cli_flags(base_run, tmp_path, capsys):
    out = tmp_path / "kd"
    m = run_recipe(RECIPE, out=out, preset="tiny", overrides={**FAST, "max_steps": 4, "n_layer": 1,
                                                              "teacher": str(base_run)})
    assert m["teacher"] == str(base_run) and m["steps"] == 4
    # the checkpoint holds the student only, and evaluates without the teacher
    assert not any(k.startswith("teacher") for k in load_checkpoint(latest_checkpoint(out))["model"])
    assert evaluate_checkpoint(out)["val_loss"] == pytest.approx(m["val_loss"], rel=1e-6)

    ft = tmp_path / "ft"
    rc = cli.main(["train", RECIPE, "--preset", "tiny", "--out", str(ft), "--quiet", "--set", "max_steps=2",
                   "--init", str(base_run), "--lora", "r=2"])
    assert rc == 0
    settings = json.loads((ft / "config.json").read_text())["settings"]
    assert settings["init"] == str(base_run) and settings["lora"] == "r=2"
    capsys.readouterr()
    assert cli.main(["train", RECIPE, "--preset", "tiny", "--out", str(tmp_path / "bad"), "--lora", "r=0"]) == 2
    assert "need r >= 1" in capsys.readouterr().err
