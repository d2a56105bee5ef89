#!/usr/bin/env bash
# The runs of 2026-12-04 at 171c11f, run 4 (GPU time left ~9.5 min): both headlines again on run 3's tree, no probe.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p $W
echo 45000 > /proc/sys/vm/nr_hugepages; grep -i hugepages_free /proc/meminfo
timeout $((375-SECONDS)) python3 benchmarks/service_ttft_gpu.py --paths router --out $W/s --time-budget $((370-SECONDS)) \
  --cases 32b:131072,8b:262144 > $W/s.log 2>&1; tail -n 6 $W/s.log
cd $OUT && tar czf results.tgz w && rm -rf w
