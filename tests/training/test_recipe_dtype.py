"""The recipes' precision: ``dtype="auto"`` by default, resolved once, recorded in metrics.json; bad values in one line."""
import json

import pytest

from attnlab import cli
from attnlab._runtime import resolve_dtype
from attnlab.training.recipes import get_recipe, resolve_settings


@pytest.mark.parametrize("recipe, preset", [("shakespeare-char", None), ("shakespeare-char", "nanogpt-cpu"),
                                            ("multi30k-de-en", None), ("mlm", None)])
def test_recipes_default_to_auto(recipe, preset):
    settings = resolve_settings(get_recipe(recipe), preset=preset, overrides={})
    assert settings.dtype == "auto"


def test_metrics_record_the_resolved_dtype_and_why(tmp_path, shakespeare, capsys):
    out = tmp_path / "run"
    rc = cli.main(["train", "shakespeare-char", "--preset", "tiny", "--out", str(out), "--set", "max_steps=4",
                   "--set", "dtype=auto", "--set", "eval_every=0", "--threads", "1"])
    assert rc == 0
    dtype, reason = resolve_dtype("auto")
    m = json.loads((out / "metrics.json").read_text())
    assert (m["dtype"], m["dtype_reason"]) == (dtype, reason)
    assert f"dtype: {dtype} ({reason})" in capsys.readouterr().err  # printed once


@pytest.mark.parametrize("value", ["fp8", "float64", "int8"])
def test_bad_dtype_setting_is_one_line(tmp_path, value, capsys):
    rc = cli.main(["train", "shakespeare-char", "--preset", "tiny", "--out", str(tmp_path / "r"),
                   "--set", f"dtype={value}"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "dtype" in err and "auto, fp32, bf16, fp16" in err
    assert not (tmp_path / "r").exists()  # refused before anything is written


@pytest.mark.parametrize("argv, reason", [([], "preset tiny's default"), (["--dtype", "fp32"], "asked for"),
                                          (["--set", "dtype=fp32"], "asked for")])
def test_the_dtype_line_says_where_the_choice_came_from(tmp_path, shakespeare, capsys, argv, reason):
    out = tmp_path / "run"
    rc = cli.main(["train", "shakespeare-char", "--preset", "tiny", "--out", str(out), "--set", "max_steps=2",
                   "--set", "eval_every=0", "--threads", "1", *argv])
    assert rc == 0
    assert f"dtype: fp32 ({reason})" in capsys.readouterr().err
    assert json.loads((out / "metrics.json").read_text())["dtype_reason"] == reason


def test_a_recipe_default_is_not_said_to_be_asked_for():
    from attnlab.training.recipes import _dtype_source

    classify = get_recipe("classify")
    assert resolve_settings(classify, overrides={}).dtype != "auto"  # an explicit default, not asked for
    assert _dtype_source(classify, None, {}, resumed=False) == "recipe default"
    assert _dtype_source(classify, None, {"dtype": "fp32"}, resumed=False) == "asked for"
    assert _dtype_source(get_recipe("shakespeare-char"), None, {}, resumed=True) == "the run's saved setting"
