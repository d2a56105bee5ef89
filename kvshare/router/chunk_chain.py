"""A prompt's chunks as the router names them: chained blake2b-64 hashes of token ids, seeded by the cache salt
(pure).

The pool's KV events announce pages with their token ids, not the pool's own keys (those carry the model's
namespace, which the router does not know), so the router names every chunk by this chain: the index of the
events (kvshare.router.prefix_index), the sent memory and a prompt being placed all use it.
"""

from __future__ import annotations

import array
import hashlib
import sys


def chain_seed(cache_salt: str | None) -> bytes:
    if cache_salt is None:
        return b""
    return hashlib.blake2b(b"cache_salt\0" + cache_salt.encode("utf-8", "surrogatepass"), digest_size=8).digest()


def le_u32(ids) -> bytes:
    """Token ids as little-endian 4-byte unsigned integers (array's conversion of a list: 5x numpy's; an int
    array, as the tokenizer's ``encode_array`` gives, is converted by numpy). An id outside 0..2**32-1 raises
    OverflowError either way."""
    if hasattr(ids, "dtype"):
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= 1 << 32):
            raise OverflowError("a token id does not fit 4 unsigned bytes")
        return ids.astype("<u4", copy=False).tobytes()
    data = array.array("I", ids)
    if data.itemsize != 4:
        raise RuntimeError("this platform's C unsigned int is not 4 bytes; token ids cannot be hashed here")
    if sys.byteorder != "little":
        data.byteswap()
    return data.tobytes()


def chunk_hash(parent: bytes, tokens) -> bytes:
    return hashlib.blake2b(parent + le_u32(tokens), digest_size=8).digest()


def chain(ids, chunk_tokens: int, cache_salt: str | None) -> list[bytes]:
    """Chained hashes of the full chunks of ``ids``, seeded by the salt: ``chunk_hash`` of each chunk in turn,
    over the prompt's bytes converted once (converting chunk by chunk cost more than the hashes)."""
    hashes, previous = [], chain_seed(cache_salt)
    data = memoryview(le_u32(ids))
    step = 4 * chunk_tokens
    for start in range(0, len(data) - step + 1, step):
        previous = hashlib.blake2b(previous + data[start : start + step], digest_size=8).digest()
        hashes.append(previous)
    return hashes


def held_chunks(hashes: list[bytes], held) -> int:
    """How many of ``hashes``, from the first, are in ``held``."""
    count = 0
    for h in hashes:
        if h not in held:
            break
        count += 1
    return count
