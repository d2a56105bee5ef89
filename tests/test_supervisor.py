"""The supervisor's decisions, with a fake clock and fake processes (no process is started)."""

import pytest

from kvshare.supervisor import CrashLoop, RestartPolicy, Supervisor, restart_delay

POLICY = RestartPolicy(max_restarts=3, window_s=60, backoff_s=0.5, backoff_max_s=2)


def test_backoff_doubles_with_each_exit_in_the_window_up_to_its_bound():
    assert [restart_delay([0.0] * n, 0.0, POLICY) for n in (1, 2, 3)] == [0.5, 1.0, 2.0]
    assert restart_delay([0.0] * 4, 0.0, POLICY) is None  # a fourth exit within 60 s: three restarts were allowed
    assert restart_delay([0.0, 0.0, 100.0], 100.0, POLICY) == 0.5  # old exits leave the window


def test_policy_refuses_nonsense():
    with pytest.raises(ValueError):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ValueError):
        RestartPolicy(window_s=0)


class FakeProc:
    def __init__(self, returncode=None):
        self.returncode = returncode
        self.pid = id(self)

    def poll(self):
        return self.returncode

    def kill(self):
        self.returncode = -9


class FakeCluster:
    def __init__(self):
        self.processes = {"pool": FakeProc(), "replica0": FakeProc(), "router": FakeProc()}
        self.started: list[str] = []
        self.ready: set[str] = set()

    def restart(self, name):
        self.processes[name] = FakeProc()
        self.started.append(name)

    def is_ready(self, name):
        return name in self.ready

    def output_lines(self, name):
        return [f"{name}: boom"]


def supervised():
    cluster, now, said = FakeCluster(), [0.0], []
    return cluster, now, said, Supervisor(cluster, POLICY, ready_timeout_s=30, say=said.append, clock=lambda: now[0])


def test_a_dead_child_is_started_again_after_its_backoff_and_reported_back():
    cluster, now, said, sup = supervised()
    cluster.processes["replica0"].returncode = -9
    sup.poll()
    assert cluster.started == [] and said == ["replica0 exited (killed by SIGKILL); starting it again in 0.5 s"]
    now[0] = 0.6
    sup.poll()
    assert cluster.started == ["replica0"]
    cluster.ready.add("replica0")
    sup.poll()
    assert said[-1] == "replica0 is back (restart 1)"
    sup.poll()
    assert cluster.started == ["replica0"]  # the others never died


def test_more_exits_than_restarts_within_the_window_is_a_crash_loop_naming_the_child():
    cluster, now, said, sup = supervised()
    for _ in range(POLICY.max_restarts):
        cluster.processes["router"].returncode = 2
        sup.poll()
        now[0] += 5
        sup.poll()
    cluster.processes["router"].returncode = 2
    with pytest.raises(CrashLoop) as info:
        sup.poll()
    assert cluster.started == ["router"] * POLICY.max_restarts
    message = str(info.value)
    assert "router crash-looped" in message and "4 times within 60 s" in message and "exit code 2" in message
    assert "router: boom" in message


def test_a_restarted_child_that_never_gets_ready_is_killed_and_counted():
    cluster, now, said, sup = supervised()
    cluster.processes["pool"].returncode = 1
    sup.poll()
    now[0] = 1
    sup.poll()
    now[0] = 40  # past ready_timeout_s
    sup.poll()
    assert cluster.processes["pool"].returncode == -9 and "not ready 30 s after its restart" in said[-1]
    sup.poll()
    assert said[-1].startswith("pool exited (killed by SIGKILL); starting it again in 1 s")
