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


def test_dtype_means_the_models_dtype_wherever_it_is_taken():
    """Fails when --dtype means three things (serve: weights and KV; plan: a deprecated --kv-dtype; generate: the
    weights in torch's names): now serve, generate and plan take the dtype the model runs in, in vLLM's names,
    which sets the KV's unless --kv-dtype does."""
    parser = build_parser()
    helps = set()
    for command in ("serve", "generate", "plan"):
        sub = parser._subparsers._group_actions[0].choices[command]
        (action,) = [a for a in sub._actions if "--dtype" in a.option_strings]
        helps.add((action.help, tuple(action.choices)))
    assert len(helps) == 1, helps
    args = parser.parse_args(["plan", "--model", "tiny", "--tokens", "10", "--kv-dtype", "fp8"])
    assert args.kv_dtype == "fp8"
    proc = run_cli("plan", "--model", "qwen3-32b", "--tokens", "1000", "--dtype", "float", "--json")
    assert proc.returncode == 0 and '"kv_dtype": "float32"' in proc.stdout and not proc.stderr, proc.stderr
    proc = run_cli(
        "plan", "--model", "qwen3-32b", "--tokens", "1000", "--dtype", "float", "--kv-dtype", "fp8", "--json"
    )
    assert proc.returncode == 0 and '"kv_dtype": "float8_e4m3fn"' in proc.stdout
    assert run_cli("plan", "--model", "qwen3-32b", "--tokens", "10", "--dtype", "fp8").returncode == 2


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


def _parsers():
    """(command path, parser) of kvshare and every subcommand, nested ones included."""
    import argparse

    found, todo = [], [("kvshare", build_parser())]
    while todo:
        path, parser = todo.pop()
        found.append((path, parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += [(f"{path} {name}", sub) for name, sub in action.choices.items()]
    return found


def test_every_option_says_what_it_does_in_the_users_words():
    """Fails where an option has no help text, or a help text or description names an internal module
    (kvshare.commands.bench_micro, kvshare.outputs, kvshare.supervisor) instead of what it does."""
    import re

    for path, parser in _parsers():
        assert not re.search(r"kvshare\.[a-z_]+", parser.description or ""), (path, parser.description)
        for action in parser._actions:
            if action.help == "==SUPPRESS==" or not action.option_strings or action.option_strings == ["-h", "--help"]:
                continue
            assert action.help, (path, action.option_strings)
            assert not re.search(r"kvshare\.[a-z_]+", action.help), (path, action.option_strings, action.help)


def test_the_command_summaries_name_every_subcommand():
    """Fails when `kvshare --help` says bench runs "pool, ttft, blocks, sessions" and pool-admin "flush, list
    leases": the summary names each of their subcommands."""
    for path, parser in _parsers():
        name = path.split()[-1]
        if path.count(" ") != 1 or name not in COMMANDS:
            continue
        subs = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
        for action in subs:
            for sub in action.choices:
                assert sub in COMMANDS[name][1], (name, sub, COMMANDS[name][1])


def test_a_mistyped_model_is_named_alike_by_every_command():
    """Fails when plan says "unknown preset '/nope'" where up says "--model /nope: no such directory, ..."."""
    said = set()
    for argv in (["plan", "--tokens", "1"], ["up"], ["serve"], ["generate", "--prompt", "x"]):
        proc = run_cli(*argv, "--model", "/nope")
        assert proc.returncode == 2, proc.stderr
        said.add(proc.stderr.strip().splitlines()[-1].split(": error: ", 1)[1])
    from kvshare.engine.preset_table import PRESETS

    assert said == {f"--model /nope: no such directory, and not a preset ({', '.join(PRESETS)})"}, said


def test_a_replica_without_tenants_says_why_it_shows_no_provenance():
    """Fails when `kvshare serve` alone answers "kvshare": {} and cached_tokens null with nothing to say why."""
    from kvshare.commands.serve import provenance_note
    from kvshare.serve.config import ServeConfig

    note = provenance_note(ServeConfig())
    assert note is not None and "cache_salt" in note and "--provenance all" in note
    assert provenance_note(ServeConfig(provenance="all")) is None
    assert provenance_note(ServeConfig(api_keys=("k",))) is None
