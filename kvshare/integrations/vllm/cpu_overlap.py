"""A step's loads on CPU copied layer by layer beside vLLM's forward, on a helper thread.

vLLM calls the connector's ``wait_for_layer_load(layer)`` before each attention layer reads
the cache. With ``overlap_load`` on, ``start_load_kv`` only checks what it can without reading
the pages (cpu.CpuKVWorker) and hands the copies to a helper thread, which moves layer 0 of every
load of the step, then layer 1, and so on, announcing each layer as it lands; layer l of the
forward waits for layer l only::

    helper   | copy L0 | copy L1 | copy L2 | ... | copy L7 | checksums
    forward       wait L0 |-- layer 0 --| wait L1 |-- layer 1 --| ...          | wait_for_save

Checksums: a page's xxh3 is streamed in the page's own byte order (layer-major), one layer at
a time, right after that layer of the run was copied (while it is still in cache), so it
equals the pool's checksum of the page. A bad page is therefore only known after the forward
has read it. The load then ends at that page (worker.KVWorker.finish_load), as a synchronous
load that found it before the copy does: the blocks from that page on are reported as load
errors, vLLM discards the step's output for the request and recomputes them
(``kv_load_failure_policy`` "recompute"), and no store of that step is made for the request.
Wrong KV is never served.

Were a layer's wait never called before ``finish`` (a model whose attention does not call the
hooks), the forward may have read blocks before their copy: every load of the step then
fails the same way and the connector goes back to synchronous loads.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import xxhash

from kvshare.integrations.vllm.block_copy import BlockRun, CpuBlockCopier
from kvshare.integrations.vllm.metadata import LoadOutcome
from kvshare.integrations.vllm.worker import KVWorker, PlannedLoad, StepLoads
from kvshare.pool.checksum import checksum_is_valid


@dataclass
class BlockLoad:
    """A planned load whose pages move as runs of whole blocks (the block copier's), layer by layer."""

    load: PlannedLoad
    runs: list[BlockRun]


class LayeredLoads(StepLoads):
    """The step's loads copied beside the forward, on ``executor``'s thread from construction on; ``settled``:
    the step's loads that ended before (loaded at once, or nothing to copy)."""

    def __init__(
        self,
        worker: KVWorker,
        loads: list[BlockLoad],
        copier: CpuBlockCopier,
        executor: ThreadPoolExecutor,
        settled: list[LoadOutcome],
    ) -> None:
        super().__init__(settled)
        self.worker, self.loads, self.copier = worker, loads, copier
        self.num_layers = worker.kv_layout.num_layers
        self._landed = [threading.Event() for _ in range(self.num_layers)]
        self._waited: set[int] = set()
        self._verdicts: list[list[bool]] = [[] for _ in loads]  # per load, per chosen page: is it valid
        self._error: BaseException | None = None
        self._seconds = [{"copy": 0.0, "checksum": 0.0} for _ in loads]  # per load, on the helper
        self._wait_seconds = 0.0  # the forward's waits for layers, all loads together
        self._done = executor.submit(self._run)
        # once the task ends, however it ends (or if it never runs: a broken or shut-down executor), every
        # layer's wait returns: nobody may wait forever
        self._done.add_done_callback(lambda _: [event.set() for event in self._landed])

    def _run(self) -> None:
        # per load, per piece: the streaming checksum of its page (None: the page is not verified)
        hashers = [[xxhash.xxh3_64() if is_chosen else None for is_chosen in b.load.chosen] for b in self.loads]
        try:
            for index in range(self.num_layers):
                for block_load, load_hashers, seconds in zip(self.loads, hashers, self._seconds):
                    for block_run in block_load.runs:
                        started = time.perf_counter()
                        run = block_run.run
                        self.copier.layer_to_blocks(block_run.pages, run.lo, run.hi, block_run.block_ids, index)
                        copied = time.perf_counter()
                        for page in range(run.num_pages):
                            hasher = load_hashers[run.first + page]
                            if hasher is not None:
                                hasher.update(block_run.pages[page, index])  # this layer of the page, in order
                        seconds["copy"] += copied - started
                        seconds["checksum"] += time.perf_counter() - copied
                self._landed[index].set()
            self._verdicts = [
                [
                    checksum_is_valid(b.load.spec.pages[piece.page_index], hasher.intdigest())
                    for piece, hasher in zip(b.load.pieces, load_hashers)
                    if hasher is not None
                ]
                for b, load_hashers in zip(self.loads, hashers)
            ]
        except BaseException as exc:  # reported by finish(): the loads fail, vLLM recomputes
            self._error = exc

    def wait_layer(self, index: int) -> None:
        """Return once layer ``index`` of every load is in vLLM's blocks (or the copying failed)."""
        started = time.perf_counter()
        self._waited.add(index)
        self._landed[index].wait()
        self._wait_seconds += time.perf_counter() - started

    def finish(self) -> tuple[list[LoadOutcome], bool]:
        try:
            self._done.result()
        except BaseException as exc:  # the task never ran (cancelled, executor broken): the copies did not happen
            self._error = self._error or exc
        all_waited = len(self._waited) == self.num_layers
        outcomes = list(self.settled)
        for block_load, verdicts, seconds in zip(self.loads, self._verdicts, self._seconds):
            load, spec = block_load.load, block_load.load.spec
            for phase, value in seconds.items():
                load.times.add(phase, value)
            load.times.seconds["forward_waited"] = self._wait_seconds  # logged, not part of the load's time
            if self._error is not None:
                name = type(self._error).__name__
                reason = f"{name} while copying beside the forward: {self._error}"
                outcomes.append(self.worker.outcome(spec, spec.token_start, reason, load.times))
            elif not all_waited:
                missing = sorted(set(range(self.num_layers)) - self._waited)
                reason = f"the forward never waited for layers {missing}"
                outcomes.append(self.worker.outcome(spec, spec.token_start, reason, load.times))
            else:
                outcomes.append(self.worker.finish_load(load, iter(verdicts)))
        return outcomes, all_waited
