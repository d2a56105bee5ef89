"""Errors a user can act on: the CLI refuses with one line that names the flag, exit 2, no traceback.

Each case runs the real command line (``python -m kvshare``), which fails before it starts anything.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from kvshare.commands.make_model import confirm_large_write
from kvshare.errors import UserError


def kvshare(*args: str, timeout: float = 120, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-P", "-m", "kvshare", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )


def refused(result: subprocess.CompletedProcess, *fragments: str) -> str:
    """The one error line of a refused command, checked for ``fragments``."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    for fragment in fragments:
        assert fragment in line, (fragment, result.stderr)
    return line


@pytest.fixture
def busy_port():
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield sock.getsockname()[1]


def test_up_with_a_missing_model_is_refused_before_anything_starts():
    refused(kvshare("up", "--model", "/nope", "--port", "1"), "--model /nope: no such directory, and not a preset")


def test_up_with_a_pool_smaller_than_one_page_of_the_model(tmp_path):
    refused(kvshare("up", "--pool-size", "1MiB"), "page of tiny is 2.00 MiB", "larger than the pool, 1.00 MiB")
    refused(kvshare("up", "--pool-size", "100TiB"), "--pool-size 100.00 TiB is larger than")


def test_serve_and_route_on_a_port_in_use_say_so_in_one_line(busy_port):
    refused(kvshare("serve", "--port", str(busy_port)), f"port {busy_port} (this replica) on 127.0.0.1 is in use")
    refused(
        kvshare("route", "--port", str(busy_port), "--replica", "http://127.0.0.1:1"),
        f"port {busy_port} (the router) on 127.0.0.1 is in use",
    )


def test_route_replica_without_a_scheme():
    refused(kvshare("route", "--replica", "localhost:8001"), "--replica localhost:8001", "http://localhost:8001")


def test_pool_size_and_socket_directory(tmp_path):
    sock = str(tmp_path / "pool.sock")
    refused(kvshare("pool", "--size", "1k", "--socket", sock), "--size 1.00 KiB is below the minimum")
    refused(kvshare("pool", "--size", "100TiB", "--socket", sock), "--size 100.00 TiB is larger than")
    missing = tmp_path / "missing"
    refused(
        kvshare("pool", "--size", "16MiB", "--socket", str(missing / "pool.sock")),
        f"the directory {missing} does not exist",
    )


def test_pool_admin_flush_with_a_namespace_that_is_not_hex():
    refused(kvshare("pool-admin", "flush", "--namespace", "zz"), "--namespace 'zz' is not a hex digest")


def test_make_model_onto_an_existing_file(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("keep me")
    refused(kvshare("make-model", "tiny", "--out", str(path)), f"--out {path} is a file")
    assert path.read_text() == "keep me"


def test_make_model_of_a_gpu_preset_without_a_gpu_refuses_without_a_terminal(tmp_path):
    out = tmp_path / "q"
    refused(kvshare("make-model", "qwen3-8b", "--out", str(out)), "has no GPU", "--yes")
    assert not out.exists()


def test_make_model_asks_on_a_terminal():
    def no(prompt):
        asked.append(prompt)
        return "n"

    asked: list[str] = []
    with pytest.raises(UserError, match="nothing written"):
        confirm_large_write("qwen3-8b", 16 << 30, "/x", has_gpu=False, is_yes=False, is_tty=True, ask=no)
    assert "16.00 GiB of weights to /x" in asked[0] and asked[0].endswith("[y/N] ")
    confirm_large_write("qwen3-8b", 16 << 30, "/x", has_gpu=False, is_yes=False, is_tty=True, ask=lambda _: "y")
    confirm_large_write("qwen3-8b", 16 << 30, "/x", has_gpu=False, is_yes=True, is_tty=False, ask=no)
    confirm_large_write("qwen3-8b", 16 << 30, "/x", has_gpu=True, is_yes=False, is_tty=False, ask=no)
    confirm_large_write("tiny", 10 << 20, "/x", has_gpu=False, is_yes=False, is_tty=False, ask=no)
    assert len(asked) == 1  # only the terminal without --yes, a GPU or a small preset was asked


def test_log_level_after_the_subcommand_and_validated():
    out = kvshare("plan", "--model", "tiny", "--tokens", "1000", "--json", "--log-level", "debug")
    assert out.returncode == 0, out.stderr
    refused(
        kvshare("plan", "--model", "tiny", "--tokens", "1000", "--log-level", "loud"),
        "argument --log-level: 'loud' is not a log level",
    )
    refused(kvshare("--log-level", "loud", "plan", "--model", "tiny", "--tokens", "1000"), "'loud' is not a log level")
