"""How a page is stored in the remote tier: keys, part values and their header. Pure functions.

A page (one chunk, ``page_bytes``) travels as ``part_count`` values of at most
``part_bytes`` each (header included), so no single value blocks the store for long::

    key of part i   {prefix}:v2:{<chunk key, 32 hex>}:i     (the braces are a cluster hash tag)
    value           | header (88 B) | payload: page bytes [part_offset, part_offset + len) |

Sizes follow the store's allocator: Redis and Valkey (jemalloc) round a string
of 2^k + a few bytes up to the next size class, 2^k * 1.25, so a 2 MiB page
stored with its header in one value costs 2.5 MiB (measured: 1.31x). Every
part but the last is therefore a power of two S (the largest that divides the
page and is at most ``part_bytes``) less the header and the store's own string
header; the last part holds the few hundred bytes left::

    page 2 MiB, part_bytes 8 MiB   ->  S = 2 MiB: values of 2 MiB - 64 B and 208 B
    page 64 MiB (32B shape)        ->  S = 8 MiB: 8 values of 8 MiB - 64 B, one of 1.1 KiB

    header  magic "KVSR" | format version u16 | page format version u16 | part index u16 |
            part count u16 | depth u32 | page bytes u64 | part offset u64 | page checksum u64 |
            chunk key 16 B | namespace digest 16 B | page tag 16 B      (little endian)

The hash tag puts every part of a page on one cluster node (one slot), so a
page is fetched in one round trip and a node loss loses whole pages; pages
still spread over the nodes by their chunk key. The chunk key is chained from
the namespace digest (model, weights, KV layout, tenant), so the key alone
says what the bytes mean; the header repeats the key, the namespace and the
page size (the layout fingerprint a reader checks), and the whole-page
xxh3-64 checksum recorded at the local commit.

The store is a network service that may be shared or taken over, and a checksum
written by whoever wrote the bytes proves nothing about them. With a page key
(``RemoteConfig.auth_key``) every page carries a tag, keyed BLAKE2b-128 (a MAC)
over its namespace, chunk key, depth, size and bytes; a reader with the key
treats a page without a valid tag as absent (counted as ``unauthenticated``,
logged, never deleted: it may be another deployment's). Without a key the tag is
zeros and the store is trusted.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import ClassVar

import xxhash

from kvshare.keys import KEY_BYTES
from kvshare.pool.checksum import ChecksumKind, checksum_is_valid
from kvshare.pool.protocol import FORMAT_VERSION
from kvshare.pool.remote.config import MAX_PART_BYTES

REMOTE_FORMAT_VERSION = 2  # 2: the page tag
MAGIC = b"KVSR"
HEADER = struct.Struct("<4sHHHHIQQQ16s16s16s")
HEADER_BYTES = HEADER.size  # 88
TAG_BYTES = 16
NO_TAG = bytes(TAG_BYTES)  # the tag of a page written without a page key

# why a value was discarded (the names of the counters in stats["remote"])
CHECKSUM, VERSION, FINGERPRINT, TRUNCATED, MISSING_PART = (
    "checksum",
    "version",
    "fingerprint",
    "truncated",
    "missing_part",
)
UNAUTHENTICATED = "unauthenticated"
REASONS = (CHECKSUM, VERSION, FINGERPRINT, TRUNCATED, MISSING_PART, UNAUTHENTICATED)
# reasons that mean the stored value itself is broken (deleted so a writer can replace it);
# a missing part may be a write in progress, a foreign fingerprint someone else's valid page,
# and a page without a valid tag is not ours to judge
BROKEN = (CHECKSUM, VERSION, TRUNCATED)


class BadRemoteValue(Exception):
    """A remote page that must not be used; ``reason`` is one of REASONS."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class PageMeta:
    """What a page's header says besides its position among the parts."""

    key: bytes
    namespace: bytes
    depth: int
    page_bytes: int
    checksum: int
    tag: bytes = NO_TAG  # page_tag() under the writer's page key; NO_TAG without one
    checksum_kind: ClassVar[ChecksumKind] = ChecksumKind.XXH3  # the only kind a remote value holds


@dataclass(frozen=True)
class RemotePage:
    """A page fetched and verified: its payloads, in order, add up to exactly ``meta.page_bytes``."""

    meta: PageMeta
    payloads: list[memoryview]


VALUE_SLACK = 64  # bytes left for the store's string header (Redis sds: 9 + NUL)
MIN_SIZE_CLASS = 4096


def part_payload_bytes(page_bytes: int, part_bytes: int) -> int:
    """Page bytes per part: values then fill a power-of-two size class of the store's allocator."""
    cap = 1 << (part_bytes.bit_length() - 1)  # the largest power of two <= part_bytes
    size = cap
    while size > MIN_SIZE_CLASS and page_bytes % size:
        size //= 2
    if page_bytes % size:  # no power of two divides the page: plain parts of the cap
        size = cap
    return size - HEADER_BYTES - VALUE_SLACK


def max_value_bytes(page_bytes: int) -> int:
    """The longest value a part of a page can be (header and payload), whatever part size its writer used."""
    return HEADER_BYTES + min(page_bytes, MAX_PART_BYTES)


def num_parts(page_bytes: int, part_bytes: int) -> int:
    return -(-page_bytes // part_payload_bytes(page_bytes, part_bytes))


def part_key(prefix: str, key: bytes, index: int) -> str:
    return f"{prefix}:v{REMOTE_FORMAT_VERSION}:{{{key.hex()}}}:{index}"


def part_keys(prefix: str, key: bytes, count: int) -> list[str]:
    return [part_key(prefix, key, i) for i in range(count)]


def encode_part(meta: PageMeta, index: int, count: int, part_offset: int, payload) -> bytes:
    """One stored value: the header, then ``payload`` (any buffer; copied once)."""
    header = HEADER.pack(
        MAGIC,
        REMOTE_FORMAT_VERSION,
        FORMAT_VERSION,
        index,
        count,
        meta.depth,
        meta.page_bytes,
        part_offset,
        meta.checksum,
        meta.key,
        meta.namespace,
        meta.tag,
    )
    return b"".join((header, payload))


def part_count_of(value: bytes) -> int | None:
    """The part count a value's header claims, or None when it has no readable header."""
    if value is None or len(value) < HEADER_BYTES or value[:4] != MAGIC:
        return None
    return HEADER.unpack_from(value)[4]


def decode_page(
    values: list[bytes | None], key: bytes, page_bytes: int, namespace: bytes | None, auth_key: bytes = b""
) -> RemotePage | None:
    """Check the values of a page's parts (in part order); None when the store holds no part of it.

    Raises BadRemoteValue when a part is missing or malformed, the header names another
    version, key, size or namespace (``namespace`` None: any), or the bytes do not match
    the page checksum (or, with ``auth_key``, the page tag).
    """
    parts = [None if v is None else (v[:HEADER_BYTES], len(v) - min(len(v), HEADER_BYTES)) for v in values]
    checked = check_parts(parts, key, page_bytes, namespace)
    if checked is None:
        return None
    meta, count = checked
    payloads = [memoryview(v)[HEADER_BYTES:] for v in values[:count]]
    digest = xxhash.xxh3_64()
    for payload in payloads:
        digest.update(payload)
    check_page(meta, digest.intdigest(), payloads, auth_key)
    return RemotePage(meta, payloads)


def check_parts(
    parts: list[tuple[bytes, int] | None],
    key: bytes,
    page_bytes: int,
    namespace: bytes | None,
    depth: int | None = None,
) -> tuple[PageMeta, int] | None:
    """Check a page's parts, each as (its first HEADER_BYTES bytes, the bytes after them); None: no part stored.

    Returns the page's header and its part count (a reader may have asked for more).

    Every check but those of the bytes (``check_page``, over the payloads once they lie in
    place): the parts' payloads, in order, then cover the page exactly. ``depth`` None: any.
    """
    if all(p is None for p in parts):
        return None
    if parts[0] is None:
        raise BadRemoteValue(MISSING_PART, "part 0 is missing")
    first = _header(*parts[0], key)
    count = first[4]
    if len(parts) < count or any(p is None for p in parts[:count]):
        raise BadRemoteValue(MISSING_PART, f"{sum(p is not None for p in parts[:count])} of {count} parts present")
    meta = PageMeta(key=key, namespace=first[10], depth=first[5], page_bytes=first[6], checksum=first[8], tag=first[11])
    if meta.page_bytes != page_bytes:
        raise BadRemoteValue(FINGERPRINT, f"page of {meta.page_bytes} bytes where {page_bytes} were asked for")
    if namespace is not None and meta.namespace != namespace:
        raise BadRemoteValue(FINGERPRINT, "page of another namespace (model, layout or tenant) than its chain")
    if depth is not None and meta.depth != depth:
        raise BadRemoteValue(FINGERPRINT, f"page of chunk {meta.depth} where chunk {depth} of the chain was asked for")
    offset = 0
    for index, (head, payload_bytes) in enumerate(parts[:count]):
        fields = _header(head, payload_bytes, key)
        if fields[3] != index or fields[4] != count:
            raise BadRemoteValue(MISSING_PART, f"value {index} is part {fields[3]} of {fields[4]} (a torn write)")
        if (fields[5], fields[6], fields[8], fields[10], fields[11]) != (
            meta.depth,
            meta.page_bytes,
            meta.checksum,
            meta.namespace,
            meta.tag,
        ):
            raise BadRemoteValue(MISSING_PART, f"part {index} belongs to another write of this page")
        if fields[7] != offset:
            raise BadRemoteValue(TRUNCATED, f"part {index} starts at byte {fields[7]}, expected {offset}")
        offset += payload_bytes
        if offset > page_bytes or (payload_bytes == 0 and page_bytes):
            raise BadRemoteValue(TRUNCATED, f"part {index} overruns or is empty")
    if offset != page_bytes:
        raise BadRemoteValue(TRUNCATED, f"parts hold {offset} of {page_bytes} bytes")
    return meta, count


def page_tag(auth_key: bytes, meta: PageMeta, pieces) -> bytes:
    """Keyed BLAKE2b-128 over what a page is: namespace, chunk key, depth, size, then its bytes (``pieces``)."""
    if len(auth_key) > hashlib.blake2b.MAX_KEY_SIZE:
        auth_key = hashlib.blake2b(auth_key).digest()
    mac = hashlib.blake2b(key=auth_key, digest_size=TAG_BYTES, person=b"kvshare-page")
    mac.update(struct.pack("<16s16sIQ", meta.namespace, meta.key, meta.depth, meta.page_bytes))
    for piece in pieces:
        mac.update(piece)
    return mac.digest()


def check_page(meta: PageMeta, checksum: int, pieces, auth_key: bytes = b"") -> None:
    """The check of a page's bytes (``pieces``, in order, whose xxh3-64 is ``checksum``) against its header.

    With ``auth_key`` the tag first: a page without a valid one is not ours, whatever its checksum says.
    """
    if auth_key and not hmac.compare_digest(page_tag(auth_key, meta, pieces), meta.tag):
        raise BadRemoteValue(UNAUTHENTICATED, "page without a valid tag for this pool's page key")
    if not checksum_is_valid(meta, checksum):
        raise BadRemoteValue(CHECKSUM, "page bytes do not match the checksum recorded at commit")


def part_place(head: bytes, payload_bytes: int, page_bytes: int) -> int | None:
    """Where in its page a part's payload goes, by its header's part offset; None: it cannot be a part of it.

    Only placement: the part is checked later (``check_parts``), with the others.
    """
    if len(head) < HEADER_BYTES or head[:4] != MAGIC:
        return None
    offset = HEADER.unpack_from(head)[7]
    return offset if offset + payload_bytes <= page_bytes else None


def _header(head: bytes, payload_bytes: int, key: bytes) -> tuple:
    if len(head) < HEADER_BYTES:
        raise BadRemoteValue(TRUNCATED, f"value of {len(head) + payload_bytes} bytes is shorter than the header")
    fields = HEADER.unpack_from(head)
    if fields[0] != MAGIC:
        raise BadRemoteValue(VERSION, f"not a kvshare page value (magic {fields[0]!r})")
    if fields[1] != REMOTE_FORMAT_VERSION or fields[2] != FORMAT_VERSION:
        raise BadRemoteValue(
            VERSION,
            f"value format {fields[1]}/page format {fields[2]}; this pool reads "
            f"{REMOTE_FORMAT_VERSION}/{FORMAT_VERSION} (run the same kvshare version on every host)",
        )
    if fields[9] != key or len(fields[10]) != KEY_BYTES:
        raise BadRemoteValue(FINGERPRINT, "value stored under another chunk's key")
    return fields
