#!/usr/bin/env bash
# The runs of 2026-12-03 at 117fb68, run 3 (the GPU time left): GPU tests after the publish change (local copies beside the pool's
# store); the 32B 128k headline on hugepages a second time; the 32B load in one process on the service's
# hugepage arena (is the 32B service's 0.94-0.95 the arena or the service?).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/benchmarks/diagnostics/load_probe:$PWD:/tmp/site PYTHONUNBUFFERED=1 KVSHARE_LOAD_PROBE=1
W=$OUT/w; mkdir -p $W
timeout 100 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/transfer/test_cuda_transfer.py \
  tests/engine/test_gpu.py tests/engine/test_decode_graph.py > $W/gpu_tests.log 2>&1; tail -n 3 $W/gpu_tests.log
echo 45000 > /proc/sys/vm/nr_hugepages; grep -i hugepages_free /proc/meminfo
timeout 200 python3 benchmarks/service_ttft_gpu.py --paths router --pool-arg=--hugepages --out $W/e1 \
  --cases 32b:131072 > $W/e1.log 2>&1; tail -n 4 $W/e1.log
grep -rh "kvshare-load-probe" $W/e1/service_ttft_logs > $W/e1_probe.txt 2>/dev/null; cat $W/e1_probe.txt
timeout $((360-SECONDS)) python3 benchmarks/diagnostics/diag_load_beside_forward.py 131056 32b $W/diag_32b_huge.json \
  --pool-bytes 77728841728 --hugepages --variants "alone,forward,forward (again, last)" > $W/diag_32b_huge.log 2>&1
cat $W/diag_32b_huge.log
cd $OUT && tar czf results.tgz w && rm -rf w
