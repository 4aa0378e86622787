"""The flags a user expects of any command line: ``--version``, ``--debug`` anywhere, ``--dtype``'s short names."""
import subprocess
import sys
import attnlab

import pytest

from attnlab.cli import build_parser, main


def _run(*args):
    return subprocess.run([sys.executable, "-m", "attnlab", *args], capture_output=True, text=True, timeout=120)


def test_version_prints_the_package_version():
    out = _run("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"attnlab {attnlab.__version__}"


@pytest.mark.parametrize("argv", [["--debug", "env"], ["env", "--debug"], ["env", "--json", "--debug"]])
def test_debug_is_accepted_before_or_after_the_subcommand(argv):
    assert build_parser("env").parse_args(argv).debug is True


def test_debug_defaults_off():
    assert build_parser("env").parse_args(["env"]).debug is False


def test_debug_after_the_subcommand_shows_the_traceback(capsys):
    assert main(["demo", "--max-steps", "0", "--quiet", "--out", "/tmp/attnlab-cli-test"]) == 2  # one line
    with pytest.raises(ValueError, match="max_steps"):
        main(["demo", "--max-steps", "0", "--quiet", "--out", "/tmp/attnlab-cli-test", "--debug"])


@pytest.mark.parametrize("short, long", [("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16"),
                                         ("float32", "float32"), ("auto", "auto")])
def test_dtype_takes_the_short_names_every_message_prints(short, long):
    assert build_parser("generate").parse_args(["generate", "--model", "m", "--dtype", short]).dtype == long


def test_a_bad_dtype_is_one_line_naming_the_valid_values(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser("env").parse_args(["env", "--dtype", "fp8"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert "--dtype" in err and "auto, fp32, bf16, fp16" in err and "'fp8'" in err
