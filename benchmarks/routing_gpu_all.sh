#!/usr/bin/env bash
# The routing workload's GPU figures (`kvshare bench routing`, docs/bench.md "Routing") with the Qwen3-8B shape, in
# steps that each fit one 10-minute command on the GPU machine (one H100 80 GB or H200 141 GB, 16 cores, 128 GiB host
# memory, 64 GiB disk; or two H100s with DEVICE=cuda:0,cuda:1).
#
#   bash benchmarks/routing_gpu_all.sh              print the plan (also written to $OUT/plan.txt)
#   bash benchmarks/routing_gpu_all.sh 1            run step 1; steps may be given together (2 3) if time allows
#   DRY=1 bash benchmarks/routing_gpu_all.sh 1      print step 1's command, run nothing
#   bash benchmarks/routing_gpu_all.sh report       rebuild RESULTS' report from its rows (bench routing --summarize)
#
# Every step is one fresh cluster replaying one run (--runs 1 --run-index N) at one rate into ONE results folder,
# RESULTS (default results/routing-gpu, ignored by git): the report there (routing.md, summary.json) is rebuilt from
# the rows of every step so far. A step run again with the same number replaces its run's replays (a step cut short
# is simply run again); CONDITIONS=a,b runs only those conditions of a step (to complete one that was cut short).
# The machine starts bare after an idle while, and each command's $OUT starts empty, so the folder travels both ways:
#   run:   carry [".whl", "results/routing-gpu"], command "KVSHARE_COMMIT=<commit> bash benchmarks/routing_gpu_all.sh 1"
#   after: mkdir -p results && tar xzf <files_at>/routing-gpu.tgz -C results
# $OUT receives routing-gpu.tgz (the whole folder), routing.md, and stepN/ (commands.txt: every command line as run;
# bench.log). RESULTS/commands.txt keeps every step's command line beside the rows. KVSHARE_COMMIT names the tree in
# the rows (the tree travels without its .git). Needs msgspec and pyzmq there (the pool's messages, its KV events):
# their cp312 manylinux wheels in .whl/, e.g. from the vLLM bundle's build (/tmp/vllm_bundle/dl/deps/{msgspec,pyzmq}-*)
# or `pip download msgspec pyzmq --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl`;
# else the vLLM bundle in .vk/ (benchmarks/vllm_bundle.sh). Each step writes the 8B model to /tmp/m8b on a fresh one.
#
# A check on CPU in place of the 8B (no GPU, no model written): MODEL=tiny DEVICE=cpu MAXLEN= EXTRA="--scale 0.05"
#
# ENGINE=vllm: the replicas are vLLM 0.26 with kvshare's connector (bench routing --engine vllm), from the bundle in
# .vk/ (VK=.vk; benchmarks/vllm_bundle.sh, as benchmarks/vllm_gpu_all.sh installs it; carry .vk with the command),
# two on the card (each half of vLLM's gpu-memory-utilization), with the default trace: vLLM batches decode,
# so 64 sessions and answers of 100-300 tokens fit. Its own plan and steps (results in results/routing-gpu-vllm);
# on CPU: ENGINE=vllm MODEL=tiny DEVICE=cpu EXTRA="--scale 0.05 --sessions 8 --vllm-python /path/to/vllm/python"
set -uo pipefail
cd "$(dirname "$0")/.."
ENGINE=${ENGINE:-builtin}
OUT=${OUT:-/tmp/routing_gpu_all}
RESULTS=${RESULTS:-results/routing-gpu$([ "$ENGINE" = vllm ] && echo -vllm)}
DRY=${DRY:-0}
M8=/tmp/m8b
MODEL=${MODEL:-$M8}
DEVICE=${DEVICE:-cuda}
SESSIONS=${SESSIONS:-16}
MAXLEN=${MAXLEN-16384}  # the built-in engine preallocates this much sequence KV on CUDA (2.4 GB for the 8B)
BUDGET=${BUDGET:-585}   # seconds a step may take from this script's start, its preparation included (a command: 600)
EXTRA=${EXTRA:-}
POLICIES=round_robin/off,round_robin/on,alternate/on,sticky/on,cache_aware/on,pool_aware/on,pool_aware_gpu/on
CONTROLS=no_shared_prefix,events_dropped
WORKLOAD=(--sessions "$SESSIONS" --prompts 8 --turns 6 --system-tokens 4000-6000 --user-tokens 200-1200
          --answer-tokens 10-30 --gpu-share 2.5 --pool-share 2 --verify 2 --seed 0 --timeout 120
          ${MAXLEN:+--replica-arg=--max-model-len=$MAXLEN})
if [ "$ENGINE" = vllm ]; then  # the default trace; vLLM's KV and --max-model-len are sized by bench routing itself
    WORKLOAD=(--engine vllm --sessions "${SESSIONS_VLLM:-64}" --prompts 8 --turns 6 --system-tokens 4000-6000
              --user-tokens 200-1200 --answer-tokens 100-300 --gpu-share 3 --pool-share 1.2 --verify 2 --seed 0
              --timeout 300)
fi
STARTED=$(date +%s)

plan() {
    cat <<EOF
The trace (16 sessions by default, SESSIONS=N): N sessions over 8 shared system prompts of 4000-6000 tokens, 6 turns
of 200-1200 user tokens, answers of 10-30 tokens (the default 100-300 cut tenfold: the built-in engine decodes one
request at a time, ~12 ms a token, so the default trace's 64 x 6 answers alone are ~75k steps, ~15 min of replica
time per replay); local caches 1/2.5 of the working set, the pool 2x it; every rate a step, every run a fresh cluster.
Sizes (benchmarks/routing_gpu_plan.py): working set 112801 tokens (16.6 GB); local cache 6.7 GB a replica; pool
33.3 GB (24% of 128 GiB); a replica 16.4 GB weights + 6.7 + 2.4 sequence KV (max-model-len 16384) + ~3 = 28.5 GB,
two on one 80 GB card 57 GB. Estimated replays (prefill 25k tokens/s, decode step 12 ms, load 50 GB/s, two replicas
sharing the card's prefill, no reuse .. full reuse): rate 0.5/s 37-46 s, 1/s 21-43 s, 2/s 20-43 s; cluster start
~90 s (assumed). Rate 1/s: the trace without reuse saturates the replicas (TTFT p99 ~6 s), with reuse not (~1.6 s).

step  minutes  what (rate; conditions; run)
1     6-7      rate 1/s; the 7 policies and the 2 controls; run 0 (+2-3 min on a fresh machine: the 8B model)
2     6-7      rate 1/s; the same; run 1
3     6-7      rate 1/s; the same; run 2       -> steps 1-3: the main comparison and the controls, 3 runs
4     5-6      rate 2/s (saturated); the 7 policies; run 0
5     5-6      rate 2/s; run 1
6     5-6      rate 2/s; run 2
7     6-7      rate 0.5/s (below the knee); the 7 policies; run 0
8     6-7      rate 0.5/s; run 1
9     6-7      rate 0.5/s; run 2              -> steps 1-9: the sweep 0.5, 1, 2 sessions/s, 3 runs each
report         rebuild RESULTS' routing.md and summary.json from its rows
Policies: $POLICIES
Controls: $CONTROLS
EOF
}

plan_vllm() {
    cat <<EOF
ENGINE=vllm. The trace: 64 sessions over 8 shared system prompts of 4000-6000 tokens, 6 turns of 200-1200 user
tokens, answers of 100-300 tokens (bench routing's defaults); vLLM's KV cache 1/3 of the working set a replica, the pool
1.2x it. Sizes (benchmarks/routing_gpu_plan.py --engine vllm ...): working set 390737 tokens (57.6 GB); vLLM's KV
19.2 GB a replica (--kv-cache-memory-bytes, bf16, --max-model-len 14336 for the longest request, 12632 tokens);
pool 69.1 GB (50% of 128 GiB); a replica 16.4 GB weights + 19.2 KV + ~3 activations = 38.6 GB, two on one 80 GB
card 77.2 GB (each at gpu-memory-utilization 0.45; with its KV given vLLM does not size it from that share, and
the two start together). Estimated replays (prefill 25k tokens/s shared by the card's two replicas, batched decode
step 25 ms, load 50 GB/s; no reuse .. full reuse): rate 2/s 63-138 s, 4/s 50-137 s. Measured on one H100: a replay
at 2/s 79-101 s, the cluster's start, warm-up and output checks ~140 s a step, + ~100 s on a fresh machine (the
bundle, the 8B model): a step of three replays ~6.5-8 min. Rate 2/s: no reuse is prefill-bound.

step   minutes  what (rate; conditions; run)
1      7-9      rate 2/s; round_robin/on, pool_aware/on, pool_aware_gpu/on; run 0   (the main three)
2      7-8      rate 2/s; cache_aware/on, round_robin/off, events_dropped; run 0     (sent memory; no pool; events lost)
3      7-8      rate 2/s; alternate/on, sticky/on, no_shared_prefix; run 0        -> steps 1-3: every condition, run 0
4-6    7-8      the same for run 1
7-9    7-8      the same for run 2                                                -> steps 1-9: 3 runs at 2 sessions/s
10     6-7      rate 4/s; round_robin/on, pool_aware/on, pool_aware_gpu/on; run 0   (toward saturation)
11     6-7      rate 4/s; cache_aware/on, round_robin/off, events_dropped; run 0
12     7-8      rate 2/s; cache_aware/on, cache_aware/hints, pool_aware/hints; run 0  (prefetch hints on and off:
                the router tells each replica the prompt it sends there, which copies it ahead)
13-14  7-8      the same for runs 1 and 2                                          -> hints on/off, 3 runs
Three replays a step: each ~80-100 s beside a cluster start of ~140 s (measured on one H100, 2026-12-06); a step cut
short keeps the replays it finished (CONDITIONS=... runs the rest).
report          rebuild RESULTS' routing.md and summary.json from its rows
EOF
}

prepare() {  # msgspec and pyzmq (the pool's messages, its KV events), and the 8B model on a fresh machine
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
    if [ "$ENGINE" = vllm ] && [ "$DEVICE" != cpu ]; then  # vLLM, msgspec and pyzmq from the bundle
        export VK=${VK_DIR:-.vk}
        # shellcheck source=benchmarks/vllm_bundle.sh
        source benchmarks/vllm_bundle.sh || return 1
    elif ! python3 -c "import msgspec, zmq" 2>/dev/null; then
        if ls .whl/*.whl >/dev/null 2>&1; then
            python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
                || { echo "installing .whl/ failed"; return 1; }
            export PYTHONPATH=$PYTHONPATH:/tmp/site
        else
            export VK=${VK_DIR:-.vk}
            # shellcheck source=benchmarks/vllm_bundle.sh
            source benchmarks/vllm_bundle.sh || return 1
        fi
    fi
    if [ "$MODEL" = "$M8" ] && [ ! -f $M8/config.json ]; then
        python3 -m kvshare make-model qwen3-8b --out $M8 --device cuda 2>&1 | tail -1
    fi
}

bench() {  # STEP RATE RUN CONDITIONS: one run at one rate, into RESULTS, under what is left of the budget
    local step=$1 rate=$2 run=$3 conditions=${CONDITIONS:-$4}
    local cmd=(python3 -m kvshare bench routing --model "$MODEL" --device "$DEVICE" "${WORKLOAD[@]}" --rates "$rate"
               --conditions "$conditions" --runs 1 --run-index "$run" --out "$RESULTS")
    # shellcheck disable=SC2206
    cmd+=($EXTRA)
    if [ "$DRY" = 1 ]; then echo "${cmd[*]}"; return 0; fi
    prepare || return 1
    local dir=$OUT/step$step limit=$(( BUDGET - ($(date +%s) - STARTED) ))
    if [ "$limit" -lt 120 ]; then echo "step $step not started: ${limit} s of the budget left"; return 4; fi
    mkdir -p "$dir" "$RESULTS"
    echo "timeout $limit ${cmd[*]}" | tee -a "$dir/commands.txt" "$RESULTS/commands.txt"
    timeout "$limit" "${cmd[@]}" 2>&1 | tee -a "$dir/bench.log"
    local status=${PIPESTATUS[0]}
    tar czf "$OUT/routing-gpu.tgz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
    cp "$RESULTS/routing.md" "$OUT/" 2>/dev/null
    return "$status"
}

VLLM_SETS=("round_robin/on,pool_aware/on,pool_aware_gpu/on" "cache_aware/on,round_robin/off,events_dropped"
           "alternate/on,sticky/on,no_shared_prefix")
VLLM_HINTS="cache_aware/on,cache_aware/hints,pool_aware/hints"  # prefetch hints off and on, in one cluster

step_vllm() {  # N: the plan_vllm table's step N
    local n=$1
    if [ "$n" -ge 1 ] 2>/dev/null && [ "$n" -le 9 ]; then
        bench "$n" 2 $(( (n - 1) / 3 )) "${VLLM_SETS[$(( (n - 1) % 3 ))]}"
    elif [ "$n" = 10 ] || [ "$n" = 11 ]; then
        bench "$n" 4 0 "${VLLM_SETS[$(( n - 10 ))]}"
    elif [ "$n" -ge 12 ] 2>/dev/null && [ "$n" -le 14 ]; then
        bench "$n" 2 $(( n - 12 )) "$VLLM_HINTS"
    else
        echo "no step $n (ENGINE=vllm: steps 1-14, report; no argument prints the plan)"; return 2
    fi
}

step() {
    local n=$1 t0
    t0=$(date +%s)
    if [ "$ENGINE" = vllm ] && [ "$n" != report ]; then
        step_vllm "$n"
        local status=$?
        [ "$DRY" = 1 ] || echo "step $n done in $(( $(date +%s) - t0 )) s (exit $status)"
        return $status
    fi
    case $n in
        1|2|3) bench "$n" 1 $(( n - 1 )) "$POLICIES,$CONTROLS" ;;
        4|5|6) bench "$n" 2 $(( n - 4 )) "$POLICIES" ;;
        7|8|9) bench "$n" 0.5 $(( n - 7 )) "$POLICIES" ;;
        report) if [ "$DRY" = 1 ]; then echo "python3 -m kvshare bench routing --summarize $RESULTS"; return 0; fi
                prepare && python3 -m kvshare bench routing --summarize "$RESULTS" ;;
        *) echo "no step $n (steps 1-9, report; no argument prints the plan)"; return 2 ;;
    esac
    local status=$?
    [ "$DRY" = 1 ] || echo "step $n done in $(( $(date +%s) - t0 )) s (exit $status)"
    return $status
}

mkdir -p "$OUT"
if [ $# -eq 0 ]; then if [ "$ENGINE" = vllm ]; then plan_vllm; else plan; fi | tee "$OUT/plan.txt"; exit 0; fi
if [ "$DRY" != 1 ]; then
    [ "$DEVICE" = cpu ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    [ -n "${KVSHARE_COMMIT:-}" ] || [ -e .git ] || echo "KVSHARE_COMMIT is not set: the rows will not name the tree"
fi
status=0
for n in "$@"; do step "$n" || status=$?; done
exit $status
