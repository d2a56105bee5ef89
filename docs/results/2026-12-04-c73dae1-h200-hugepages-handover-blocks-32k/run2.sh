#!/usr/bin/env bash
# The runs of 2026-12-04 at c73dae1, run 2: the 32k blocks (8 per block, bootstrap intervals, 80 GiB pool, after kvshare validate), the
# one row of the study's table never validly run; the pool on reserved 2 MiB hugepages (its default, auto).
echo 45000 > /proc/sys/vm/nr_hugepages; grep -i hugepages_free /proc/meminfo
KVSHARE_BENCH_SECONDS=560 benchmarks/gpu_bench.sh 32b-32k
