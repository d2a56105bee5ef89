"""`kvshare up` stopped by a signal: once the cluster has started, Ctrl-C or SIGTERM is a clean stop (exit 0), also
when it arrives as the cluster's addresses are printed; during the start it interrupts the start (exit 130)."""

from __future__ import annotations

import argparse
import os
import signal

import pytest

from kvshare.commands import up


class FakeCluster:
    """Starts and stops nothing; counts the stops."""

    def __init__(self, config) -> None:
        self.config = config
        self.stops = 0

    def start(self, progress=None) -> None:
        pass

    def stop(self) -> None:
        self.stops += 1


class FakeSupervisor:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def poll(self) -> None:
        pass


@pytest.fixture
def fakes(monkeypatch):
    import kvshare.launch
    import kvshare.supervisor

    clusters = []

    def make(config):
        clusters.append(FakeCluster(config))
        return clusters[-1]

    monkeypatch.setattr(kvshare.launch, "Cluster", make)
    monkeypatch.setattr(kvshare.supervisor, "Supervisor", FakeSupervisor)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    yield clusters
    signal.signal(signal.SIGINT, handlers[0])
    signal.signal(signal.SIGTERM, handlers[1])


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    return parser.parse_args(["--replicas", "1", "--pool", "off"])


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_as_the_started_cluster_is_announced_stops_it_clean(fakes, monkeypatch, signum):
    """The router answers before ``up`` has printed its addresses: a client that saw it healthy may stop ``up``
    while it prints them. That is a stop of a started cluster, not an interrupted start."""
    monkeypatch.setattr(up, "_print_cluster", lambda console, cluster: os.kill(os.getpid(), signum))
    try:
        rc = up.run(_args())
    except KeyboardInterrupt:
        pytest.fail("the stop of a started cluster was taken for an interrupted start (exit 130)")
    assert rc == 0 and fakes[0].stops == 1


def test_a_signal_during_the_start_interrupts_it_and_stops_what_started(fakes, monkeypatch):
    monkeypatch.setattr(FakeCluster, "start", lambda self, progress=None: os.kill(os.getpid(), signal.SIGINT))
    with pytest.raises(KeyboardInterrupt):
        up.run(_args())
    assert fakes[0].stops == 1
