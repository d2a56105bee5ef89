"""The audit of a replica in the deterministic mode: ids and logprobs must equal the cold recompute's, bit for bit.

A scripted engine stands for the model (its cold and reused runs can be made to part by one ulp of one
logprob); a real tiny engine in the mode shows that clean local reuse passes the exact audit.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

from kvshare.engine.engine import RequestOptions, SamplingParams
from kvshare.serve.audit import AuditConfig, Auditor

GREEDY = SamplingParams(max_tokens=3, ignore_eos=True)
WITH_LOGPROBS = SamplingParams(max_tokens=3, ignore_eos=True, logprobs=2)
REUSED = SimpleNamespace(local_tokens=16, pool_tokens=0)
TOKENS = (5, 9, 7)
TOPS = ({5: -0.1, 6: -3.0}, {9: -0.25, 4: -2.0}, {7: -0.5, 3: -1.5})


class _ScriptedEngine:
    """Greedy runs of TOKENS; a run that reuses KV (the cache or pool on) shifts ``step``'s logprob by ``shift``."""

    def __init__(self, is_deterministic: bool, step: int | None = None, shift: float = 0.0) -> None:
        self.grid = SimpleNamespace(grid_tokens=16) if is_deterministic else None
        self.layout = SimpleNamespace(chunk_tokens=16)
        self.step, self.shift = step, shift
        self.dropped: list = []
        self.num_runs = 0

    def events(self, is_reused: bool, num_prompt: int = 40):
        provenance = SimpleNamespace(
            local_tokens=16 if is_reused else 0, pool_tokens=0, computed_tokens=num_prompt - (16 if is_reused else 0)
        )
        out = []
        for i, (token, top) in enumerate(zip(TOKENS, TOPS)):
            top = dict(top)
            if is_reused and i == self.step:
                top[token] += self.shift
            out.append(
                SimpleNamespace(
                    token_id=token,
                    logprob=top[token],
                    top_logprobs=top,
                    finish_reason="length" if i == len(TOKENS) - 1 else None,
                    provenance=provenance,
                )
            )
        return out

    def generate(self, ids, params, options):
        self.num_runs += 1
        yield from self.events(options.use_pool or options.use_local_cache, len(ids))

    def prompt_chunk_keys(self, ids, tenant=""):
        return [b"k" * 16, b"j" * 16]

    def drop_chunks(self, keys):
        self.dropped += keys
        return len(keys), 0


def _audit(engine, params, with_events: bool) -> Auditor:
    auditor = Auditor(engine, AuditConfig(rate=1.0, num_tokens=3))
    served = engine.events(True)
    assert auditor.offer(
        list(range(40)), params, RequestOptions(), REUSED, list(TOKENS), served if with_events else None
    )
    assert auditor.run_one()
    return auditor


def one_ulp(x: float) -> float:
    return math.nextafter(x, 0.0)


def test_a_logprob_one_ulp_off_is_a_mismatch_in_the_deterministic_mode_with_both_values_reported():
    shift = one_ulp(-0.25) - (-0.25)
    engine = _ScriptedEngine(True, step=1, shift=shift)
    auditor = _audit(engine, WITH_LOGPROBS, with_events=True)  # the served logprobs themselves are compared
    assert auditor.counts.mismatches == 1 and auditor.counts.tolerated == 0, auditor.counts
    result = auditor.last
    assert result.divergence_step == 1 and result.is_logprob_divergence
    assert result.reference_logprobs[0] == -0.25 and result.candidate_logprobs[0] == -0.25 + shift
    text = result.describe()
    assert "step 1" in text and "both token 9" in text and "-0.25," in text and f"{-0.25 + shift:.9g}" in text
    assert engine.dropped and engine.num_runs == 1  # no replay: the cold run only


def test_without_served_logprobs_the_exact_audit_replays_with_the_same_reuse_and_compares_its_logprobs():
    engine = _ScriptedEngine(True, step=2, shift=-1e-6)
    auditor = _audit(engine, GREEDY, with_events=False)  # the client asked for no logprobs
    assert auditor.counts.mismatches == 1 and auditor.last.divergence_step == 2
    assert engine.num_runs == 2  # the replay, then the cold run


def test_equal_bits_pass_the_exact_audit():
    for params, with_events in ((WITH_LOGPROBS, True), (GREEDY, False)):
        engine = _ScriptedEngine(True)
        auditor = _audit(engine, params, with_events)
        assert auditor.counts.checks == 1 and auditor.counts.mismatches == 0, auditor.counts
        assert auditor.last.is_identical and auditor.last.is_logprobs_compared
        assert "ids and logprobs" in auditor.last.describe()


def test_outside_the_mode_the_audit_compares_ids_only():
    engine = _ScriptedEngine(False, step=1, shift=1e-3)
    auditor = _audit(engine, WITH_LOGPROBS, with_events=True)
    assert auditor.counts.checks == 1 and auditor.counts.mismatches == 0 and auditor.last.is_identical


def test_a_deterministic_engine_passes_its_own_exact_audit_of_local_reuse():
    from kvshare.engine.config import EngineConfig
    from kvshare.engine.engine import Engine

    engine = Engine(EngineConfig(model="tiny", chunk_tokens=16, deterministic=True, grid_tokens=32))
    try:
        auditor = Auditor(engine, AuditConfig(rate=1.0, num_tokens=4))
        ids = [(7 * i + 3) % 200 + 32 for i in range(75)]
        list(engine.generate(ids, GREEDY, RequestOptions(use_pool=False)))  # fills the local cache
        for params in (SamplingParams(max_tokens=4, ignore_eos=True, logprobs=3), SamplingParams(max_tokens=4)):
            events = list(engine.generate(ids, params, RequestOptions(use_pool=False)))
            assert events[0].provenance.local_tokens == 64  # 4 chunks, on the grid of 32
            assert auditor.offer(
                ids, params, RequestOptions(use_pool=False), events[0].provenance, [e.token_id for e in events], events
            )
            assert auditor.run_one()
            assert auditor.last.is_identical and auditor.last.is_logprobs_compared, auditor.last.describe()
        assert auditor.counts.checks == 2 and auditor.counts.mismatches == 0
    finally:
        engine.close()
