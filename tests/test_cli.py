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
    _one_line_error(capsys, ["bench", "--list", "--threads", "0"], "bench", "--threads must be >= 1")
    _one_line_error(capsys, ["bench", "--list", "--device", "no-such-device"], "bench", "--device must name")
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


def test_bench_lists_the_scripts_and_refuses_unknown_names(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    for name in ("attention", "generate", "encode", "train"):
        assert any(line.startswith(name + " ") for line in out.splitlines()), name
    _one_line_error(capsys, ["bench", "no-such-benchmark"], "bench", "unknown benchmark")
