"""Typed control messages between pool clients and the pool daemon.

Framing on the Unix stream socket: a 4-byte little-endian length, then one
msgpack-encoded message (a msgspec tagged union; no pickle anywhere)::

    | u32 length | msgpack {"type": "lookup", ...} |

Each request gets exactly one reply, in order, except ``Goodbye`` and ``Release`` with
``reply=False`` (fire and forget: the common case after a load, which would
otherwise cost a round trip). The reply to ``Hello`` carries the arena's memfd
as SCM_RIGHTS ancillary data.

Every message is built by keyword (``kw_only``: a positional build raises): several carry
fields of one type (``Reserve``'s namespace, token ids, account and parent key are all
bytes), which a reordering of the fields would otherwise swap without a sound.
"""

from __future__ import annotations

import struct

import msgspec

from kvshare.pool.checksum import ChecksumKind

# 2: a page's checksum carries its kind (Commit.checksum_kind, PageHeader.checksum_kind)
# 3: Hello.holder names the holder of the client's holds across reconnects; Goodbye ends them
# 4: HelloReply.pool_id names the daemon instance (a pid is reused: PID 1 in every container)
PROTOCOL_VERSION = 4
MAX_HOLDER_BYTES = 64
POOL_ID_BYTES = 16
FORMAT_VERSION = 1  # canonical page format (layout.py); bumped if the bytes of a page change meaning
FRAME_HEADER = struct.Struct("<I")
DEFAULT_MAX_MESSAGE_BYTES = 1 << 20
MAX_RESERVE_TOKEN_BYTES = 512 << 10  # Reserve.tokens_le32 at most (128k tokens): the message stays under 1 MiB


class ProtocolError(Exception):
    """A frame or message that does not follow the protocol."""


# -- requests --------------------------------------------------------------------------


class Hello(msgspec.Struct, kw_only=True, tag="hello"):
    """``holder``: a random token the client keeps across reconnects; the pool keys its holds by it (and the
    uid), so a closed connection of a live process leaves them in place (kvshare.pool.holders)."""

    protocol_version: int
    client_name: str = ""
    holder: bytes = b""
    direct: bool = False  # asks for the directory and a hold table: lookups without a round trip (direct.py)


class Lookup(msgspec.Struct, kw_only=True, tag="lookup"):
    """Longest committed prefix of ``keys`` (pages of ``page_bytes``), leased when ``lease``."""

    keys: list[bytes]
    page_bytes: int
    lease: bool = True


class Release(msgspec.Struct, kw_only=True, tag="release"):
    lease_ids: list[int]
    reply: bool = True


class Reserve(msgspec.Struct, kw_only=True, tag="reserve"):
    """Pages for ``keys`` (chunks ``first_depth``, ``first_depth + 1``, ... of one chain).

    ``tokens_le32``: optionally the chunks' token ids, little-endian u32, the same count per key; the pool
    keeps them only to announce the pages in KV events (a foreign indexer rehashes them).
    ``account``: whose quota the pages count against (a 16-byte digest of the tenant identity, without the
    request's cache_salt); empty: the namespace's own, as for a writer that names no account.
    ``parent_key``: the key of chunk ``first_depth - 1`` of the same chain (empty: not named); KV events announce
    a page only after its parent, so a run stored from the middle of a chain is announced only when it names it.
    """

    namespace: bytes
    keys: list[bytes]
    page_bytes: int
    first_depth: int = 0
    tokens_le32: bytes = b""
    account: bytes = b""
    parent_key: bytes = b""


class Commit(msgspec.Struct, kw_only=True, tag="commit"):
    """Make a reservation's pages visible; one checksum per page, all of ``checksum_kind``."""

    reservation_id: int
    checksums: list[int]
    checksum_kind: ChecksumKind = ChecksumKind.XXH3


class Abort(msgspec.Struct, kw_only=True, tag="abort"):
    reservation_id: int


class Drop(msgspec.Struct, kw_only=True, tag="drop"):
    """Remove committed chunks from view (a chunk found bad by a reader or the audit)."""

    keys: list[bytes]


class Flush(msgspec.Struct, kw_only=True, tag="flush"):
    """Drop every committed chunk, or those of one namespace."""

    namespace: bytes | None = None


class GetStats(msgspec.Struct, kw_only=True, tag="stats"):
    pass


class ListLeases(msgspec.Struct, kw_only=True, tag="list_leases"):
    pass


class CheckIntegrity(msgspec.Struct, kw_only=True, tag="check_integrity"):
    """Ask the daemon to verify its index and allocator agree (tests, validation, fuzzing)."""


class ListNamespaces(msgspec.Struct, kw_only=True, tag="list_namespaces"):
    """Bytes and committed chunks per namespace (administration: quotas, flushes)."""


class PrefillReport(msgspec.Struct, kw_only=True, tag="prefill_report"):
    """A replica prefilled ``num_chunks`` full chunks of ``namespace`` cold (nothing reused) in ``seconds``.

    The remote tier weighs it against the store's speed (kvshare.pool.remote.cost); replies Ok(1)
    when a tier took it, Ok(0) otherwise.
    """

    namespace: bytes
    page_bytes: int
    num_chunks: int
    seconds: float


class Goodbye(msgspec.Struct, kw_only=True, tag="goodbye"):
    """Every copy touching this holder's pages has ended: end all its leases and reservations. No reply."""


Request = (
    Hello
    | Lookup
    | Release
    | Reserve
    | Commit
    | Abort
    | Drop
    | Flush
    | GetStats
    | ListLeases
    | CheckIntegrity
    | ListNamespaces
    | PrefillReport
    | Goodbye
)

# -- replies ---------------------------------------------------------------------------


class PageHeader(msgspec.Struct, kw_only=True, array_like=True, frozen=True):
    """Where a page lies in the arena and what must hold for its bytes."""

    offset: int
    page_bytes: int
    checksum: int
    format_version: int = FORMAT_VERSION
    checksum_kind: ChecksumKind = ChecksumKind.XXH3  # how ``checksum`` was computed (kvshare.pool.checksum)


class HelloReply(msgspec.Struct, kw_only=True, tag="hello_reply"):
    """``pool_id``: random bytes drawn when the daemon starts (POOL_ID_BYTES). Lease and reservation ids restart
    in every daemon, so a client names the pool that granted a hold by this id, never by ``server_pid``: a
    restarted daemon may have the old one's pid (PID 1 in a container). ``server_pid`` is for people and logs."""

    protocol_version: int
    format_version: int
    arena_bytes: int
    extent_bytes: int
    client_id: int
    server_pid: int
    pool_id: bytes
    wants_token_ids: bool = False  # the pool publishes KV events: a Reserve may carry its chunks' token ids
    # with a Hello.direct the pool offers (direct.py): the directory's slots and the hold table's holds, whose
    # memfds follow the arena's
    direct_slots: int = 0
    direct_holds: int = 0
    direct_misses: bool = False  # a key not in the directory ends the chain (no remote tier to promote from)
    # the longest the pool may hold a lookup before it answers (a promotion from its remote tier: the promote
    # timeout and a tick); a client waits that long for a lookup's reply on top of its own timeout
    lookup_wait_s: float = 0.0


class LookupReply(msgspec.Struct, kw_only=True, tag="lookup_reply"):
    lease_id: int  # 0: nothing leased
    pages: list[PageHeader]


class ReserveReply(msgspec.Struct, kw_only=True, tag="reserve_reply"):
    reservation_id: int  # 0: nothing granted
    grants: list[tuple[int, int]]  # (index into the request's keys, page offset)
    num_no_room: int


class Ok(msgspec.Struct, kw_only=True, tag="ok"):
    count: int = 0


class StatsReply(msgspec.Struct, kw_only=True, tag="stats_reply"):
    stats: dict[str, int | float | dict[str, int]]


class LeaseInfo(msgspec.Struct, kw_only=True, array_like=True):
    lease_id: int
    client_id: int
    client_name: str
    num_pages: int
    age_s: float


class LeasesReply(msgspec.Struct, kw_only=True, tag="leases_reply"):
    leases: list[LeaseInfo]


class NamespaceInfo(msgspec.Struct, kw_only=True, array_like=True):
    namespace: bytes
    num_entries: int  # committed chunks
    num_bytes: int  # arena bytes held (writing and committed pages, and dropped pages still leased)


class NamespacesReply(msgspec.Struct, kw_only=True, tag="namespaces_reply"):
    namespaces: list[NamespaceInfo]
    quota_bytes: int  # 0: no quota
    # what each quota owner holds: an account where a writer named one (it may span namespaces), else a namespace
    accounts: list[NamespaceInfo] = []


class ErrorReply(msgspec.Struct, kw_only=True, tag="error"):
    code: str
    message: str


Reply = HelloReply | LookupReply | ReserveReply | Ok | StatsReply | LeasesReply | NamespacesReply | ErrorReply

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(message: Request | Reply) -> bytes:
    """One framed message."""
    payload = _encoder.encode(message)
    return FRAME_HEADER.pack(len(payload)) + payload


def decode_request(payload: bytes | memoryview) -> Request:
    try:
        return _request_decoder.decode(payload)
    except (msgspec.DecodeError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise ProtocolError(f"malformed request: {exc}") from None


def decode_reply(payload: bytes | memoryview) -> Reply:
    try:
        return _reply_decoder.decode(payload)
    except (msgspec.DecodeError, ValueError) as exc:
        raise ProtocolError(f"malformed reply: {exc}") from None


def split_frames(buffer: bytearray, max_message_bytes: int) -> list[bytes]:
    """Pop every complete frame's payload off the front of ``buffer``."""
    frames = []
    start = 0
    while len(buffer) - start >= FRAME_HEADER.size:
        (length,) = FRAME_HEADER.unpack_from(buffer, start)
        if length > max_message_bytes:
            raise ProtocolError(f"message of {length} bytes exceeds the limit of {max_message_bytes}")
        end = start + FRAME_HEADER.size + length
        if len(buffer) < end:
            break
        frames.append(bytes(buffer[start + FRAME_HEADER.size : end]))
        start = end
    del buffer[:start]
    return frames
