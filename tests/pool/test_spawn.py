"""Children are started so that the working directory cannot shadow the package."""

from __future__ import annotations

import re
from pathlib import Path

import kvshare
from kvshare.pool.spawn import kvshare_command, kvshare_env

PACKAGE = Path(kvshare.__file__).parent


def test_the_child_command_leaves_the_working_directory_off_sys_path():
    argv = kvshare_command("WARNING")
    assert argv[1:4] == ["-P", "-m", "kvshare"] and argv[-2:] == ["--log-level", "WARNING"]


def test_every_kvshare_child_is_started_through_kvshare_command():
    plain = re.compile(r"""["']-m["']\s*,\s*["']kvshare["']""")
    offenders = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p.name != "spawn.py" and plain.search(p.read_text())
    ]
    assert offenders == []


def test_the_child_imports_this_package():
    root = str(PACKAGE.parent)
    env = kvshare_env({"PYTHONPATH": "/elsewhere"})
    assert env["PYTHONPATH"] in (root + ":/elsewhere", "/elsewhere")  # first, unless installed in site-packages


def test_vllm_servers_leave_the_working_directory_off_sys_path_too():
    from kvshare.integrations.vllm.launch import VllmServerConfig, vllm_server_command

    spec = vllm_server_command(
        VllmServerConfig(model="/m", port=1, host="127.0.0.1", pool_socket=None, python="python3", replica="r")
    )
    assert spec.env["PYTHONSAFEPATH"] == "1"
