"""Waiting on the pool socket spins only while spinning pays (spin.py)."""

from kvshare.pool.spin import MAX_MISSES, PROBE_EVERY, CpuPressure, SpinPolicy


def test_spinning_stops_after_misses_in_a_row_and_is_probed_again():
    """Fails with a fixed spin (the window never drops to 0 however often the answer comes after it)."""
    spin = SpinPolicy(200e-6)
    for _ in range(MAX_MISSES):
        assert spin.window_s() == 200e-6
        spin.record(False)
    windows = [spin.window_s() for _ in range(2 * PROBE_EVERY)]
    assert windows.count(200e-6) == 2  # one probe per PROBE_EVERY waits
    assert windows.count(0.0) == 2 * PROBE_EVERY - 2


def test_a_paying_probe_resumes_spinning_and_a_hit_resets_the_misses():
    spin = SpinPolicy(100e-6)
    for _ in range(MAX_MISSES):
        spin.window_s()
        spin.record(False)
    while spin.window_s() == 0.0:
        pass
    spin.record(True)  # the probe's answer came within the window: the cores are free again
    assert all(spin.window_s() == 100e-6 for _ in range(10))
    for _ in range(MAX_MISSES - 1):
        spin.record(False)
    spin.record(True)
    spin.record(False)
    assert spin.window_s() == 100e-6  # misses must come in a row


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def write_psi(path, waited_us: int) -> None:
    path.write_text(
        f"some avg10=0.00 avg60=0.00 avg300=0.00 total={waited_us}\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    )


def test_cpu_pressure_is_the_share_of_the_last_interval_in_which_tasks_waited_for_a_core(tmp_path):
    psi = tmp_path / "cpu"
    write_psi(psi, 1_000_000)
    clock = FakeClock()
    pressure = CpuPressure(str(psi), interval_s=0.05, clock=clock)
    clock.now = 0.1
    write_psi(psi, 1_000_000 + 5_000)  # 5 ms of 100 ms: 5 %
    assert not pressure.is_contended()
    clock.now = 0.2
    write_psi(psi, 1_005_000 + 50_000)  # 50 %
    assert pressure.is_contended()
    clock.now = 0.21
    write_psi(psi, 1_055_000)  # within the interval: the last reading stands
    assert pressure.is_contended()
    clock.now = 0.3
    assert not pressure.is_contended()
    assert not CpuPressure(str(tmp_path / "no-psi")).is_contended()  # a kernel without PSI: never contended


def test_no_wait_spins_while_the_cores_are_contended():
    """Fails when the spin ignores CPU pressure (windows of 200 us while tasks wait for a core)."""
    is_contended = [True]
    spin = SpinPolicy(200e-6, lambda: is_contended[0])
    assert all(spin.window_s() == 0.0 for _ in range(2 * PROBE_EVERY))  # no probe either
    is_contended[0] = False
    assert spin.window_s() == 200e-6
