"""What one publisher of KV events holds, as chains of token hashes (pure): the pool's pages (medium CPU), or a
replica's GPU prefix cache (medium GPU, or none as older vLLM sends). kvshare.router.kv_event_feed keeps one from
its subscription."""

from __future__ import annotations

from kvshare.keys import DEFAULT_CHUNK_TOKENS
from kvshare.pool import events as E
from kvshare.router.chunk_chain import chain, chain_seed, chunk_hash, held_chunks


class PoolPrefixIndex:
    """The blocks one publisher holds as chains of token hashes, kept from its KV events."""

    def __init__(self, media: tuple[str | None, ...] = (E.MEDIUM_CPU,)) -> None:
        self.media = media
        self.chunk_tokens = DEFAULT_CHUNK_TOKENS
        self._by_block: dict[int | bytes, bytes] = {}  # the event's block hash -> our chain hash
        self._held: set[bytes] = set()

    def __len__(self) -> int:
        return len(self._held)

    def clear(self) -> None:
        self._by_block.clear()
        self._held.clear()

    def apply(self, event) -> None:
        if isinstance(event, (E.AllBlocksCleared, E.PositionalAllBlocksCleared)):
            self.clear()
        elif isinstance(event, (E.BlockRemoved, E.PositionalBlockRemoved)):
            for block in event.block_hashes:
                self._held.discard(self._by_block.pop(block, None))
        elif event.medium in self.media and event.token_ids and event.block_size > 0 and not _is_keyed(event):
            # no token ids: a salted page (or a foreign one) that a prompt's tokens cannot match
            parent_block = event.parent_block_hash
            parent = chain_seed(None) if parent_block is None else self._by_block.get(parent_block)
            if parent is None or len(event.token_ids) != len(event.block_hashes) * event.block_size:
                return  # its parent is unknown: a chain we cannot extend
            self.chunk_tokens = event.block_size
            for i, block in enumerate(event.block_hashes):
                parent = chunk_hash(parent, event.token_ids[i * event.block_size : (i + 1) * event.block_size])
                self._by_block[block] = parent
                self._held.add(parent)

    def held_tokens(self, ids, cache_salt: str | None) -> int:
        """Tokens of the prompt's longest prefix the pool holds (0 for a salted prompt: the pool announces token
        ids only for pages no tenant salted)."""
        if cache_salt is not None:
            return 0
        return self.held_tokens_of(chain(ids, self.chunk_tokens, None), cache_salt)

    def held_tokens_of(self, hashes: list[bytes], cache_salt: str | None) -> int:
        """``held_tokens`` of a prompt whose ``chain`` at this index's chunk size is ``hashes``."""
        return 0 if cache_salt is not None else held_chunks(hashes, self._held) * self.chunk_tokens


def _is_keyed(event) -> bool:
    """A block whose hash took more than its tokens (vLLM's extra_keys, one entry a block, None for a plain one: a
    cache_salt, a LoRA, media): a prompt's tokens alone must not match it (another tenant's block would steer)."""
    keys = getattr(event, "extra_keys", None) or ()
    return any(k is not None for k in keys) or bool(getattr(event, "lora_name", None) or event.lora_id)
