"""The command line: help, `python -m attnlab`, one-line user errors."""
import subprocess
import sys

from attnlab.cli import COMMANDS, main


def _run(*args):
    return subprocess.run([sys.executable, "-m", "attnlab", *args], capture_output=True, text=True, timeout=120)


def test_help_lists_every_subcommand():
    out = _run("--help")
    assert out.returncode == 0
    for name in COMMANDS:
        assert name in out.stdout


def test_subcommand_help_has_examples():
    out = _run("demo", "--help")
    assert out.returncode == 0 and "examples:" in out.stdout and "--out" in out.stdout


def test_user_error_is_one_line_without_traceback(capsys):
    assert main(["demo", "--max-steps", "0", "--quiet", "--out", "/tmp/attnlab-cli-test"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnlab demo: error: max_steps") and "Traceback" not in err
    assert len(err.splitlines()) == 1


def test_unknown_subcommand_fails():
    out = _run("no-such-command")
    assert out.returncode == 2 and "invalid choice" in out.stderr


def test_every_subcommand_help_has_examples_and_the_common_flags():
    from attnlab.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(sub.choices) == set(COMMANDS)
    for name, parser in sub.choices.items():
        text = parser.format_help()
        assert "examples:" in text, name
        for flag in ("--seed", "--threads", "--device", "--dtype"):
            assert flag in text, (name, flag)


def _one_line_error(capsys, argv, command, fragment):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"attnlab {command}: error:") and fragment in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_common_flags_are_checked_in_one_line(capsys):
    _one_line_error(capsys, ["bench", "--list", "--threads", "0"], "bench", "--threads must be an int in [1, 1024]")
    _one_line_error(capsys, ["bench", "--list", "--device", "no-such-device"], "bench",
                    "--device must be one of cpu, cuda, cuda:N")
    _one_line_error(capsys, ["demo", "--dtype", "bfloat16", "--out", "/tmp/x"], "demo", "runs on the CPU in float32")
    _one_line_error(capsys, ["eval", "--hyp", "a", "--ref", "b", "--device", "cpu"], "eval",
                    "--device applies to --checkpoint only")


def test_common_seed_and_threads_are_applied(monkeypatch):
    import torch

    import attnlab.cli as cli
    seen = {}

    def fake(args):
        seen.update(seed=args.seed, first=torch.rand(1).item(), threads=torch.get_num_threads())
        return 0

    import types

    real_import = cli.importlib.import_module
    fake_module = types.SimpleNamespace(EPILOG="examples: none", add_arguments=lambda p: None, main=fake)
    monkeypatch.setitem(COMMANDS, "bench", (COMMANDS["bench"][0], "tests.fake"))
    monkeypatch.setattr(cli.importlib, "import_module",
                        lambda name: fake_module if name == "tests.fake" else real_import(name))
    before = torch.get_num_threads()
    try:
        assert cli.main(["bench", "--seed", "7", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(before)
    torch.manual_seed(7)
    assert seen == {"seed": 7, "first": torch.rand(1).item(), "threads": 1}


def test_bench_lists_every_script_and_each_listed_one_runs_as_a_program(capsys):
    """``--list`` prints one line per ``benchmarks/NAME.py`` (``_NAME.py`` are their shared modules), with the
    first line of its docstring; each listed script defines ``main`` and calls it when run as a program (checked
    in the source: running them takes minutes)."""
    import ast

    from attnlab.bench import benchmarks_dir

    assert main(["bench", "--list"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    scripts = sorted(p for p in benchmarks_dir().glob("*.py") if not p.name.startswith("_"))
    assert sorted(lines) == [p.stem for p in scripts] and {"attention", "generate", "encode", "train"} <= set(lines)
    for script in scripts:
        tree = ast.parse(script.read_text(encoding="utf-8"))
        assert lines[script.stem].split(None, 1)[1] == ast.get_docstring(tree).strip().splitlines()[0], script.name
        assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body), f"{script.name}: no main"
        runs = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "__name__ == '__main__'"]
        assert runs and "main(" in ast.unparse(runs[0]), f"{script.name}: main is not called when run"
    _one_line_error(capsys, ["bench", "no-such-benchmark"], "bench", "unknown benchmark")
