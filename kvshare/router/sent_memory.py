"""What this router sent each replica, as the replica's local prefix cache most likely holds it (pure).

A replica's local cache (kvshare.engine.prefix_cache, or vLLM's GPU prefix cache) is an LRU of chunks far
smaller than everything a router sends it: under load the chunks of a conversation's last turn are pushed out
by the turns of other conversations before its next turn comes. Crediting a replica with every chunk it was
ever sent overstates its saving exactly when it is busy, and sends a conversation back to a replica that will
recompute or reload it anyway. So each remembered chunk carries its depth: the new chunks this router sent the
replica since that chunk was last used, those of requests still queued ahead of a new one included (they are
remembered when placed, and a replica serving in order stores them first). A chunk is credited while its depth
is below the replica's capacity, learned from what the replica reported holding (the ``local_tokens`` of a
response's provenance): the depth that best separates the chunks it still held from the first one it had lost.
Until a replica has reported a loss, everything sent to it is credited.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

WINDOW = 128  # the newest (depth, held) reports a replica's capacity is fitted to


class SentMemory:
    """Per replica: an LRU of chain hashes (each with the replica's count of new chunks when last used)."""

    def __init__(self, num_replicas: int, max_chunks: int = 200_000) -> None:
        self.max_chunks = max_chunks
        self._sent: list[OrderedDict[bytes, int]] = [OrderedDict() for _ in range(num_replicas)]
        self._num_new = [0] * num_replicas  # new chunks remembered per replica so far: the depth clock
        self._reports: list[deque[tuple[int, bool]]] = [deque(maxlen=WINDOW) for _ in range(num_replicas)]
        self.capacity: list[int | None] = [None] * num_replicas  # in chunks of depth; None: no loss seen yet

    def depths(self, i: int, hashes: Sequence[bytes]) -> list[int]:
        """The depth of each chunk of the longest prefix of ``hashes`` sent to replica i (credited or not)."""
        memory, now = self._sent[i], self._num_new[i]
        out = []
        for h in hashes:
            stamp = memory.get(h)
            if stamp is None:
                break
            out.append(now - stamp)
        return out

    def held_tokens(self, i: int, hashes: Sequence[bytes], chunk_tokens: int) -> int:
        """Tokens of the longest prefix of ``hashes`` replica i most likely still holds."""
        depths = self.depths(i, hashes)
        capacity = self.capacity[i]
        if capacity is None:
            return len(depths) * chunk_tokens
        return next((k for k, d in enumerate(depths) if d >= capacity), len(depths)) * chunk_tokens

    def credited_depth(self, i: int) -> int:
        """The depth below which replica i's chunks are credited: its capacity, or all it was sent until a loss."""
        capacity = self.capacity[i]
        return self._num_new[i] + 1 if capacity is None else capacity

    def remember(self, i: int, hashes: Sequence[bytes]) -> None:
        """Replica i was sent a prompt of these chunks: it holds them, its head the most recently used (the
        replica inserts a prompt's chunks tail first)."""
        memory = self._sent[i]
        for h in reversed(hashes):
            if h not in memory:
                self._num_new[i] += 1
            memory[h] = self._num_new[i]
            memory.move_to_end(h)
        while len(memory) > self.max_chunks:
            memory.popitem(last=False)

    def report(self, i: int, depths: Sequence[int], num_held: int) -> None:
        """Replica i held the first ``num_held`` chunks of a prompt whose sent prefix had these ``depths`` when
        it was placed: each held chunk says the capacity is above its depth, the first lost one that it is not."""
        reports = self._reports[i]
        reports.extend((d, True) for d in depths[:num_held])
        if num_held < len(depths):
            reports.append((depths[num_held], False))
        self.capacity[i] = fit_capacity(reports)


def fit_capacity(reports: Sequence[tuple[int, bool]]) -> int | None:
    """The depth c that best separates held chunks (depth < c) from lost ones (depth >= c): the fewest reports
    on the wrong side, the largest such c; None while no chunk was reported lost."""
    if all(held for _, held in reports):
        return None
    ordered = sorted(reports)
    errors = sum(1 for _, held in ordered if held)  # c = 0: every held chunk on the wrong side
    best, best_errors = 0, errors
    for k, (depth, held) in enumerate(ordered):
        errors += -1 if held else 1  # c above this report's depth
        if k + 1 < len(ordered) and ordered[k + 1][0] == depth:
            continue  # a threshold falls between depths only
        if errors <= best_errors:  # c as high as the next depth reported: the largest with these errors
            best, best_errors = ordered[k + 1][0] if k + 1 < len(ordered) else depth + 1, errors
    return best
