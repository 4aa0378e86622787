"""Recipe registry, --set parsing, shakespeare-char presets, run_recipe/evaluate_checkpoint, `attnlab train`."""
import json

import pytest

from attnlab import cli
from attnlab.training.checkpoint import latest_checkpoint
from attnlab.training.recipes import evaluate_checkpoint, get_recipe, parse_set, resolve_settings, run_recipe

FAST = {"progress": False}


def test_parse_set_and_type_conversion():
    assert parse_set(["a=1", "b = x=y", "a=2"]) == {"a": "2", "b": "x=y"}
    with pytest.raises(ValueError, match="key=value"):
        parse_set(["novalue"])
    r = get_recipe("shakespeare-char")
    s = resolve_settings(r, preset="tiny", overrides={
        "betas": "0.9,0.95", "compile": "true", "max_seconds": "none", "lr": "3e-3", "n_layer": "3",
        "dtype": "bf16", "dropout": "0.2", "progress": "off"})
    assert s.betas == (0.9, 0.95) and s.compile is True and s.max_seconds is None and s.lr == 3e-3
    assert s.n_layer == 3 and s.dtype == "bf16" and s.dropout == 0.2 and s.progress is False
    assert s.n_embd == 32  # from the preset
    assert resolve_settings(r, overrides={"max_steps": 7}).max_steps == 7  # typed values pass through


def test_nanogpt_cpu_preset_runs_int8_products_and_one_setting_turns_them_off():
    """nanoGPT's CPU recipe with int8 products (measured in the shakespeare module's docstring); the default where
    its products would be fp32 (the trainer decides: tests/adapt/test_int8_training.py)."""
    recipe = get_recipe("shakespeare-char")
    assert resolve_settings(recipe, preset="nanogpt-cpu").int8_training is True
    assert resolve_settings(recipe, preset="nanogpt-cpu", overrides={"int8_training": "false"}).int8_training is False
    assert resolve_settings(recipe).int8_training is None  # the default: where the products would be fp32
    assert resolve_settings(recipe, overrides={"int8_training": "none"}).int8_training is None


def test_default_preset_is_llama_with_muon_dropout_and_context_256():
    """The 10-minute default (its choices: ShakespeareSettings' docstring); AdamW is one setting away, Muon's
    settings are refused without Muon unless at a default; ``dropout`` reaches Llama as ``hidden_dropout``."""
    from attnlab.training.recipes.shakespeare import make_model
    recipe = get_recipe("shakespeare-char")
    s = resolve_settings(recipe)
    got = {k: getattr(s, k) for k in ("arch", "optimizer", "muon_lr_scale", "muon_ns_steps", "dropout", "block_size",
                                      "batch_size", "n_layer", "n_embd", "time_budget", "max_steps")}
    assert got == dict(arch="llama", optimizer="muon", muon_lr_scale=2.0, muon_ns_steps=3, dropout=None,
                       block_size=256, batch_size=16, n_layer=4, n_embd=256, time_budget=575.0,
                       max_steps=2400)  # planned to 10 minutes, but never past ~9.8 epochs (it overfits there)
    model = make_model(s, vocab_size=65, dropout=0.05)
    assert model.config.hidden_dropout == 0.05 and model.layers[0].dropout1.p == 0.05 and model.drop.p == 0.05
    assert make_model(s, vocab_size=65).config.hidden_dropout == 0.0  # dropout=None and no rate given: none
    assert resolve_settings(recipe, overrides={"optimizer": "adamw"}).optimizer == "adamw"
    with pytest.raises(ValueError, match=r"muon_lr_scale must be left at its default \(2.0, muon_ns_steps 3\)"):
        resolve_settings(recipe, overrides={"optimizer": "adamw", "muon_ns_steps": "4"})
    for preset in ("nanogpt-cpu", "tiny"):  # nanoGPT's recipe and the smoke run stay on AdamW
        assert resolve_settings(recipe, preset=preset).optimizer == "adamw"


def test_default_dropout_follows_the_dtype_the_run_computes_in(tmp_path, shakespeare, monkeypatch):
    """dropout=None: 0.05 where the run computes in bf16 (enough steps to overfit), none in fp32; a set rate wins;
    the rate and its reason land in metrics.json."""
    import torch

    from attnlab.training.recipes import shakespeare as recipe_module
    m = run_recipe("shakespeare-char", out=tmp_path / "run", preset="tiny",
                   overrides={**FAST, "arch": "llama", "dropout": "none", "max_steps": 2})  # tiny: fp32
    assert m["dropout"] == 0.0 and m["dropout_reason"].startswith("fp32")
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["dropout"] == 0.0
    recipe, cpu = get_recipe("shakespeare-char"), torch.device("cpu")
    assert recipe_module.train_dropout(resolve_settings(recipe, overrides={"dtype": "fp32"}), cpu)[0] == 0.0
    assert recipe_module.train_dropout(resolve_settings(recipe, overrides={"dtype": "fp32", "dropout": "0.1"}),
                                       cpu) == (0.1, "asked for")
    from attnlab.training import config as config_module
    seen = []
    monkeypatch.setattr(config_module, "resolve_dtype", lambda value, device, **_: seen.append((value, device))
                        or ("bf16", "native bf16"))  # a CPU with native bf16, whatever this one has
    rate, why = recipe_module.train_dropout(resolve_settings(recipe), cpu)
    assert (rate, seen) == (0.05, [("auto", cpu)]) and why.startswith("bf16")
    # int8 products: the run computes in fp32 there too (config.run_dtype, as the trainer), so no dropout
    assert recipe_module.train_dropout(resolve_settings(recipe, overrides={"int8_training": "true"}), cpu)[0] == 0.0
    with pytest.raises(ValueError, match=r"dropout must be"):
        resolve_settings(recipe, overrides={"dropout": "1.5"})


@pytest.mark.parametrize("name", ["multi30k-de-en", "mlm", "classify", "digits-vit"])
def test_fixed_length_recipes_never_stop_on_the_clock(name):
    """A slower CPU takes longer, never gets a worse model: only shakespeare-char's default is defined by its
    10 minutes (``time_budget``); every other recipe's default runs its ``max_steps`` whatever the machine."""
    s = resolve_settings(get_recipe(name))
    assert s.max_seconds is None and s.time_budget is None and s.max_steps > 0
    assert resolve_settings(get_recipe("shakespeare-char")).time_budget == 575.0


@pytest.mark.parametrize("overrides, match", [
    ({"nope": "1"}, r"unknown setting 'nope' for recipe shakespeare-char; valid settings: max_steps, .*n_layer"),
    ({"n_layer": "abc"}, r"--set n_layer='abc': expected int"),
    ({"compile": "maybe"}, r"--set compile='maybe': expected bool"),
    ({"betas": "0.9"}, r"--set betas='0.9': expected tuple\[float, float\]"),
    ({"n_layer": "0"}, r"n_layer must be an int >= 1"),
    ({"lr": "-1"}, r"TrainConfig.lr must be"),
])
def test_setting_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        resolve_settings(get_recipe("shakespeare-char"), overrides=overrides)


def test_unknown_recipe_and_preset():
    with pytest.raises(ValueError, match="unknown recipe 'gpt5'; available: .*shakespeare-char"):
        get_recipe("gpt5")
    with pytest.raises(ValueError, match="unknown preset 'huge' .* available: default, nanogpt-cpu, tiny"):
        resolve_settings(get_recipe("shakespeare-char"), preset="huge")


def test_nanogpt_cpu_preset_is_nanogpts_recipe():
    s = resolve_settings(get_recipe("shakespeare-char"), preset="nanogpt-cpu")
    got = {k: getattr(s, k) for k in ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "max_steps", "lr",
                                      "min_lr", "warmup_steps", "betas", "weight_decay", "clip", "dropout",
                                      "optimizer", "schedule", "grad_accum")}
    assert got == dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12, max_steps=2000, lr=1e-3,
                       min_lr=1e-4, warmup_steps=100, betas=(0.9, 0.99), weight_decay=0.1, clip=1.0, dropout=0.0,
                       optimizer="adamw", schedule="cosine", grad_accum=1)


@pytest.mark.parametrize("overrides, match", [
    ({"arch": "mamba"}, r"arch must be one of 'gpt2', 'llama', got 'mamba'"),
    ({"arch": "llama", "attn_dropout": "0.1"},
     r"arch=llama has no attention dropout, no biases and a gated MLP \(activation swiglu or relu2_glu\); "
     r"got attn_dropout=0.1"),
    ({"arch": "llama", "dropout": "0", "bias": "true"}, r"arch=llama .*got bias=True"),
    ({"arch": "llama", "dropout": "0", "activation": "gelu"}, r"arch=llama .*got activation='gelu'"),
    ({"ffn_dim": "0"}, r"ffn_dim must be an int >= 1 or None"),
    ({"arch": "gpt2", "tie_embeddings": "false"},
     r"tie_embeddings=false, logit_softcap, qk_norm and value_embeddings are arch=llama settings"),
    ({"arch": "gpt2", "logit_softcap": "30"}, r"arch=llama settings"),
    ({"arch": "gpt2", "qk_norm": "true"}, r"arch=llama settings"),
    ({"arch": "gpt2", "value_embeddings": "true"}, r"arch=llama settings"),
    ({"arch": "llama", "activation": "relu2"}, r"arch=llama .*got activation='relu2'"),
    ({"qk_norm": "2"}, r"--set qk_norm=.2.: expected bool"),
    ({"logit_softcap": "0"}, r"logit_softcap must be a positive finite number"),
    ({"logit_softcap": "inf"}, r"logit_softcap must be a positive finite number"),
    ({"optimizer": "lion"}, r"TrainConfig.optimizer must be one of \['adamw', 'adafactor', 'muon'\]"),
])
def test_arch_setting_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        resolve_settings(get_recipe("shakespeare-char"), overrides=overrides)


def test_arch_builds_gpt2_or_llama_with_gpt2_initialisation():
    import torch

    from attnlab.models.gpt import GPT2LMHeadModel
    from attnlab.models.llama import LlamaForCausalLM
    from attnlab.training.recipes.shakespeare import make_model
    r = get_recipe("shakespeare-char")
    torch.manual_seed(0)
    gpt = make_model(resolve_settings(r, overrides={"arch": "gpt2", "n_layer": 2}), vocab_size=65)
    llama = make_model(resolve_settings(r, overrides={"arch": "llama", "n_layer": 2, "dropout": 0.0}), vocab_size=65)
    assert isinstance(gpt, GPT2LMHeadModel) and isinstance(llama, LlamaForCausalLM)
    assert gpt.layers[0].ffn.w1.out_features == 1024 and gpt.layers[0].ffn.w1.bias is not None
    # SwiGLU width 8/3 x 256 = 682.7, rounded up to a multiple of 32: the parameter counts nearly match
    assert llama.layers[0].ffn.w1.out_features == 704 and llama.layers[0].ffn.w1.bias is None
    n_gpt, n_llama = (sum(p.numel() for p in m.parameters()) for m in (gpt, llama))
    assert abs(n_llama - n_gpt) / n_gpt < 0.05
    assert llama.lm_head.weight is llama.embed_tokens.weight  # tied, as the GPT
    for model in (gpt, llama):  # GPT-2's init: N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 n_layer))
        layer = model.layers[1]
        assert layer.self_attn.in_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
        for proj in (layer.self_attn.out_proj, layer.ffn.w2):
            assert proj.weight.std().item() == pytest.approx(0.02 / 2, rel=0.05)


def test_training_levers_build_what_they_name():
    """zero_init: residual output projections at 0; tie_embeddings=false: a head of its own; logit_softcap: |logits| < c."""
    import torch

    from attnlab.training.recipes.shakespeare import make_model
    r = get_recipe("shakespeare-char")
    for arch in ("gpt2", "llama"):
        model = make_model(resolve_settings(r, preset="tiny", overrides={"arch": arch, "zero_init": True}),
                           vocab_size=65)
        for layer in model.layers:
            assert not layer.self_attn.out_proj.weight.any() and not layer.ffn.w2.weight.any()
            assert layer.self_attn.in_proj.weight.std().item() == pytest.approx(0.02, rel=0.1)
    untied = make_model(resolve_settings(r, preset="tiny", overrides={"arch": "llama", "tie_embeddings": False}),
                        vocab_size=65)
    assert untied.lm_head.weight is not untied.embed_tokens.weight and not untied.config.tie_word_embeddings
    capped = make_model(resolve_settings(r, preset="tiny", overrides={"arch": "llama", "logit_softcap": 2.0}),
                        vocab_size=65)
    with torch.no_grad():
        capped.lm_head.weight.mul_(500.0)
        logits = capped(torch.randint(0, 65, (2, 8))).logits
    assert logits.abs().max() <= 2.0 and logits.abs().max() > 1.9
    more = make_model(resolve_settings(r, preset="tiny", overrides={"arch": "llama", "qk_norm": True,
                                                                     "activation": "relu2_glu",
                                                                     "value_embeddings": True}), vocab_size=65)
    assert more.config.qk_norm and more.config.hidden_act == "relu2" and more.config.value_embeddings
    attn = more.layers[0].self_attn
    assert attn.q_norm.weight.shape == (attn.head_dim,) and more.layers[0].ffn.activation == "relu2_glu"
    assert len(more.value_embeds) == len(more.layers) and more.value_embeds[0].weight.shape == (65, attn.embed_dim)


def test_muon_and_the_levers_train_and_resume(tmp_path, shakespeare):
    from attnlab.training.recipes.char_runs import load_run_model
    over = {**FAST, "arch": "llama", "max_steps": 12, "optimizer": "muon", "zero_init": True,
            "tie_embeddings": False, "logit_softcap": 30.0, "qk_norm": True, "activation": "relu2_glu",
            "value_embeddings": True, "muon_lr_scale": 2.0, "muon_ns_steps": 4}
    m = run_recipe("shakespeare-char", out=tmp_path / "run", preset="tiny", overrides=over)
    assert m["steps"] == 12 and m["val_loss"] < 4.17  # below log(65): it learns
    m2 = run_recipe("shakespeare-char", out=tmp_path / "run", overrides={"max_steps": 16}, resume=True)
    model = load_run_model(tmp_path / "run")
    assert m2["steps"] == 16 and model.config.final_logit_softcapping == 30.0
    assert model.config.qk_norm and model.config.value_embeddings and model.config.hidden_act == "relu2"
    assert evaluate_checkpoint(tmp_path / "run")["val_loss"] == m2["val_loss"]


def test_llama_arch_trains_resumes_and_reloads(tmp_path, shakespeare):
    from attnlab.models.llama import LlamaForCausalLM
    from attnlab.training.recipes.char_runs import load_run_model
    out = tmp_path / "llama"
    over = {**FAST, "arch": "llama", "max_steps": 20}
    m = run_recipe("shakespeare-char", out=out, preset="tiny", overrides=over)
    assert m["steps"] == 20 and m["val_loss"] < 4.17  # learns
    m2 = run_recipe("shakespeare-char", out=out, overrides={"max_steps": 25}, resume=True)
    assert m2["steps"] == 25
    model = load_run_model(out)
    assert isinstance(model, LlamaForCausalLM) and model.config.hidden_size == 32
    assert evaluate_checkpoint(out)["val_loss"] == m2["val_loss"]
    # adapting a llama run: LoRA on its packed query/value projections, and distillation from it
    lora = run_recipe("shakespeare-char", out=tmp_path / "lora", preset="tiny",
                      overrides={**over, "max_steps": 5, "init": str(out), "lora": "r=4"})
    assert lora["steps"] == 5 and 0 < lora["trainable_fraction"] < 0.5
    kd = run_recipe("shakespeare-char", out=tmp_path / "kd", preset="tiny",
                    overrides={**over, "max_steps": 5, "n_layer": 1, "teacher": str(out)})
    assert kd["steps"] == 5 and kd["teacher"] == str(out) and kd["val_loss"] < 4.17


def test_run_resume_and_evaluate_checkpoint(tmp_path, shakespeare):
    out = tmp_path / "run"
    m = run_recipe("shakespeare-char", out=out, preset="tiny", overrides={**FAST, "max_steps": 20})
    for name in ("config.json", "metrics.json", "metrics.jsonl", "loss.png", "tokenizer.json"):
        assert (out / name).is_file(), name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["recipe"] == "shakespeare-char" and cfg["preset"] == "tiny" and cfg["settings"]["max_steps"] == 20
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["val_loss"] == m["val_loss"] and saved["steps"] == 20 and saved["vocab_size"] == 65
    assert saved["val_loss"] < 4.17  # below the uniform guess ln 65: it learns
    for key in ("train_tokens_per_s", "wall_s", "total_wall_s", "best_val_loss"):
        assert saved[key] > 0
    # resume with only an override: the saved settings (preset tiny) are the base; 20 -> 30 steps
    m2 = run_recipe("shakespeare-char", out=out, overrides={"max_steps": 30}, resume=True)
    assert m2["steps"] == 30 and m2["preset"] == "tiny"
    assert json.loads((out / "config.json").read_text())["settings"]["max_steps"] == 30
    # the checkpoint scores exactly as the run's own final evaluation
    scores = evaluate_checkpoint(out)
    assert scores["step"] == 30 and scores["checkpoint"] == str(latest_checkpoint(out))
    assert scores["val_loss"] == m2["val_loss"] and scores["val_accuracy"] == m2["val_accuracy"]
    png = tmp_path / "calib.png"
    some = evaluate_checkpoint(out, max_batches=1, metrics=["loss", "ece"], reliability_png=str(png))
    assert set(some) >= {"val_loss", "val_ece"} and "val_ppl" not in some and 0 <= some["val_ece"] <= 1
    assert png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="split must be 'val'"):
        evaluate_checkpoint(out, split="test")
    with pytest.raises(ValueError, match="does not take evaluation option"):
        evaluate_checkpoint(out, beam=4)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        evaluate_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="was trained with preset 'tiny', not 'nanogpt-cpu'"):
        run_recipe("shakespeare-char", out=out, preset="nanogpt-cpu", resume=True)
    with pytest.raises(ValueError, match="already holds checkpoints"):
        run_recipe("shakespeare-char", out=out, preset="tiny", overrides=FAST)


def test_cli_train_and_eval(tmp_path, shakespeare, capsys):
    out = tmp_path / "cli"
    rc = cli.main(["train", "shakespeare-char", "--preset", "tiny", "--out", str(out), "--set", "max_steps=10",
                   "--quiet", "--threads", "1"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 10 and summary["val_loss"] > 0
    assert cli.main(["eval", "--checkpoint", str(out)]) == 0
    assert "val_loss" in capsys.readouterr().out
    assert cli.main(["train", "shakespeare-char", "--out", str(tmp_path / "x"), "--set", "foo=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown setting 'foo'" in err and "valid settings" in err


def test_cli_diverged_run_prints_one_line(tmp_path, shakespeare, capsys):
    rc = cli.main(["train", "shakespeare-char", "--preset", "tiny", "--out", str(tmp_path), "--quiet",
                   "--set", "lr=1e30", "--set", "min_lr=0"])
    assert rc == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "training diverged at step" in err and "loss is nan" in err


def test_cli_missing_data_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ATTNLAB_DATA_DIR", str(tmp_path / "nothing-here"))
    rc = cli.main(["train", "shakespeare-char", "--preset", "tiny", "--out", str(tmp_path / "run")])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "ATTNLAB_DATA_DIR" in err
    assert "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt" in err
    assert not (tmp_path / "run").exists()  # nothing written for a run that could not start


@pytest.mark.slow
def test_compiled_forward_trains_like_eager(tmp_path, shakespeare, monkeypatch):
    """``compile=true`` (inductor on CPU) gives the eager run's losses up to kernel round-off (1e-4 relative)."""
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    same = {**FAST, "max_steps": 10, "int8_training": False}  # float products: compile traces PyTorch's operations
    eager = run_recipe("shakespeare-char", out=tmp_path / "e", preset="tiny", overrides=same)
    comp = run_recipe("shakespeare-char", out=tmp_path / "c", preset="tiny", overrides={**same, "compile": True})
    assert comp["train_loss"] == pytest.approx(eager["train_loss"], rel=1e-4)
    assert comp["val_loss"] == pytest.approx(eager["val_loss"], rel=1e-4)


@pytest.mark.slow
def test_nanogpt_cpu_preset_learns(tmp_path, shakespeare):
    """The full nanogpt-cpu recipe (2000 steps). Quality only; speed is benchmarks/train.py's job.
    nanoGPT reports 1.874 on its 20 x 12-block estimate; seeds and eval draws move ours by ~0.01."""
    m = run_recipe("shakespeare-char", out=tmp_path, preset="nanogpt-cpu", overrides=FAST)
    assert m["steps"] == 2000 and m["val_loss"] < 1.92


def test_generate_samples_from_a_run_folder(tmp_path, shakespeare, capsys):
    """``attnlab generate --model RUN`` on a shakespeare-char run: from a new line by default (as nanoGPT's
    sample.py), the run's character tokenizer, the model at its newest checkpoint."""
    import torch

    from attnlab import cli
    from attnlab.data.tokenizers import CharTokenizer
    from attnlab.training.recipes.char_runs import load_run_model

    out = tmp_path / "run"
    run_recipe("shakespeare-char", out=out, preset="tiny", overrides={**FAST, "max_steps": 3})
    assert cli.main(["generate", "--model", str(out), "--max-new-tokens", "12", "--dtype", "float32"]) == 0
    captured = capsys.readouterr()
    tok = CharTokenizer.load(out / "tokenizer.json")
    new = load_run_model(out).generate(torch.tensor([tok.encode("\n")]), max_new_tokens=12)[0, 1:]
    assert captured.out.split("\n", 1)[1] == "\n" + tok.decode(new.tolist()) + "\n"
    assert "12 tokens in" in captured.err and "% of this machine's bandwidth bound" in captured.err


def test_a_run_folder_samples_past_its_block_as_sample_py(tmp_path, shakespeare, capsys):
    """nanoGPT's sample.py on a run folder: any number of new tokens (the context cropped to the block, 32 here),
    several samples, and nanoGPT's setting names in the run's settings."""
    from attnlab import cli

    out = tmp_path / "run"
    assert cli.main(["train", "shakespeare-char", "--preset", "tiny", "--out", str(out), "--quiet", "--threads", "1",
                     "--set", "max_iters=3", "--set", "eval_interval=0", "--set", "block_size=32"]) == 0
    capsys.readouterr()
    assert cli.main(["generate", "--model", str(out), "--max-new-tokens", "100", "--num-samples", "2",
                     "--do-sample", "--top-k", "5", "--dtype", "fp32"]) == 0
    captured = capsys.readouterr()
    samples = captured.out.split("\n", 1)[1].split("---------------\n")
    assert len(samples) == 2 and all(len(s) == 1 + 100 + 1 for s in samples)  # the new line, 100 chars, the end
    assert captured.err.count("100 tokens in") == 2 and "the last 32 tokens" in captured.err
