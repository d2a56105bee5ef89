"""Default locations of sockets and reports."""

from __future__ import annotations

import os
import stat


class UnsafeDirectory(PermissionError):
    """A directory for sockets that someone other than this user could write (and so put a socket of theirs in)."""


def runtime_dir() -> str:
    """A private per-user directory for sockets (mode 0700); refused when another user owns it or may write it."""
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/kvshare-{os.getuid()}"
    path = base if base.endswith(f"kvshare-{os.getuid()}") else os.path.join(base, "kvshare")
    os.makedirs(path, mode=0o700, exist_ok=True)
    check_private_dir(path)
    return path


def check_private_dir(path: str) -> None:
    """Raise UnsafeDirectory unless ``path`` is a real directory of this user that nobody else may write.

    /tmp/kvshare-UID can be created by anyone before this user's first run; a directory of theirs (or one open to
    every user) would let them swap the pool's socket for their own and be sent every replica's requests.
    """
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeDirectory(f"{path} is not a directory (a link or a file is there): remove it and run again")
    if info.st_uid != os.getuid():
        raise UnsafeDirectory(
            f"{path} belongs to uid {info.st_uid}, not to you (uid {os.getuid()}): remove it (as root or its owner) "
            f"or set XDG_RUNTIME_DIR to a directory of yours"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeDirectory(f"{path} may be written by other users (mode {stat.S_IMODE(info.st_mode):o}): "
                              f"chmod 700 {path}")


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
