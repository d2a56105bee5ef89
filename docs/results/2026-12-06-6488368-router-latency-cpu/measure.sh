#!/bin/bash
# usage: measure.sh SRC COMMIT OUT
cd "$1" && KVSHARE_COMMIT=$2 PYTHONPATH="$1" OMP_NUM_THREADS=1 flock /tmp/cpu-bench.lock timeout 180 python -m kvshare bench routing --model /tmp/rl/small-bpe --sessions 16 --prompts 4 --turns 4 --system-tokens 4000-6000 --user-tokens 200-1200 --answer-tokens 4-8 --rates 1 --conditions round_robin/on,cache_aware/on,pool_aware/on,events_dropped --runs 1 --verify 1 --seed 0 --out "$3" > "$3.log" 2>&1
echo "$3 rc=$?"
