#!/usr/bin/env bash
# The runs of 2026-12-04 at c73dae1, run 1: GPU tests on this tree (the publish change of the runs of 2026-12-03 at 117fb68 and --hugepages auto never ran
# on the GPU); hugepages reserved as docs/operations.md says; the pool's hugepage tests; does a load run slower
# in a process that did not write the pages (diag_arena_handover, the 32B shape, on hugepages); the 8B 256k
# headline through the router with the pool's default (--hugepages auto).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p $W
(nvidia-smi; python3 -c "import torch, sys; print(torch.__version__, sys.version)") > $W/device.txt 2>&1
timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/transfer/test_cuda_transfer.py \
  tests/engine/test_gpu.py tests/engine/test_decode_graph.py > $W/gpu_tests.log 2>&1; tail -n 3 $W/gpu_tests.log
echo 45000 > /proc/sys/vm/nr_hugepages; grep -i hugepages_ /proc/meminfo | tee $W/hugepages.txt
timeout 60 python3 -m pytest -q -rfE -p no:cacheprovider tests/pool/test_bad_input.py -k hugepages > $W/pool_hugepages_tests.log 2>&1
tail -n 3 $W/pool_hugepages_tests.log
timeout 200 python3 benchmarks/diagnostics/diag_arena_handover.py --shape 32b --tokens 131072 --pool-size 34GiB \
  --hugepages --out $W/handover_32b_huge.json > $W/handover_32b_huge.log 2>&1; cat $W/handover_32b_huge.log
timeout $((590-SECONDS)) python3 benchmarks/service_ttft_gpu.py --paths router --out $W/s8b --cases 8b:262144 \
  > $W/s8b.log 2>&1; tail -n 6 $W/s8b.log
cd $OUT && tar czf results.tgz w && rm -rf w
