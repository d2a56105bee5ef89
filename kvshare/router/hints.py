"""The router's prefetch hint to a vLLM replica: the prompt it has just placed there, so the copy starts early.

Once the router has chosen a replica for a request it sends that replica's connector (its hint address) a
``PrefetchHint``: the prompt's token ids, its ``cache_salt`` and the model it asks for. The connector hashes
the chunk keys from them itself, in its own namespace, and copies the pages the pool holds for them towards
the GPU while vLLM's front end still reads the request (kvshare.integrations.vllm.prefetch). A hint is trusted
for speed only: a load takes a prefetched page only where its own lease names the same key, pool and
checksum, and verifies it as any page; a wrong hint costs its copy and loads nothing wrong.

The wire: one frame per hint, ``len (u32, big-endian) | msgpack(SignedHint)``, whose ``body`` is the msgpack of
the ``PrefetchHint`` and whose ``tag`` is its HMAC-SHA256 under the key the router and the replicas share (the
account key, kvshare.serve.tenancy): prompts are private, so only a holder of the key names one, and a replica
refuses any other frame. ``issued_at`` bounds a replay. Pure functions of their inputs (and the clock).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import time
from collections.abc import Sequence

import msgspec
import numpy as np

HINT_VERSION = 1
MAX_FRAME_BYTES = 16 << 20  # a frame's body: 4M token ids; a longer prompt is sent no hint
MAX_AGE_S = 30.0  # a hint issued longer ago than this (or this far ahead of the replica's clock) is refused
_LENGTH = struct.Struct(">I")
_DOMAIN = b"kvshare-prefetch-hint\0"  # the tag's domain: no other message signed with the key verifies as a hint


class PrefetchHint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A request the router placed on the replica it is sent to: its prompt's token ids (little-endian u32), the
    salt its keys carry and the model it asks for."""

    version: int
    model: str  # the request's "model": a replica uses it only where it names the base model it serves
    cache_salt: str  # the salt the replica's keys carry ("" none): the body's cache_salt as forwarded
    token_ids: bytes
    issued_at: float  # the router's wall clock (time.time())

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) // 4

    def tokens(self) -> np.ndarray:
        """The token ids, ``[num_tokens]`` uint32 (a view of the message's bytes)."""
        return np.frombuffer(self.token_ids, dtype="<u4")


class SignedHint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    body: bytes  # msgpack of a PrefetchHint
    tag: bytes  # HMAC-SHA256(key, _DOMAIN + body)


class HintRefused(ValueError):
    """A frame that is not a hint this replica may act on; the message says why (for its counter and log)."""


def make_hint(model: str, cache_salt: str | None, token_ids: Sequence[int] | np.ndarray) -> PrefetchHint:
    """A hint of ``token_ids`` (a list or an integer array; each a u32, as the pool's keys hash them)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= 1 << 32):
        raise ValueError("token ids must be u32")
    return PrefetchHint(HINT_VERSION, model, cache_salt or "", ids.astype("<u4").tobytes(), time.time())


def parse_address(address: str) -> tuple[str, str | tuple[str, int]]:
    """A hint address: an absolute path (a Unix socket, ``("unix", path)``) or ``HOST:PORT`` (``("tcp", (host,
    port))``); raises ValueError naming the form otherwise."""
    if address.startswith("/"):
        return "unix", address
    host, sep, port = address.rpartition(":")
    if sep and host and port.isdigit() and 0 < int(port) < 65536:
        return "tcp", (host.strip("[]"), int(port))
    raise ValueError(f"hint address {address!r}: give a Unix socket's absolute path or HOST:PORT")


def _tag(key: str, body: bytes) -> bytes:
    return hmac.new(key.encode(), _DOMAIN + body, hashlib.sha256).digest()


def encode_hint(hint: PrefetchHint, key: str) -> bytes:
    """The frame that carries ``hint``, signed with ``key``."""
    if not key:
        raise ValueError("a hint is signed with the account key; none is set")
    body = msgspec.msgpack.encode(hint)
    if len(body) > MAX_FRAME_BYTES:
        raise ValueError(f"a hint of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    signed = msgspec.msgpack.encode(SignedHint(body, _tag(key, body)))
    return _LENGTH.pack(len(signed)) + signed


def frame_length(header: bytes) -> int:
    """The length of the frame a 4-byte header announces; raises HintRefused for one over the bound."""
    (length,) = _LENGTH.unpack(header)
    if length > MAX_FRAME_BYTES + 256:
        raise HintRefused(f"a frame of {length} bytes exceeds the bound")
    return length


def decode_hint(frame: bytes, key: str, now: float | None = None) -> PrefetchHint:
    """The hint a frame (without its length header) carries, once its tag verifies under ``key`` and its age is
    within bounds; raises HintRefused otherwise (a replica without a key refuses every hint)."""
    if not key:
        raise HintRefused("this replica has no key to verify hints with")
    try:
        signed = msgspec.msgpack.decode(frame, type=SignedHint)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise HintRefused(f"not a signed hint: {exc}") from None
    if not hmac.compare_digest(signed.tag, _tag(key, signed.body)):
        raise HintRefused("the hint's tag does not verify under this replica's key")
    try:
        hint = msgspec.msgpack.decode(signed.body, type=PrefetchHint)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise HintRefused(f"a signed body that is not a hint: {exc}") from None
    if hint.version != HINT_VERSION:
        raise HintRefused(f"hint version {hint.version}, this replica reads {HINT_VERSION}")
    if len(hint.token_ids) % 4:
        raise HintRefused("token ids are not whole u32 values")
    age = (time.time() if now is None else now) - hint.issued_at
    if not -MAX_AGE_S <= age <= MAX_AGE_S:
        raise HintRefused(f"a hint issued {age:.1f} s ago (replayed, or the clocks differ)")
    return hint
