import json
import subprocess
import sys


def test_bench_pool_json_has_the_figures_and_the_reader_saw_the_writers_bytes():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvshare",
            "bench",
            "pool",
            "--json",
            "--pool-size",
            "64MiB",
            "--page-size",
            "1MiB",
            "--pages",
            "16",
            "--repeats",
            "1",
            "--lookup-ops",
            "300",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    result = json.loads(out[out.index("{") :])
    for key in (
        "put_ratio_vs_memcpy",
        "get_ratio_vs_memcpy",
        "lookup_ops_per_s",
        "lookup_p99_us",
        "lookup_round_trip_ops_per_s",
        "lookup_round_trip_p99_us",
        "memcpy_gbps",
        "put_gbps",
        "get_gbps",
        "put_copy_only_ratio_vs_memcpy",
        "checksum_gbps",
    ):
        assert result[key] > 0, key
    assert result["bytes_per_pass"] == 16 << 20
    # the engines' client: leases from the pool's directory where this machine offers it (kvshare.pool.direct)
    from kvshare.pool.direct import is_supported

    assert result["lookup_path"] == ("direct" if is_supported() else "round_trip")
    assert isinstance(result["is_contended"], bool)
    assert result["cpu_pressure_pct"] is None or result["cpu_pressure_pct"] >= 0


def test_cpu_pressure_is_read_from_psi():
    """Fails without the PSI reading of kvshare bench pool (a contended run would not be told from a quiet one)."""
    from kvshare.bench.pool_bench import parse_psi_some_avg10

    text = "some avg10=37.50 avg60=12.00 avg300=3.10 total=123\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    assert parse_psi_some_avg10(text) == 37.5
    assert parse_psi_some_avg10("") is None
    assert parse_psi_some_avg10("some total=5\n") is None
