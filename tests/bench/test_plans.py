"""The experiments' unit plans: keys, kinds, request counts, and what they refuse."""

from __future__ import annotations

import pytest

from kvshare.bench import blocks, sessions, ttft


def test_blocks_plan():
    plan = blocks.units(blocks.BlocksConfig(contexts=(1000, 2000), per_block=3, verify=2), num_replicas=2)
    assert [u.key for u in plan[:4]] == [f"blocks/L=1000/b={b}" for b in range(4)]
    assert [u.kind for u in plan[:4]] == [
        "blocks/L=1000/off",
        "blocks/L=1000/on",
        "blocks/L=1000/on",
        "blocks/L=1000/off",
    ]
    # OFF: 3 measurements; ON: 3 primes + 3 measurements (+2 verifications in the first ON block)
    assert [u.num_requests for u in plan[:4]] == [3, 8, 6, 3]
    assert len(plan) == 8 and len({u.key for u in plan}) == 8


def test_ttft_and_sessions_plans():
    assert [(u.key, u.num_requests) for u in ttft.units(ttft.TTFTConfig(contexts=(512, 1024), repetitions=2), 2)] == [
        ("ttft/L=512", 6),
        ("ttft/L=1024", 6),
    ]
    plan = sessions.units(sessions.SessionsConfig(contexts=(1000,), num_sessions=2, num_turns=6, verify=1), 2)
    assert len(plan) == 2 * 2 * 2  # sessions x placements x pools
    assert plan[0].key == "sessions/L=1000/alternate/off/s=0"
    verified = [u.key for u in plan if u.num_requests == 7]
    assert verified == ["sessions/L=1000/alternate/on/s=0", "sessions/L=1000/sticky/on/s=0"]


def test_cross_replica_experiments_refuse_one_replica():
    with pytest.raises(ValueError, match="at least 2 replicas"):
        ttft.units(ttft.TTFTConfig(contexts=(512,)), 1)
    with pytest.raises(ValueError, match="at least 2 replicas"):
        blocks.units(blocks.BlocksConfig(contexts=(512,)), 1)
    with pytest.raises(ValueError, match="at least 2 replicas"):
        sessions.units(sessions.SessionsConfig(contexts=(512,)), 1)


@pytest.mark.parametrize(
    "bad", [dict(design=("on", "on")), dict(design=("off", "maybe")), dict(per_block=0), dict(replica_a=1, replica_b=1)]
)
def test_blocks_config_refuses_bad_designs(bad):
    with pytest.raises(ValueError):
        blocks.BlocksConfig(contexts=(512,), **bad)


def test_placement_is_the_routers():
    alternate = sessions.Placer("alternate", 2)
    assert [alternate.replica("s", t) for t in range(4)] == [0, 1, 0, 1]
    sticky = sessions.Placer("sticky", 2)
    homes = {s: sticky.replica(s, 0) for s in ("a", "b")}
    assert homes == {"a": 0, "b": 1}
    assert [sticky.replica("a", t) for t in range(1, 4)] == [0, 0, 0] and sticky.replica("b", 5) == 1
    assert sessions.Placer("alternate", 2, router_url="http://router").replica("s", 1) is None


def test_blocks_prime_batch_primes_and_measures_in_turns():
    """With prime_batch the pool holds only a batch of primes at once: A primes k, B measures them, and so on."""
    import asyncio
    from types import SimpleNamespace

    from kvshare.bench.records import Record

    order: list[tuple[str, int]] = []

    async def measure(request, **fields):
        order.append((fields["role"], fields["position"]))
        return Record(
            run_id="r",
            experiment="blocks",
            unit=fields["unit"],
            condition=fields["condition"],
            role=fields["role"],
            context_tokens=fields["context_tokens"],
            url=request.url,
            position=fields["position"],
        )

    ctx = SimpleNamespace(
        model="tiny",
        measure=measure,
        replica_for=lambda i, use_pool: (f"http://r{i}", use_pool),
        factory=SimpleNamespace(completion_prompt=lambda n, key: [1] * n),
    )
    config = blocks.BlocksConfig(contexts=(64,), per_block=5, prime_batch=2, verify=0)
    records = asyncio.run(blocks.run_block(config, 64, 1, "on", 0, ctx))
    assert order == [
        ("prime", 0),
        ("prime", 1),
        ("measure", 0),
        ("measure", 1),
        ("prime", 2),
        ("prime", 3),
        ("measure", 2),
        ("measure", 3),
        ("prime", 4),
        ("measure", 4),
    ]
    assert len(records) == 10
    order.clear()
    asyncio.run(blocks.run_block(blocks.BlocksConfig(contexts=(64,), per_block=3, verify=0), 64, 1, "on", 0, ctx))
    assert [role for role, _ in order] == ["prime"] * 3 + ["measure"] * 3  # the default: the whole block first
    with pytest.raises(ValueError, match="prime_batch"):
        blocks.BlocksConfig(contexts=(64,), prime_batch=0)
