"""Default locations of sockets, reports and the user's cache."""

from __future__ import annotations

import os


def runtime_dir() -> str:
    """A private per-user directory for sockets (mode 0700)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/kvshare-{os.getuid()}"
    path = base if base.endswith(f"kvshare-{os.getuid()}") else os.path.join(base, "kvshare")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def cache_dir() -> str:
    """The user's kvshare cache directory ($XDG_CACHE_HOME/kvshare, else ~/.cache/kvshare); not created here."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvshare")


def default_pool_socket() -> str:
    return os.path.join(runtime_dir(), "pool.sock")


def up_pool_pointer() -> str:
    """The file where ``kvshare up`` writes its pool's socket path (the socket lives in up's private dir)."""
    return os.path.join(runtime_dir(), "up-pool-socket")


def find_pool_socket() -> str:
    """The socket a pool command with no --socket talks to: the default one if a pool listens there,
    else the pool of the last ``kvshare up`` still running, else the default (whose error names it)."""
    default = default_pool_socket()
    if os.path.exists(default):
        return default
    try:
        with open(up_pool_pointer()) as f:
            pointed = f.read().strip()
    except OSError:
        return default
    return pointed if pointed and os.path.exists(pointed) else default
