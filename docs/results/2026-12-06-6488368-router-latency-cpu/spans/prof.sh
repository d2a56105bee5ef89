#!/bin/bash
# prof.sh SRC NAME: the router's own time (request in -> sent upstream) per condition, spans written by a patched copy
rm -f /tmp/rl/spans-*.txt
cd "$1" && PYTHONPATH="$1" OMP_NUM_THREADS=1 flock /tmp/cpu-bench.lock timeout 180 python -m kvshare bench routing --model /tmp/rl/small-bpe --sessions 16 --prompts 4 --turns 4 --system-tokens 4000-6000 --user-tokens 200-1200 --answer-tokens 4-8 --rates 1 --conditions round_robin/on,cache_aware/on,pool_aware/on --runs 1 --verify 0 --seed 0 --out /tmp/rl/p-$2 > /tmp/rl/p-$2.log 2>&1
mkdir -p /tmp/rl/sp-$2 && mv /tmp/rl/spans-*.txt /tmp/rl/sp-$2/
