"""Start a pool daemon as a child process and wait until it answers."""

from __future__ import annotations

import contextlib
import os
import site
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping

import kvshare
from kvshare.pool.client import PoolClient, PoolRequestError, PoolUnavailable


def kvshare_command(log_level: str = "INFO") -> list[str]:
    """The argv prefix of a ``kvshare`` child process: this interpreter, ``-P -m kvshare``.

    ``-P`` (Python 3.11+) keeps the working directory off the child's ``sys.path``: with plain
    ``-m`` a ``kvshare`` folder there (the parent of a clone, say) shadows the package and the
    child dies importing it. Start the child with ``kvshare_env`` so it imports this package.
    """
    return [sys.executable, "-P", "-m", "kvshare", "--log-level", log_level]


def kvshare_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) for a kvshare child: the child imports the kvshare this process runs.

    An installed kvshare is found anyway; one imported from a source tree that is not installed (or not
    the one installed: a second clone) is put first on PYTHONPATH, as the working directory was before -P.
    """
    env = dict(os.environ if env is None else env)
    root = os.path.dirname(os.path.dirname(os.path.abspath(kvshare.__file__)))
    if root not in {os.path.abspath(p) for p in (*site.getsitepackages(), site.getusersitepackages())}:
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


def wait_for_pool(socket_path: str, timeout_s: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise PoolUnavailable(f"the pool process exited with code {proc.returncode} before it was ready")
        try:
            with PoolClient(socket_path, name="ready-probe", timeout_s=2.0):
                return
        except PoolRequestError:
            return  # it answered (and refused us): it is up
        except PoolUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def start_pool(
    socket_path: str, size: str | int, extra_args: tuple[str, ...] = (), log_level: str = "INFO", **popen_kwargs
) -> subprocess.Popen:
    """``kvshare pool`` in a child process, ready to serve when this returns."""
    cmd = [*kvshare_command(log_level), "pool", "--size", str(size), "--socket", socket_path, *extra_args]
    proc = subprocess.Popen(cmd, **{**popen_kwargs, "env": kvshare_env(popen_kwargs.get("env"))})
    try:
        wait_for_pool(socket_path, proc=proc)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def running_pool(
    size: str | int, extra_args: tuple[str, ...] = (), quiet: bool = False, **popen_kwargs
) -> Iterator[str]:
    """A pool of ``size`` in a temporary private directory; yields its socket path."""
    if quiet:
        popen_kwargs.setdefault("stdout", subprocess.DEVNULL)
    with tempfile.TemporaryDirectory(prefix="kvshare-") as tmp:
        os.chmod(tmp, 0o700)
        socket_path = os.path.join(tmp, "pool.sock")
        proc = start_pool(socket_path, size, extra_args, "WARNING" if quiet else "INFO", **popen_kwargs)
        try:
            yield socket_path
        finally:
            stop_process(proc)
