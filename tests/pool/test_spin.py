"""Waiting on the pool socket spins only while spinning pays (spin.py)."""

from kvshare.pool.spin import MAX_MISSES, PROBE_EVERY, SpinPolicy


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
