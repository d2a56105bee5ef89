#!/usr/bin/env bash
# The runs of 2026-12-04 at 171c11f, run 1: GPU tests (the model's last-layer change is GPU code); the parse on the host's cores; the
# two headlines and the 8B 32k row through the router with the pool's default, after the three fixed-cost changes.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p $W
(nvidia-smi; nproc; python3 -c "import torch, sys; print(torch.__version__, sys.version)") > $W/device.txt 2>&1
timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/transfer/test_cuda_transfer.py \
  tests/engine/test_gpu.py tests/engine/test_decode_graph.py > $W/gpu_tests.log 2>&1; tail -n 3 $W/gpu_tests.log
timeout 60 python3 benchmarks/diagnostics/diag_parse.py 32768,131072,262144 > $W/parse.log 2>&1; cat $W/parse.log
echo 45000 > /proc/sys/vm/nr_hugepages; grep -i hugepages_ /proc/meminfo | tee $W/hugepages.txt
timeout $((592-SECONDS)) python3 benchmarks/service_ttft_gpu.py --paths router --out $W/s --time-budget $((585-SECONDS)) \
  --cases 32b:131072,8b:262144,8b:32768 > $W/s.log 2>&1; tail -n 12 $W/s.log
cd $OUT && tar czf results.tgz w && rm -rf w
