"""The piece encoder's second level: piece ids shared by the replicas of one user on one host, as files.

A cross-replica hit is a text this replica never saw, so its own cache (kvshare.engine.token_cache) misses every
piece, although the replica that computed the KV encoded the same pieces moments before. Here each piece the
first replica encodes is written to a directory every replica of the cluster reads: one file per piece, named by
(tokenizer identity, piece hash), holding a header and the ids as little-endian uint32::

    [magic 8][version u32][tokenizer identity 16][piece hash 16][piece bytes u64][id count u64][ids xxh3-128 16]
    [ids: count x uint32]

Why files in a private directory, not a shared-memory segment: a segment needs an allocator, an index and a lock
that every process agrees on (a second pool), and a writer that dies holding the lock stalls the others. A
file is written to a temporary name and renamed over its final one (atomic: a reader sees a whole entry or
none), a dead writer leaves only a temporary file (removed by the next trim), and a read is one open and one
read from the page cache (a 128k-token prompt's 99 pieces: a few ms of CPU on a 2-core machine;
benchmarks/tokenize_cost.py, column "other"). The directory is checked like the
pool's socket directory (kvshare.paths.check_private_dir: this user's, written by nobody else).

An entry is used only when every header field equals what the reader expects (format version, the full
tokenizer identity, the piece's hash and byte length), the file is exactly as long as its id count says and
the ids hash to the recorded checksum; anything else (a torn, truncated, foreign or older-format file, an
unreadable one) is a miss and the piece is encoded (fail closed).

The directory is bounded in bytes: files go least recently used first (a hit touches its file's mtime, unless
that is less than 10 s old). Each
process counts what it wrote since it last listed the directory and lists it again (trimming to 7/8 of the
bound) once that count would pass the bound or reaches 1/16 of it, so the directory holds at most
``max_bytes`` plus 1/16 of it per other process writing at the same time.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvshare.errors import UserError
from kvshare.paths import UnsafeDirectory, check_private_dir

MAGIC = b"KVSTOKEN"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sI16s16sQQ16s")
SUFFIX = ".ids"
_TMP_PREFIX = ".tmp-"
STALE_TMP_S = 60.0  # a temporary file older than this was left by a writer that died
TOUCH_AFTER_NS = 10 * 10**9  # the LRU order's granularity: a hit touches a file last written or touched before


@dataclass(frozen=True)
class TokenShareConfig:
    directory: str
    max_bytes: int = 256 << 20  # entry files, headers included

    def __post_init__(self) -> None:
        if self.max_bytes < HEADER.size:
            raise ValueError(f"--token-cache-size must be at least {HEADER.size} bytes")


def entry_name(identity: bytes, piece_hash: bytes) -> str:
    return identity.hex() + piece_hash.hex() + SUFFIX


def pack_entry(identity: bytes, piece_hash: bytes, piece_nbytes: int, ids: Sequence[int]) -> bytes:
    """An entry file's bytes: the header, then the ids as little-endian uint32."""
    body = np.asarray(ids, dtype="<u4").tobytes()
    return (
        HEADER.pack(MAGIC, FORMAT_VERSION, identity, piece_hash, piece_nbytes, len(ids), xxhash.xxh3_128_digest(body))
        + body
    )


def unpack_entry(data: bytes, identity: bytes, piece_hash: bytes, piece_nbytes: int) -> np.ndarray | None:
    """The ids (a read-only uint32 view of ``data``) of an entry whose header matches exactly and whose ids match
    their checksum; else None."""
    if len(data) < HEADER.size:
        return None
    magic, version, entry_identity, entry_hash, nbytes, count, checksum = HEADER.unpack_from(data)
    if (
        magic != MAGIC
        or version != FORMAT_VERSION
        or entry_identity != identity
        or entry_hash != piece_hash
        or nbytes != piece_nbytes
        or len(data) != HEADER.size + 4 * count
    ):
        return None
    body = memoryview(data)[HEADER.size :]
    if xxhash.xxh3_128_digest(body) != checksum:
        return None
    return np.frombuffer(body, dtype="<u4")


class SharedPieces:
    """Piece ids in a directory shared by the processes of one user: get, put, and the bound in bytes."""

    def __init__(self, config: TokenShareConfig) -> None:
        """Creates the directory (0700) if missing; raises UserError when it is not private to this user."""
        self.config = config
        self.directory = config.directory
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            check_private_dir(self.directory)
        except UnsafeDirectory as exc:
            raise UserError(f"--token-cache-dir: {exc}") from None
        except OSError as exc:
            raise UserError(f"--token-cache-dir {self.directory}: {exc.strerror or exc}") from None
        self.num_hits = 0
        self.num_misses = 0
        self.num_bytes = 0  # at the last listing, plus what this process wrote since
        self._written_since_trim = 0
        self._lock = threading.Lock()
        self.trim()

    def get(self, identity: bytes, piece_hash: bytes, piece_nbytes: int) -> np.ndarray | None:
        """The piece's ids, or None (no entry, or one that fails any check)."""
        path = os.path.join(self.directory, entry_name(identity, piece_hash))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            self.num_misses += 1
            return None
        try:
            info = os.fstat(fd)
            # a byte-level BPE gives at most one id per byte: anything longer is no entry of this piece
            data = os.read(fd, HEADER.size + 4 * piece_nbytes + 1)
        except OSError:
            data = b""
        finally:
            os.close(fd)
        ids = unpack_entry(data, identity, piece_hash, piece_nbytes)
        if ids is None:
            self.num_misses += 1
            return None
        self.num_hits += 1
        now = time.time_ns()
        if now - info.st_mtime_ns > TOUCH_AFTER_NS:  # recently used: trimmed last
            try:  # (a file touched lately is not touched again: on a journaled file system utime may wait)
                os.utime(path, ns=(now, now))
            except OSError:
                pass
        return ids

    def put_many(self, entries: Sequence[tuple[bytes, bytes, int, Sequence[int]]]) -> None:
        """Write (identity, piece hash, piece byte length, ids) entries; trim whenever the bound may be passed."""
        for identity, piece_hash, piece_nbytes, ids in entries:
            data = pack_entry(identity, piece_hash, piece_nbytes, ids)
            if len(data) > self.config.max_bytes // 16:
                continue  # one piece may not push out a sixteenth of everyone's
            if not self._write(entry_name(identity, piece_hash), data):
                continue
            with self._lock:
                self.num_bytes += len(data)
                self._written_since_trim += len(data)
                is_due = (
                    self.num_bytes > self.config.max_bytes or self._written_since_trim >= self.config.max_bytes // 16
                )
            if is_due:
                self.trim()

    def _write(self, name: str, data: bytes) -> bool:
        tmp = os.path.join(self.directory, f"{_TMP_PREFIX}{os.getpid()}-{threading.get_ident()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, data)
                now = time.time_ns()
                os.utime(fd, ns=(now, now))
            finally:
                os.close(fd)
            os.replace(tmp, os.path.join(self.directory, name))
        except OSError:  # a full or removed directory: the piece stays this process's only
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False
        return True

    def trim(self) -> None:
        """List the directory; remove stale temporary files, then the least recently used entries while the
        total passes the bound (down to 7/8 of it, so that the next listing is not due at once)."""
        entries: list[tuple[float, int, str]] = []
        now = time.time()
        try:
            listing = list(os.scandir(self.directory))
        except OSError:
            return
        for entry in listing:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if entry.name.startswith(_TMP_PREFIX) and now - info.st_mtime > STALE_TMP_S:
                _unlink(entry.path)
            elif entry.name.endswith(SUFFIX) and entry.is_file(follow_symlinks=False):
                entries.append((info.st_mtime, info.st_size, entry.path))
        total = sum(size for _mtime, size, _path in entries)
        if total > self.config.max_bytes:
            target = self.config.max_bytes * 7 // 8
            for _mtime, size, path in sorted(entries):
                if total <= target:
                    break
                if _unlink(path):
                    total -= size
        with self._lock:
            self.num_bytes = total
            self._written_since_trim = 0


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
    except OSError:
        return False
    return True
