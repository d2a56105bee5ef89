"""Flags every command shares: ports refused in one line, defaults shown by --help, plan's --kv-dtype."""

import subprocess
import sys

import pytest

from kvshare.cli import COMMANDS, build_parser


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvshare", *argv], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "argv",
    [
        ["up", "--port", "70000"],
        ["serve", "--port", "70000"],
        ["route", "--replica", "http://127.0.0.1:1", "--port", "-1"],
        ["pool", "--size", "1GiB", "--metrics-port", "65536"],
        ["demo", "--port", "http"],
        ["bench", "ttft", "--port", "0"],
    ],
)
def test_a_port_out_of_range_is_refused_in_one_line(argv, capsys):
    """Fails when --port is type=int: the value reached the server and 70000 raised a traceback."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "is not a" in err and "Traceback" not in err


def test_up_with_a_bad_port_exits_2_without_a_traceback():
    proc = run_cli("up", "--port", "70000")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line == "kvshare up: error: argument --port: 70000 is not a TCP port (1-65535)"
    proc = run_cli("up", "--port", "65535", "--replicas", "2")  # the replicas' ports would pass 65535
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "the replicas take the next 2 ports, past 65535" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_shows_the_defaults(command):
    """Fails without the defaults formatter: `route --help` showed no default for --port (8080)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    for action in sub._actions:
        has_default = action.default not in (None, False, "", [], (), "==SUPPRESS==")
        if action.option_strings and action.nargs != 0 and has_default:
            shown = " ".join(sub._get_formatter()._format_action(action).split())
            assert "default" in shown.lower(), (command, shown)


def test_plan_takes_kv_dtype_and_the_old_dtype_with_a_notice():
    """Fails when plan knows only --dtype (argparse: unrecognized arguments: --kv-dtype)."""
    args = build_parser().parse_args(["plan", "--model", "tiny", "--tokens", "10", "--kv-dtype", "fp8"])
    assert args.kv_dtype == "fp8"
    proc = run_cli("plan", "--model", "qwen3-32b", "--tokens", "1000", "--dtype", "bfloat16", "--json")
    assert proc.returncode == 0 and '"kv_dtype": "bfloat16"' in proc.stdout
    assert proc.stderr.strip() == "kvshare plan: --dtype is deprecated; use --kv-dtype bf16"
    assert run_cli("plan", "--model", "qwen3-32b", "--tokens", "10", "--dtype", "int4").returncode == 2


def test_demo_checks_its_ports_before_it_benchmarks_the_pool(tmp_path):
    """Fails when demo finds the router's port taken only after the pool's benchmark (a minute in)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1] - 1  # replica0 takes port + 1: the one in use
        proc = run_cli("demo", "--port", str(port), "--out", str(tmp_path / "report"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"port {port + 1} (replica0)" in proc.stderr and "is in use" in proc.stderr
    assert "shared pool" not in proc.stdout and not (tmp_path / "report").exists()
