"""Pool keys: the namespace digest and the chained chunk hash.

Pure functions of their inputs, no I/O and no imports from the rest of kvshare.

A prompt's tokens are cut into full chunks of ``chunk_tokens``; the tail that
does not fill a chunk is never shared (it is recomputed)::

    tokens   |----- chunk 0 -----|----- chunk 1 -----|-- tail --|
    keys     key_0 = H(ns  || le_u32(chunk 0))
             key_1 = H(key_0 || le_u32(chunk 1))

``ns`` is the namespace digest: everything that makes KV bytes differ between
two engines that see the same tokens (weights' content, effective configuration, layout, precision, engine
family, tensor-parallel slot, LoRA, tenant salt; in the deterministic mode
also the prefill grid and the kernel build). H is blake2b with a 16-byte
digest: a cryptographic hash, because prefix-cache keys have been attacked
through collisions and tenant isolation rests on them.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass

KEY_BYTES = 16
DEFAULT_CHUNK_TOKENS = 256
MAX_TOKEN_ID = 2**32 - 1


@dataclass(frozen=True)
class Namespace:
    """Everything that must match for two engines to share KV bytes."""

    # The model's identity: the user's explicit revision (--model-revision, model_revision), else empty and
    # the weights' content fingerprint names it. A served name or a directory name never enters here.
    model_id: str
    weights_fingerprint: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    kv_precision: str = "native"  # quantisation of stored KV; "native" = kv_dtype as is
    engine_family: str = "builtin"  # "builtin", "vllm", or "shared" behind an explicit flag
    tp_rank: int = 0
    tp_size: int = 1
    lora_id: str = ""
    tenant_salt: str = ""  # a tenant's identity or vLLM's cache_salt
    # The built-in engine's deterministic mode (chunk-invariant prefill on a fixed grid): its KV is bitwise
    # reproducible only among replicas that compute on the same grid with the same kernels, so the grid and the
    # kernel build (device model, driver and library versions) are part of its namespace. Outside the mode
    # they are left out of the digest, which therefore stays what it always was.
    is_deterministic: bool = False
    grid_tokens: int | None = None  # tokens per prefill grid chunk (a multiple of chunk_tokens); only in the mode
    kernel_build: str = ""  # e.g. "cuda|NVIDIA H200|driver 12080|torch 2.11.0|cuda 12.8"; only in the mode
    # How an engine's KV bytes were read into pages (e.g. vLLM's version, attention backend, block size and
    # allocation: kvshare.integrations.vllm.guards): a layout change then never reads old pages. Left out of
    # the digest when empty, so namespaces that do not set it keep the digests they always had.
    kv_layout_id: str = ""
    # config_fingerprint of the configuration the engine runs the model with; left out of the digest when empty
    config_id: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "chunk_tokens", "tp_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Namespace.{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        if self.is_deterministic:
            if self.grid_tokens is None or self.grid_tokens <= 0 or self.grid_tokens % self.chunk_tokens:
                raise ValueError(
                    f"a deterministic namespace needs grid_tokens, a positive multiple of chunk_tokens "
                    f"{self.chunk_tokens}; got {self.grid_tokens}"
                )
            if not self.kernel_build:
                raise ValueError("a deterministic namespace needs its kernel_build")
        elif self.grid_tokens is not None or self.kernel_build:
            raise ValueError("grid_tokens and kernel_build belong to a deterministic namespace only")

    def with_tenant(self, tenant_salt: str) -> Namespace:
        """The same namespace for another tenant (salted keys never collide across tenants)."""
        fields = asdict(self)
        fields["tenant_salt"] = tenant_salt
        return Namespace(**fields)


def namespace_digest(namespace: Namespace) -> bytes:
    """16-byte digest of a namespace; the seed of every chunk key chain."""
    fields = asdict(namespace)
    if not namespace.is_deterministic:  # digests of the default mode stay those stored before the mode existed
        for name in ("is_deterministic", "grid_tokens", "kernel_build"):
            del fields[name]
    for name in ("kv_layout_id", "config_id"):
        if not fields[name]:
            del fields[name]
    # sorted-key JSON is a canonical encoding: field order or Python version never change it
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(b"kvshare-ns-v1\0" + canonical.encode(), digest_size=KEY_BYTES).digest()


def weights_fingerprint(config_json: bytes, file_digests: Sequence[bytes]) -> str:
    """Hex digest of a model's config.json and the content digests of its weights files (in file-name order).

    Each file digest covers every byte of its file (kvshare.identity): two fine-tunes with equal
    configs and equal safetensors headers still differ here. Names and paths are not hashed, so a copy or a
    renamed directory of one checkpoint has the fingerprint of the original.
    """
    h = hashlib.blake2b(b"kvshare-weights-v2\0", digest_size=KEY_BYTES)
    h.update(len(config_json).to_bytes(8, "little") + config_json)
    for digest in file_digests:
        h.update(len(digest).to_bytes(8, "little") + digest)
    return h.hexdigest()


def config_fingerprint(effective_config: dict) -> str:
    """Hex digest of the configuration an engine runs a model with (dtype, overrides, rope, quantization, ...).

    Sorted-key JSON is canonical; a value JSON cannot encode is hashed by its repr, so an unknown value still
    separates two configurations rather than being dropped.
    """
    canonical = json.dumps(effective_config, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.blake2b(b"kvshare-config-v1\0" + canonical.encode(), digest_size=KEY_BYTES).hexdigest()


def num_full_chunks(num_tokens: int, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> int:
    """How many full chunks ``num_tokens`` tokens make (the tail is not a chunk)."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    return max(num_tokens, 0) // chunk_tokens


def _le_u32(tokens: Sequence[int]) -> bytes:
    arr = array("I", tokens)  # "I" is 4 bytes on every platform CPython supports
    if arr.itemsize != 4:
        raise RuntimeError("array('I') is not 32-bit on this platform")
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def chunk_keys(
    ns_digest: bytes,
    token_ids: Sequence[int],
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    max_chunks: int | None = None,
) -> list[bytes]:
    """Chained keys of the full chunks of ``token_ids``: key_i = H(key_{i-1} || le_u32(chunk i))."""
    if len(ns_digest) != KEY_BYTES:
        raise ValueError(f"namespace digest must be {KEY_BYTES} bytes, got {len(ns_digest)}")
    count = num_full_chunks(len(token_ids), chunk_tokens)
    if max_chunks is not None:
        count = min(count, max_chunks)
    keys: list[bytes] = []
    previous = ns_digest
    head = token_ids[: count * chunk_tokens]
    if hasattr(head, "dtype"):  # a numpy array of integers (the engine's): converted at once, range checked
        if len(head) and (int(head.min()) < 0 or int(head.max()) > MAX_TOKEN_ID):
            raise ValueError(f"token ids must lie in 0..{MAX_TOKEN_ID}")
        payload = memoryview(head.astype("<u4").tobytes())
    else:
        try:
            payload = memoryview(_le_u32(head))  # one conversion for every chunk
        except OverflowError as exc:
            raise ValueError(f"token ids must lie in 0..{MAX_TOKEN_ID}: {exc}") from None
    step = 4 * chunk_tokens
    for i in range(count):
        h = hashlib.blake2b(previous, digest_size=KEY_BYTES)
        h.update(payload[i * step : (i + 1) * step])
        previous = h.digest()
        keys.append(previous)
    return keys


def state_key(chunk_key: bytes) -> bytes:
    """The key of a hybrid model's state checkpoint at the end of the chunk keyed ``chunk_key``.

    A checkpoint is an object of its own beside that chunk's KV (kvshare.state_layout): one may be held where
    the other is not, so it has a key of its own, derived from the chunk's (and so naming the same prefix and
    namespace) and never equal to any chunk's key."""
    return hashlib.blake2b(b"kvshare-state-v1\0" + chunk_key, digest_size=KEY_BYTES).digest()


def extend_chunk_keys(
    previous_keys: Sequence[bytes],
    ns_digest: bytes,
    token_ids: Sequence[int],
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> list[bytes]:
    """Keys of ``token_ids``'s full chunks, reusing ``previous_keys`` already computed for its start."""
    done = len(previous_keys)
    if done == 0:
        return chunk_keys(ns_digest, token_ids, chunk_tokens)
    rest = chunk_keys(previous_keys[-1], token_ids[done * chunk_tokens :], chunk_tokens)
    return list(previous_keys) + rest
