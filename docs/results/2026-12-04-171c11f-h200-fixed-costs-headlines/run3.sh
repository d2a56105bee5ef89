#!/usr/bin/env bash
# The runs of 2026-12-04 at 171c11f, run 3: the reader's threads at most 4 (run 2's diag_parse); the 32B 128k row again with every
# load's units timed (its loads ran at 0.91 of the copy in run 2, against 8B's 1.0); the 8B 32k and 128k rows.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p $W
timeout 60 python3 benchmarks/diagnostics/diag_parse.py 32768,131072,262144 > $W/parse.log 2>&1; cat $W/parse.log
echo 45000 > /proc/sys/vm/nr_hugepages; grep -i hugepages_free /proc/meminfo; free -g > $W/free.txt
PYTHONPATH=$PWD/benchmarks/diagnostics/load_probe:$PYTHONPATH KVSHARE_LOAD_PROBE=1 timeout 260 \
  python3 benchmarks/service_ttft_gpu.py --paths router --out $W/s32b --cases 32b:131072 > $W/s32b.log 2>&1
tail -n 4 $W/s32b.log; grep -rh "kvshare-load-probe" $W/s32b/service_ttft_logs | grep -v '"units": 1[0-9],' | tail -n 4
timeout $((592-SECONDS)) python3 benchmarks/service_ttft_gpu.py --paths router --out $W/s8b --time-budget $((585-SECONDS)) \
  --cases 8b:32768,8b:131072 > $W/s8b.log 2>&1; tail -n 6 $W/s8b.log
cd $OUT && tar czf results.tgz w && rm -rf w
