#!/bin/bash
# Alternating sweeps at 4 sessions/s of the tree before the queue-term change (572cc9e) and after (4279970), each
# exported with `git archive COMMIT | tar -x -C /tmp/kvshare-COMMIT`; run as `flock /tmp/cpu-bench.lock ./paired.sh`.
for k in 1 2; do
  for H in 4279970 572cc9e; do
    cd /tmp/kvshare-$H && env PYTHONPATH=/tmp/kvshare-$H KVSHARE_COMMIT=$H OMP_NUM_THREADS=1 timeout 300 \
      python -m kvshare bench routing --model tiny --scale 0.1 --sessions 12 --prompts 4 --turns 3 --rates 4 --runs 2 \
      --conditions round_robin/on,pool_aware/on --router-arg=--prefill-rate=2000 --router-arg=--load-bandwidth=0.05 \
      --router-arg=--queue-seconds=0.5 --out /tmp/routing-pair-$k-$H > /tmp/routing-pair-$k-$H.log 2>&1
    echo "$(date -u +%T) done $k $H rc=$?"
  done
done
