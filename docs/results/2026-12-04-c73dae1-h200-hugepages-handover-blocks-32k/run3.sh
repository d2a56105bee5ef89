#!/usr/bin/env bash
# The runs of 2026-12-04 at c73dae1, run 3 (GPU time left ~13 min): the 32B 128k headline through the router with the pool's
# default (--hugepages auto, hugepages reserved); the 32B load in one process on a pool of the service's size
# (72 GiB) on hugepages; then, as time allows, the 8B 256k row again with every load's units timed (load_probe).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p $W
echo 45000 > /proc/sys/vm/nr_hugepages; grep -i hugepages_free /proc/meminfo
timeout 240 python3 benchmarks/service_ttft_gpu.py --paths router --out $W/s32b --cases 32b:131072 \
  > $W/s32b.log 2>&1; tail -n 6 $W/s32b.log
timeout 200 python3 benchmarks/diagnostics/diag_arena_handover.py --shape 32b --tokens 131072 --pool-size 72GiB \
  --hugepages --out $W/handover_32b_huge_72g.json > $W/handover_32b_huge_72g.log 2>&1; cat $W/handover_32b_huge_72g.log
PYTHONPATH=$PWD/benchmarks/diagnostics/load_probe:$PYTHONPATH KVSHARE_LOAD_PROBE=1 timeout $((580-SECONDS)) \
  python3 benchmarks/service_ttft_gpu.py --paths router --out $W/s8b_probe --cases 8b:262144 > $W/s8b_probe.log 2>&1
tail -n 6 $W/s8b_probe.log; grep -rh "kvshare-load-probe" $W/s8b_probe/service_ttft_logs $W/s32b/service_ttft_logs 2>/dev/null
cd $OUT && tar czf results.tgz w && rm -rf w
