#!/usr/bin/env bash
# Session 11, call 3 (the device time left): GPU tests after the publish change (local copies beside the pool's
# store); the 32B 128k headline on hugepages a second time; the 32k rows of both shapes on hugepages.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/benchmarks/diagnostics/load_probe:$PWD:/tmp/site PYTHONUNBUFFERED=1 KVSHARE_LOAD_PROBE=1
W=$OUT/w; mkdir -p $W
timeout 100 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/transfer/test_cuda_transfer.py \
  tests/engine/test_gpu.py tests/engine/test_decode_graph.py > $W/gpu_tests.log 2>&1; tail -n 3 $W/gpu_tests.log
echo 45000 > /proc/sys/vm/nr_hugepages; grep -i hugepages_free /proc/meminfo
S="python3 benchmarks/service_ttft_gpu.py --paths router --pool-arg=--hugepages"
timeout 200 $S --out $W/e1 --cases 32b:131072 > $W/e1.log 2>&1; tail -n 4 $W/e1.log
timeout $((480-SECONDS)) $S --out $W/e2 --cases 8b:32768,32b:32768 > $W/e2.log 2>&1; tail -n 6 $W/e2.log
for d in e1 e2; do grep -rh "kvshare-load-probe" $W/$d/service_ttft_logs > $W/${d}_probe.txt 2>/dev/null; done
cd $OUT && tar czf results.tgz w && rm -rf w
