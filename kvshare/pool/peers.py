"""Who is on the other end of a pool socket (SO_PEERCRED), and whom each side trusts.

The daemon admits clients of its own uid and of the uids the operator allows
(``--allow-uid``). A client connects only to a pool that runs as its own uid, as
root, or as the user who owns the socket's directory when nobody else may write
that directory: then only that user could have put the socket there, which is
how an operator shares one pool between users (docs/operations.md).
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from typing import NamedTuple

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux >= 6.5


class PeerCredentials(NamedTuple):
    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """The pid, uid and gid of the process at the other end of a connected Unix socket, as the kernel saw them."""
    return PeerCredentials(*_PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)))


def peer_pidfd(sock: socket.socket) -> int | None:
    """A pidfd of the process at the other end (SO_PEERPIDFD, Linux >= 6.5): it names that process in any pid
    namespace, where SO_PEERCRED gives pid 0 for one the caller's namespace cannot see. None where the kernel has
    none. The caller owns the fd."""
    try:
        fd = struct.unpack("i", sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD, 4))[0]
    except OSError:
        return None
    return fd if fd >= 0 else None


def untrusted_pool_reason(pool_uid: int, own_uid: int, socket_dir: os.stat_result, socket_path: str) -> str | None:
    """Why a client of ``own_uid`` must not use a pool running as ``pool_uid`` (pure); None when it may."""
    if pool_uid in (own_uid, 0):
        return None
    is_dir_private = not socket_dir.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if socket_dir.st_uid == pool_uid and is_dir_private:
        return None
    return (
        f"refusing the pool at {socket_path}: it runs as uid {pool_uid}, which is neither you (uid {own_uid}) nor "
        f"root nor the sole writer of the socket's directory; start the pool as your user, or give it a socket "
        f"directory owned by uid {pool_uid} that others cannot write"
    )
