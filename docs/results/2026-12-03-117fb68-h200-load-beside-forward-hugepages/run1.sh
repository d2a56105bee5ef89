#!/usr/bin/env bash
# The runs of 2026-12-03 at 117fb68, run 1: GPU tests, where a load loses speed beside the forward, decode steps beside copies.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p $W
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $W/device.txt
python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])" >> $W/device.txt
timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/transfer/test_cuda_transfer.py \
  tests/engine/test_gpu.py tests/engine/test_decode_graph.py > $W/gpu_tests.log 2>&1
tail -n 4 $W/gpu_tests.log
timeout 200 python3 benchmarks/diagnostics/diag_load_beside_forward.py 262128 8b $W/diag_8b_256k.json > $W/diag_8b_256k.log 2>&1
cat $W/diag_8b_256k.log
timeout 200 python3 benchmarks/diagnostics/diag_load_beside_forward.py 131056 32b $W/diag_32b_128k.json > $W/diag_32b_128k.log 2>&1
cat $W/diag_32b_128k.log
timeout 90 python3 benchmarks/decode_step_gpu.py --model qwen3-8b --contexts 32768 --beside-copies --out $W/decode_beside.json > $W/decode_beside.log 2>&1
tail -n 12 $W/decode_beside.log
cd $OUT && tar czf results.tgz w && rm -rf w
