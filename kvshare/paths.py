"""Default locations of sockets and reports."""

from __future__ import annotations

import os


def runtime_dir() -> str:
    """A private per-user directory for sockets (mode 0700)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/kvshare-{os.getuid()}"
    path = base if base.endswith(f"kvshare-{os.getuid()}") else os.path.join(base, "kvshare")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def default_pool_socket() -> str:
    return os.path.join(runtime_dir(), "pool.sock")
