"""Default locations of sockets, reports and the user's cache."""

from __future__ import annotations

import os
import re
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


def cache_dir() -> str:
    """The user's kvshare cache directory ($XDG_CACHE_HOME/kvshare, else ~/.cache/kvshare); not created here."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvshare")


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
        raise UnsafeDirectory(
            f"{path} may be written by other users (mode {stat.S_IMODE(info.st_mode):o}): chmod 700 {path}"
        )


def default_pool_socket() -> str:
    return os.path.join(runtime_dir(), "pool.sock")


_POOL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_POINTER_PREFIX = "up-pool-socket."


def check_pool_name(name: str) -> str:
    """A cluster's pool name (``kvshare up --name``): letters, digits, ``.``, ``_``, ``-``; raises ValueError."""
    if not _POOL_NAME.fullmatch(name):
        raise ValueError(f"--name {name!r}: a pool name takes letters, digits, '.', '_' and '-' (at most 64)")
    return name


def up_pool_pointer(name: str) -> str:
    """The file where ``kvshare up --name NAME`` writes its pool's socket path (the socket lives in up's
    private dir); one per name, so two clusters on a host never take each other's place."""
    return os.path.join(runtime_dir(), _POINTER_PREFIX + check_pool_name(name))


def point_to_pool(name: str, socket_path: str) -> None:
    """Write ``kvshare up --name NAME``'s pointer to its pool's socket (a second up of that name replaces it)."""
    tmp = os.path.join(runtime_dir(), f".pointer.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(socket_path)
    os.replace(tmp, up_pool_pointer(name))


def unpoint_pool(name: str, socket_path: str | None) -> None:
    """Remove the pointer if it still names this cluster's pool (another up of its name may have replaced it)."""
    try:
        with open(up_pool_pointer(name)) as f:
            if f.read().strip() == socket_path:
                os.unlink(up_pool_pointer(name))
    except OSError:
        pass


def running_up_pools() -> dict[str, str]:
    """Pool name -> socket path of every ``kvshare up`` of this user whose pool socket still exists."""
    pools = {}
    for entry in sorted(os.listdir(runtime_dir())):
        if not entry.startswith(_POINTER_PREFIX) or not _POOL_NAME.fullmatch(entry[len(_POINTER_PREFIX) :]):
            continue
        try:
            with open(os.path.join(runtime_dir(), entry)) as f:
                pointed = f.read().strip()
        except OSError:
            continue
        if pointed and os.path.exists(pointed):
            pools[entry[len(_POINTER_PREFIX) :]] = pointed
    return pools


def find_pool_socket(name: str | None = None) -> str:
    """The socket a pool command with no --socket talks to: the pool of ``kvshare up --name NAME``; with no
    name, the default socket if a pool listens there, else the one running ``kvshare up``'s. Raises
    UserError where that is not one pool (several clusters, or no cluster of that name)."""
    from kvshare.errors import UserError

    pools = running_up_pools()
    if name is not None:
        if name not in pools:
            running = ", ".join(pools) or "none"
            raise UserError(f"no running kvshare up pool is named {name!r} (running: {running})")
        return pools[name]
    default = default_pool_socket()
    if os.path.exists(default) or not pools:
        return default
    if len(pools) > 1:
        raise UserError(
            f"several kvshare up pools run here ({', '.join(pools)}): choose one with --name NAME or --socket PATH"
        )
    return next(iter(pools.values()))
