#!/usr/bin/env bash
# The runs of 2026-12-03 at 117fb68, run 2: run 1 found the load at 0.99 of the copy beside the forward in one process, where the
# service loses 5-11%. (D0) the 8B 128k service row with every load's units timed in the replicas
# (load_probe/sitecustomize.py); then the arena on reserved 2 MiB hugepages: (D2) the 8B 256k row and (D3) the
# 32B 128k row, both headlines, probed the same way.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/benchmarks/diagnostics/load_probe:$PWD:/tmp/site PYTHONUNBUFFERED=1 KVSHARE_LOAD_PROBE=1
W=$OUT/w; mkdir -p $W
(lscpu; numactl -H; cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/shmem_enabled; free -g) > $W/host.txt 2>&1
S="python3 benchmarks/service_ttft_gpu.py --paths router"
timeout 120 $S --out $W/d0 --cases 8b:131072 > $W/d0.log 2>&1; tail -n 4 $W/d0.log
echo 45000 > /proc/sys/vm/nr_hugepages; grep -i huge /proc/meminfo | tee -a $W/host.txt
timeout 220 $S --out $W/d2 --cases 8b:262144 --pool-arg=--hugepages > $W/d2.log 2>&1; tail -n 4 $W/d2.log
timeout $((590-SECONDS)) $S --out $W/d3 --cases 32b:131072 --pool-arg=--hugepages > $W/d3.log 2>&1; tail -n 4 $W/d3.log
for d in d0 d2 d3; do grep -rh "kvshare-load-probe" $W/$d/service_ttft_logs > $W/${d}_probe.txt 2>/dev/null; echo $d; cat $W/${d}_probe.txt; done
cd $OUT && tar czf results.tgz w && rm -rf w
