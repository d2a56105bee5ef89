"""The audit while serving, in process: a reused request recomputed cold; a poisoned page is caught and dropped."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from kvshare.engine.engine import RequestOptions, SamplingParams
from kvshare.serve.audit import AuditConfig, Auditor
from tests.validate.conftest import corrupt_chunk, pool_chunks

COLD = RequestOptions(use_pool=False, use_local_cache=False)
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(n)]


def serve(engine, auditor, ids, params=GREEDY, options=RequestOptions()):
    """What the replica does per request: generate, then offer the finished request to the audit."""
    events = list(engine.generate(ids, params, options))
    tokens = [e.token_id for e in events]
    auditor.offer(ids, params, options, events[0].provenance, tokens)
    p = events[0].provenance
    return tokens, (p.local_tokens, p.pool_tokens, p.computed_tokens)


def test_audit_passes_reuse_and_skips_cold_requests(writer):
    engine = writer
    auditor = Auditor(engine, AuditConfig(rate=1.0), CollectorRegistry())
    ids = prompt(70, seed=1)
    _, provenance = serve(engine, auditor, ids)
    assert provenance == (0, 0, 70) and auditor.num_pending == 0  # nothing reused: nothing to audit
    _, provenance = serve(engine, auditor, ids)
    assert provenance == (69, 0, 1) and auditor.num_pending == 1  # local reuse: all but the last token, in place
    sampled = SamplingParams(max_tokens=8, temperature=0.9, seed=3, ignore_eos=True)
    serve(engine, auditor, ids, sampled, RequestOptions(use_local_cache=False))  # pool reuse, sampled: a replay
    assert auditor.run_one() and auditor.run_one() and not auditor.run_one()
    assert (auditor.counts.checks, auditor.counts.mismatches, auditor.counts.errors) == (2, 0, 0)
    assert auditor.last.is_identical and auditor.last.num_compared == 8


def test_audit_catches_a_poisoned_pool_page_drops_its_chunks_and_the_next_request_recomputes(
    pool_socket, writer, replica
):
    ids = prompt(75, seed=2)
    cold = [e.token_id for e in writer.generate(ids, GREEDY, COLD)]
    list(writer.generate(ids, GREEDY))  # stores chunks 0..3 in the pool
    corrupt_chunk(pool_socket, writer, ids, chunk=1)

    # the replica does not verify checksums: the bad page is served
    registry = CollectorRegistry()
    auditor = Auditor(replica, AuditConfig(rate=1.0), registry)
    served, provenance = serve(replica, auditor, ids)
    assert provenance == (0, 64, 11) and served != cold  # the poisoned KV changed the answer
    assert replica.stats().local_cache_chunks == 4  # and its chunks went into the local cache

    assert auditor.run_one()
    assert (auditor.counts.checks, auditor.counts.mismatches) == (1, 1)
    assert auditor.last.divergence_step is not None and not auditor.last.passed
    assert (auditor.counts.dropped_local, auditor.counts.dropped_pool) == (4, 4)
    assert pool_chunks(pool_socket, writer, ids) == 0 and replica.stats().local_cache_chunks == 0
    text = generate_latest(registry).decode()
    assert "kvshare_audit_mismatches_total 1.0" in text and "kvshare_audit_checks_total 1.0" in text
    assert "kvshare_audit_dropped_pool_total 4.0" in text

    again, provenance = serve(replica, auditor, ids)  # nothing left to reuse: recomputed, right
    assert provenance == (0, 0, 75) and again == cold


def test_audit_gives_way_to_a_waiting_request(replica):
    engine = replica
    busy = [False]
    auditor = Auditor(engine, AuditConfig(rate=1.0), is_busy=lambda: busy[0])
    ids = prompt(40, seed=3)
    serve(engine, auditor, ids)
    serve(engine, auditor, ids)
    busy[0] = True
    assert auditor.run_one() and auditor.num_pending == 1 and auditor.counts.interrupted == 1
    busy[0] = False
    assert auditor.run_one() and auditor.counts.checks == 1 and auditor.num_pending == 0


def test_audit_samples_at_its_rate_and_bounds_its_queue(writer):
    engine = writer
    auditor = Auditor(engine, AuditConfig(rate=0.5, max_pending=4, seed=0))

    class P:
        local_tokens, pool_tokens = 16, 0

    queued = sum(auditor.offer([1] * 20, GREEDY, RequestOptions(), P, [5]) for _ in range(200))
    assert queued == 4 and auditor.counts.skipped > 0
    never = Auditor(engine, AuditConfig(rate=0.0))
    assert not any(never.offer([1] * 20, GREEDY, RequestOptions(), P, [5]) for _ in range(50))


class _ScriptedEngine:
    """An engine whose cold replay parts from the served tokens at a near tie (step 1, gap 5e-4)."""

    def __init__(self, is_deterministic: bool) -> None:
        from types import SimpleNamespace

        self.grid = SimpleNamespace() if is_deterministic else None
        self.layout = SimpleNamespace(chunk_tokens=16)
        self.dropped = []

    def generate(self, ids, params, options):
        from types import SimpleNamespace

        provenance = SimpleNamespace(local_tokens=0, pool_tokens=0, computed_tokens=len(ids))
        tops = [{5: -0.1, 6: -3.0}, {9: -0.6930, 6: -0.6935}]
        for i, (token, top) in enumerate(zip((5, 9), tops)):
            yield SimpleNamespace(
                token_id=token,
                logprob=top[token],
                top_logprobs=top,
                finish_reason="length" if i else None,
                provenance=provenance,
            )

    def prompt_chunk_keys(self, ids, tenant=""):
        return [b"k" * 16]

    def drop_chunks(self, keys):
        self.dropped += keys
        return 0, 0


def test_the_audit_of_a_deterministic_engine_tolerates_no_near_tie():
    from types import SimpleNamespace

    reused = SimpleNamespace(local_tokens=16, pool_tokens=0)
    for is_deterministic, verdict in ((False, "tolerated"), (True, "mismatches")):
        engine = _ScriptedEngine(is_deterministic)
        auditor = Auditor(engine, AuditConfig(rate=1.0, num_tokens=2))
        assert auditor.offer(list(range(40)), GREEDY, RequestOptions(), reused, [5, 6])  # served 5, 6; cold gives 5, 9
        assert auditor.run_one()
        assert getattr(auditor.counts, verdict) == 1, auditor.counts
    assert "token 9 (reference) vs 6" in auditor.last.describe() and engine.dropped
