import json
import subprocess
import sys


def test_bench_pool_json_has_the_figures_and_the_reader_saw_the_writers_bytes():
    out = subprocess.run(
        [sys.executable, "-m", "kvshare", "bench", "pool", "--json", "--pool-size", "64MiB", "--page-size", "1MiB",
         "--pages", "16", "--repeats", "1", "--lookup-ops", "300"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    result = json.loads(out[out.index("{"):])
    for key in ("put_ratio_vs_memcpy", "get_ratio_vs_memcpy", "lookup_ops_per_s", "lookup_p99_us",
                "memcpy_gbps", "put_gbps", "get_gbps", "put_copy_only_ratio_vs_memcpy", "checksum_gbps"):
        assert result[key] > 0, key
    assert result["bytes_per_pass"] == 16 << 20
