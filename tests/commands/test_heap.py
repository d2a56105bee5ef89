"""The startup heap is frozen out of the garbage collector before kvshare serve and kvshare router listen."""

from __future__ import annotations

import argparse
import gc

import pytest

from kvshare.heap import freeze_startup_heap


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()  # the rest of the test session collects as usual


def test_freeze_keeps_the_survivors_out_of_collections_and_collects_later_garbage(unfrozen):
    assert gc.get_freeze_count() == 0
    survivor = [object() for _ in range(1000)]
    frozen = freeze_startup_heap()
    assert frozen == gc.get_freeze_count() and frozen >= len(survivor)
    cycle: list = []
    cycle.append(cycle)  # garbage made after the freeze is still collected
    del cycle
    assert gc.collect() >= 1 and gc.get_freeze_count() == frozen


@pytest.mark.parametrize("command", ["serve", "route"])
def test_servers_freeze_before_they_listen(unfrozen, monkeypatch, command):
    from aiohttp import web

    from kvshare.commands import route, serve

    module = {"serve": serve, "route": route}[command]
    seen: list[int] = []
    monkeypatch.setattr(web, "run_app", lambda *a, **kw: seen.append(gc.get_freeze_count()))
    monkeypatch.setattr("kvshare.preflight.check_ports_free", lambda *a, **kw: None)
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    args = p.parse_args(["--no-warmup"] if command == "serve" else ["--replica", "http://127.0.0.1:1"])
    assert module.run(args) == 0
    assert len(seen) == 1 and seen[0] > 10000  # torch, the model and aiohttp's objects among them
