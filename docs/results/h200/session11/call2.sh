#!/usr/bin/env bash
# Session 11, call 2: call 1 found the load at 0.99 of the copy beside the forward in one process, where the
# service loses 5-11%. Bring in the service's surroundings: its larger arena and a second engine process on
# the GPU (A); the same on reserved 2 MiB hugepages (C); the 8B 256k service row on hugepages (D).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p $W
(lscpu; numactl -H; cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/shmem_enabled; free -g) > $W/host.txt 2>&1
D=benchmarks/diagnostics/diag_load_beside_forward.py
POOL=87180705792  # the 8B 256k service row's arena
timeout 150 python3 $D 262128 8b $W/diag_8b_pool87_other.json --pool-bytes $POOL --other-engine \
  --variants "alone,forward,forward (again, last)" > $W/diag_8b_pool87_other.log 2>&1; cat $W/diag_8b_pool87_other.log
echo 42000 > /proc/sys/vm/nr_hugepages; grep -i huge /proc/meminfo | tee -a $W/host.txt
timeout 150 python3 $D 262128 8b $W/diag_8b_pool87_other_huge.json --pool-bytes $POOL --other-engine --hugepages \
  --variants "alone,forward,forward (again, last)" > $W/diag_8b_pool87_other_huge.log 2>&1; cat $W/diag_8b_pool87_other_huge.log
timeout 260 python3 benchmarks/service_ttft_gpu.py --out $W/ttft8 --cases 8b:262144 --paths router \
  --pool-arg=--hugepages > $W/service_8b_256k_huge.log 2>&1; tail -n 8 $W/service_8b_256k_huge.log
cd $OUT && tar czf results.tgz w && rm -rf w
