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
