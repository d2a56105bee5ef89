import pytest

from kvshare.router.policy import ReplicaView, RouteFacts, Router, SessionTable, prefix_blocks


def views(n, down=(), load=None):
    load = load or [0] * n
    return [ReplicaView(i, i not in down, load[i]) for i in range(n)]


def test_round_robin_cycles():
    r = Router("round_robin", 3)
    assert [r.choose(RouteFacts(), views(3), 0)[0] for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_alternate_chat_turn_k_goes_to_k_mod_n():
    r = Router("alternate", 2)
    assert [r.choose(RouteFacts("s", chat_turn=k), views(2), 0)[0] for k in range(6)] == [0, 1, 0, 1, 0, 1]
    r3 = Router("alternate", 3)
    assert r3.choose(RouteFacts("s", chat_turn=4), views(3), 0)[0] == 1


def test_alternate_counts_requests_without_chat_turns():
    r = Router("alternate", 2)
    picks = [r.choose(RouteFacts("sess"), views(2), 0)[0] for _ in range(4)]
    assert picks == [0, 1, 0, 1]
    assert r.choose(RouteFacts("other"), views(2), 0)[0] == 0  # a new session starts at turn 0


def test_alternate_skips_a_replica_that_is_down():
    r = Router("alternate", 2)
    assert r.choose(RouteFacts("s", chat_turn=1), views(2, down={1}), 0) == [0, 1]


def test_sticky_keeps_a_session_home_and_spreads_sessions():
    r = Router("sticky", 2)
    homes = {s: r.choose(RouteFacts(s), views(2), 0)[0] for s in ("a", "b")}
    assert set(homes.values()) == {0, 1}
    for _ in range(5):
        for s, home in homes.items():
            assert r.choose(RouteFacts(s, chat_turn=3), views(2), 0)[0] == home
    # the home is down: the request goes elsewhere, and comes back once it is up
    assert r.choose(RouteFacts("a"), views(2, down={homes["a"]}), 0)[0] != homes["a"]
    assert r.choose(RouteFacts("a"), views(2), 0)[0] == homes["a"]


def test_cache_aware_prefers_the_replica_that_saw_the_prefix_unless_too_busy():
    r = Router("cache_aware", 2, max_imbalance=2)
    text = "x" * 5000
    first = r.choose(RouteFacts(prefix_blocks=prefix_blocks(text)), views(2), 0)[0]
    longer = prefix_blocks(text + "y" * 2000)
    assert r.choose(RouteFacts(prefix_blocks=longer), views(2), 0)[0] == first
    busy = [0, 0]
    busy[first] = 5
    assert r.choose(RouteFacts(prefix_blocks=longer), views(2, load=busy), 0)[0] != first


def test_prefix_blocks_chain():
    a, b = prefix_blocks("a" * 1100), prefix_blocks("a" * 1024 + "b" * 100)
    assert len(a) == 2 and a == b  # only full blocks count
    c = prefix_blocks("b" + "a" * 1100)
    assert c[0] != a[0] and c[1] != a[1]


def test_session_table_is_bounded_and_expires():
    t = SessionTable(max_sessions=2, ttl_s=10)
    t.put("a", 1, now=0)
    t.put("b", 2, now=1)
    t.put("c", 3, now=2)
    assert len(t) == 2 and t.get("a", now=2) is None
    assert t.get("b", now=5) == 2
    assert t.get("b", now=20) is None


def test_bad_policy():
    with pytest.raises(ValueError, match="unknown policy"):
        Router("random", 2)
