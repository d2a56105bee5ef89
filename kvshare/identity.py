"""Model identity from the weights' bytes: a content digest per file, cached by the file's stat.

Two fine-tunes of one base model share config.json and every safetensors header; only
their tensor bytes differ. So the identity in the pool's key namespace hashes every byte::

    file digest   xxh3-128 of each RANGE_BYTES range (threads: xxhash and pread release the GIL),
                  then xxh3-128 of (size, range digests)
    fingerprint   kvshare.keys.weights_fingerprint(config.json, file digests in file-name order)

Paths and directory names are never hashed: a copy or a renamed directory of one checkpoint
has its fingerprint, two directories both called ``model`` with different bytes do not.

A file's digest is computed once and kept in the user's cache directory
(kvshare.paths.cache_dir()/weights), keyed by (st_dev, st_ino, st_size, st_mtime_ns,
st_ctime_ns), so a restart costs a stat per file. The cache fails closed: an entry that is
not a regular file owned by this user and private to it, that does not parse, that names
another file state or whose own checksum is wrong is ignored and the file hashed again;
entries are written atomically (a private temporary file, then a rename).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import stat
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from kvshare.errors import UserError
from kvshare.keys import weights_fingerprint
from kvshare.paths import cache_dir

RANGE_BYTES = 8 << 20  # a range hashed by one thread; part of the digest (ENTRY_FORMAT names it)
READ_BYTES = 4 << 20  # one pread into a thread's buffer
ENTRY_FORMAT = f"kvshare-file-digest-v1:xxh3-128:{RANGE_BYTES}"
PROGRESS_AFTER_S = 1.0  # a progress bar appears once a first hash has taken this long
MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit
WEIGHT_SUFFIXES = (".safetensors",)
ADAPTER_SUFFIXES = (".safetensors", ".bin", ".pt")
_HEADER_LEN = struct.Struct("<Q")


class IdentityError(UserError, ValueError):
    """A model or adapter whose identity cannot be established (the message says what to fix)."""


# -- one file --------------------------------------------------------------------------------


def _file_key(st: os.stat_result) -> dict:
    return {
        "dev": st.st_dev,
        "ino": st.st_ino,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
    }


def hash_file(path: str, advance: Callable[[int], None] | None = None, num_threads: int | None = None) -> bytes:
    """The 16-byte content digest of ``path``, hashed in ranges on threads (the same for any thread count)."""
    import xxhash

    fd = os.open(path, os.O_RDONLY)
    try:
        before = os.fstat(fd)
        size = before.st_size
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # each thread reads its range in order: read ahead more
        local = threading.local()

        def hash_range(offset: int) -> bytes:
            buf = getattr(local, "buf", None)
            if buf is None:
                buf = local.buf = memoryview(bytearray(READ_BYTES))
            h = xxhash.xxh3_128()
            end = min(offset + RANGE_BYTES, size)
            while offset < end:
                got = os.preadv(fd, [buf[: min(READ_BYTES, end - offset)]], offset)
                if got <= 0:
                    raise IdentityError(f"{path} shrank while it was hashed; is it being written?")
                h.update(buf[:got])
                offset += got
                if advance is not None:
                    advance(got)
            return h.digest()

        offsets = range(0, size, RANGE_BYTES)
        threads = max(1, min(num_threads or os.cpu_count() or 1, len(offsets)))
        with ThreadPoolExecutor(threads, thread_name_prefix="kvshare-hash") as pool:
            digests = list(pool.map(hash_range, offsets))
        if _file_key(os.fstat(fd)) != _file_key(before):
            raise IdentityError(f"{path} changed while it was hashed; is it being written?")
    finally:
        os.close(fd)
    h = xxhash.xxh3_128(size.to_bytes(8, "little"))
    for digest in digests:
        h.update(digest)
    return h.digest()


def _entry_path(key: dict) -> str:
    name = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=16).hexdigest()
    return os.path.join(cache_dir(), "weights", name + ".json")


def _entry_check(body: dict) -> str:
    return hashlib.blake2b(json.dumps(body, sort_keys=True).encode(), digest_size=16).hexdigest()


def _private_dir(path: str) -> bool:
    """Create ``path`` (0700) if needed; True only when it is a directory of this user that no one else may write."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def read_cached_digest(key: dict) -> bytes | None:
    """The cached digest of the file state ``key``; None for a missing, foreign, corrupt or stale entry."""
    path = _entry_path(key)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077 or st.st_size > 4096:
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            entry = json.loads(f.read())
        body = entry["body"]
        if entry["check"] != _entry_check(body) or body["format"] != ENTRY_FORMAT or body["key"] != key:
            return None
        digest = bytes.fromhex(body["digest"])
        return digest if len(digest) == 16 else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    finally:
        os.close(fd)


def write_cached_digest(key: dict, digest: bytes) -> None:
    """Keep ``digest`` for the file state ``key`` (atomically, owner-only); an unwritable cache is skipped."""
    path = _entry_path(key)
    if not _private_dir(os.path.dirname(os.path.dirname(path))) or not _private_dir(os.path.dirname(path)):
        return  # a cache directory someone else could write is never trusted: the next start hashes again
    body = {"format": ENTRY_FORMAT, "key": key, "digest": digest.hex()}
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"body": body, "check": _entry_check(body)}, f)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def file_digest(path: str, advance: Callable[[int], None] | None = None) -> bytes:
    """The content digest of ``path``: from the cache when its stat matches an entry, else hashed and cached."""
    try:
        key = _file_key(os.stat(path))
    except OSError as exc:
        raise IdentityError(f"cannot read {path}: {exc.strerror}") from None
    cached = read_cached_digest(key)
    if cached is not None:
        if advance is not None:
            advance(key["size"])
        return cached
    try:
        digest = hash_file(path, advance)
        is_unchanged = _file_key(os.stat(path)) == key  # the bytes hashed are those of the state cached
    except OSError as exc:
        raise IdentityError(f"cannot read {path}: {exc.strerror}") from None
    if not is_unchanged:
        raise IdentityError(f"{path} changed while it was hashed; is it being written?")
    write_cached_digest(key, digest)
    return digest


# -- a set of files, with a progress bar -------------------------------------------------------


class _Progress:
    """Counts hashed bytes; shows a rich bar on stderr only once hashing has taken PROGRESS_AFTER_S."""

    def __init__(self, label: str, total_bytes: int) -> None:
        self.label, self.total = label, total_bytes
        self.started = time.monotonic()
        self.done = 0
        self.bar = None
        self.task = None
        self.lock = threading.Lock()

    def advance(self, num_bytes: int) -> None:
        with self.lock:
            self.done += num_bytes
            if self.bar is None and time.monotonic() - self.started > PROGRESS_AFTER_S:
                from rich.console import Console
                from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

                self.bar = Progress(
                    "[progress.description]{task.description}",
                    BarColumn(),
                    DownloadColumn(),
                    TransferSpeedColumn(),
                    console=Console(file=sys.stderr),
                )
                self.bar.start()
                self.task = self.bar.add_task(self.label, total=self.total)
            if self.bar is not None:
                self.bar.update(self.task, completed=self.done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def files_digests(paths: Sequence[str], label: str) -> list[bytes]:
    """Content digests of ``paths``, in order, with a progress bar while a slow first hash runs."""
    try:
        total = sum(os.stat(p).st_size for p in paths)
    except OSError as exc:
        raise IdentityError(f"cannot read {exc.filename}: {exc.strerror}") from None
    progress = _Progress(label, total)
    try:
        return [file_digest(p, progress.advance) for p in paths]
    finally:
        progress.close()


# -- model and adapter directories ----------------------------------------------------------------


def read_safetensors_header(path: str) -> bytes:
    """The JSON header of a .safetensors file (names, dtypes, shapes, offsets of every tensor)."""
    with open(path, "rb") as f:
        prefix = f.read(_HEADER_LEN.size)
        if len(prefix) != _HEADER_LEN.size:
            raise IdentityError(f"{path} is not a safetensors file (shorter than its header length)")
        (length,) = _HEADER_LEN.unpack(prefix)
        if length > MAX_HEADER_BYTES:
            raise IdentityError(f"{path}: safetensors header of {length} bytes is larger than the format allows")
        header = f.read(length)
    if len(header) != length:
        raise IdentityError(f"{path}: truncated safetensors header")
    return header


def _read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise IdentityError(f"cannot read {path}: {exc.strerror}") from None


def _files(directory: str, suffixes: tuple[str, ...], what: str) -> list[str]:
    if not os.path.isdir(directory):
        raise IdentityError(
            f"kvshare needs the {what} as a local directory to fingerprint its weights; got {directory!r}"
        )
    files = sorted(p for p in glob.glob(os.path.join(directory, "*")) if p.endswith(suffixes) and os.path.isfile(p))
    if not files:
        raise IdentityError(f"{directory} holds no {' / '.join('*' + s for s in suffixes)} files to fingerprint")
    return files


def model_fingerprint(model_dir: str) -> str:
    """The content fingerprint of a local Hugging Face model directory (config.json and its *.safetensors)."""
    files = _files(model_dir, WEIGHT_SUFFIXES, "model (or its identity named by --model-revision / model_revision)")
    config_json = _read_bytes(os.path.join(model_dir, "config.json"))
    return weights_fingerprint(config_json, files_digests(files, f"hashing {os.path.basename(model_dir)}'s weights"))


def adapter_fingerprint(adapter_dir: str) -> str:
    """The content fingerprint of a LoRA adapter directory (adapter_config.json and its weights files)."""
    files = _files(adapter_dir, ADAPTER_SUFFIXES, "LoRA adapter")
    config_json = _read_bytes(os.path.join(adapter_dir, "adapter_config.json"))
    return weights_fingerprint(config_json, files_digests(files, f"hashing adapter {os.path.basename(adapter_dir)}"))


def cached_digest(path: str) -> bytes | None:
    """The cached digest of ``path``'s current state; None when there is no valid entry for it."""
    try:
        return read_cached_digest(_file_key(os.stat(path)))
    except OSError:
        return None


def forget_cached_digest(path: str) -> None:
    """Drop the cache entry of ``path``'s current state (files that are about to be deleted)."""
    try:
        os.unlink(_entry_path(_file_key(os.stat(path))))
    except OSError:
        pass
