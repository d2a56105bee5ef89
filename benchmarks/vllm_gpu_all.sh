#!/usr/bin/env bash
# Every vLLM GPU measurement of benchmarks/vllm_gpu.py that docs/vllm.md ("On a GPU") lists, in steps that each
# fit one 10-minute command on the GPU machine (one H200, 128 GiB host memory, 64 GiB disk).
#
#   bash benchmarks/vllm_gpu_all.sh              print the plan (also written to $OUT/plan.txt)
#   bash benchmarks/vllm_gpu_all.sh 3            run step 3; steps may be given together (2 3) if time allows
#   DRY=1 bash benchmarks/vllm_gpu_all.sh 3      print step 3's driver commands, run nothing
#
# Each step installs the vLLM bundle and writes the model it needs when the machine is fresh (a warm machine keeps
# /tmp/site and /tmp/m8b: the step then starts at once). Needs, in .vk/ (ignored, carried with the command):
# vllm026-sm90.tar.xz.part-aa, SHA256SUMS, install_on_device.sh (../shared/vllm-gpu/README.md); steps 5 and 11
# also lmcache053.tar.xz, SHA256SUMS.lmcache and lmcache_install.sh. Results: $OUT/stepN/ (rows.json, the servers' logs,
# commands.txt with every command line as run). KVSHARE_COMMIT names the tree in the rows (the tree travels
# without its .git).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/vllm_gpu_all}
VK=${VK_DIR:-.vk}
DRY=${DRY:-0}
M8=/tmp/m8b
M32=/tmp/m32b
# Two 8B replicas with a 128k prompt's KV each (24 GiB) need more than an 80 GB card: there the 8B steps run at 32k
# with 10 GiB of KV each. L8, MAXLEN8 (--max-model-len) and KV_BYTES set them by hand.
CARD_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
if [ "${CARD_MIB:-0}" -gt 0 ] && [ "$CARD_MIB" -lt 100000 ] && [ -z "${L8:-}" ]; then
    L8=32768 MAXLEN8=${MAXLEN8:-33024} KV_BYTES=${KV_BYTES:-10G}
    echo "a card of $CARD_MIB MiB: the 8B steps at 32768 tokens, --max-model-len $MAXLEN8, $KV_BYTES of KV per replica" >&2
fi
L8=${L8:-"32768 131072"}
KV=${KV_BYTES:-24G}
LEN8=${MAXLEN8:+--max-model-len $MAXLEN8}
# DUMMY8=1: the 8B replicas start with vLLM's dummy weights (--load-format dummy, the same seeded values in every
# replica) instead of writing 16 GB of random weights first (~2 min of a fresh machine); the pool namespace then
# takes its weights' name from --model-revision, as the 32B steps do
if [ "${DUMMY8:-0}" = 1 ]; then
    LEN8="$LEN8 --replica-arg=--load-format=dummy --model-revision qwen3-8b-vllm-dummy-seed"
fi
L32_SHORT=32768
L32_LONG=131040  # the 32B shape's context is 131072: room for the 16 generated tokens

plan() {
    cat <<EOF
step  minutes  what (setup: modes; model; lengths)
1     7-8      kvshare: startup on-off; 8B; 32768 x2. Two replicas on one GPU at 0.45 each, started one after
               the other (no --kv-cache-memory-bytes): the start order and each replica's KV size; then pool
               ON == OFF on replica B (greedy tokens and logprobs, 32 steps)
2     8        kvshare: load bench-serve; 8B. 16 sessions x 180 s through the router (alternate), then
               vllm bench serve (prefix_repetition: 4 prefixes of 8192 tokens, 64 prompts, concurrency 8)
3     8        kvshare-pool-off: load bench-serve; 8B. The same with --pool off
4     6        store-cost; 8B; 32768 131072. A replica with the connector beside plain vLLM, 4+4 cold requests
               each (ABBA), 128 tokens each: cold TTFT and decode rate
5     6        lmcache-mp: ttft; 8B; 32768 131072 x2. LMCache 0.5.3's MP server, two vLLM replicas with
               LMCacheMPConnector (vLLM's defaults; if they do not start, rerun with
               LMCACHE_REPLICA_ARG=--enforce-eager, as the study's run was)
6     9        kvshare-restart: ttft; 32B (--load-format dummy); 32768 x2, then 131040 x1. A computes them all,
               stops; B starts on the same pool and loads them (one restart: the 32B start is most of the step)
7     7        vllm-offloading: ttft; 32B; 32768 131040 x1. vLLM's CPU tier (local hit) beside step 6's rows
8     8-9      kvshare: startup ttft-routed, prefetch hints on; 8B; $L8 x2, token-id and chat prompts, each a
               session of three turns through kvshare up's router (alternate: A cold, B across, A again); the
               copy bound from this run's pinned H2D rate (goal: B <= 1.1x the bound)
9     8-9      kvshare: the same with --hints off (kvshare up --no-hints): loads start when vLLM schedules
10    6-7      kvshare: stall; 8B; ${L8##* }. 8 decode streams on B alone, then while B loads A's prefix beside
               them, then while B computes a cold one (goal: the load's worst gap <= 2x the streams' p99 gap)
11    6-7      lmcache-mp: stall; 8B; ${L8##* }. The same with LMCache 0.5.3's MP server (step 5's install)
12    5-6      vllm-offloading: ttft; 8B; $L8 x2. vLLM's CPU tier on the 8B, beside steps 5 and 8
Each step: install ~0.5 min and the 8B model ~1.5 min on a fresh machine (both skipped on a warm one; with
DUMMY8=1 the 8B replicas take vLLM's dummy weights and no model is written).
EOF
}

prepare() {  # the vLLM bundle, its environment, and the model directories this step needs
    # shellcheck source=benchmarks/vllm_bundle.sh
    source benchmarks/vllm_bundle.sh || exit 1
    export PYTHONUNBUFFERED=1
    case " $* " in *" 8b "*) [ -f $M8/config.json ] || if [ "${DUMMY8:-0}" = 1 ]; then
            python3 -m kvshare make-model qwen3-8b --out $M8 --no-weights 2>&1 | tail -1
        else
            python3 -m kvshare make-model qwen3-8b --out $M8 --device cuda 2>&1 | tail -1
        fi;; esac
    case " $* " in *" 32b "*) [ -f $M32/config.json ] \
        || python3 -m kvshare make-model qwen3-32b --out $M32 --no-weights 2>&1 | tail -1;; esac
}

# shellcheck source=benchmarks/vllm_steps.sh
source benchmarks/vllm_steps.sh

step() {
    local n=$1 t0
    t0=$(date +%s)
    case $n in
        1) [ "$DRY" = 1 ] || prepare 8b
           driver 1 450 --setup kvshare --modes startup on-off --model-dir $M8 --lengths 32768 --prompts 2 ;;
        2) [ "$DRY" = 1 ] || prepare 8b
           driver 2 480 --setup kvshare --modes load bench-serve --model-dir $M8 $LEN8 --kv-cache-memory-bytes $KV \
               --sessions 16 --duration-s 180 ;;
        3) [ "$DRY" = 1 ] || prepare 8b
           driver 3 480 --setup kvshare-pool-off --modes load bench-serve --model-dir $M8 $LEN8 \
               --kv-cache-memory-bytes $KV --sessions 16 --duration-s 180 ;;
        4) [ "$DRY" = 1 ] || prepare 8b
           driver 4 420 --setup store-cost --model-dir $M8 $LEN8 --kv-cache-memory-bytes $KV --lengths $L8 ;;
        5) lmcache_step_ready 8b || return 1
           driver 5 420 --setup lmcache-mp --model-dir $M8 $LEN8 --kv-cache-memory-bytes $KV --lengths $L8 --prompts 2 \
               ${LMCACHE_REPLICA_ARG:+--replica-arg=$LMCACHE_REPLICA_ARG} ;;
        6) [ "$DRY" = 1 ] || prepare 32b  # 32k twice (B's first request, then steady), then 128k: 51 GB of KV
           driver 6 560 --setup kvshare-restart --model-dir $M32 --model-name qwen3-32b --load-format dummy \
               --model-revision qwen3-32b-vllm-dummy-seed --max-model-len 131072 --pool-size 56GiB \
               --lengths $L32_SHORT $L32_SHORT $L32_LONG --prompts 1 ;;
        7) [ "$DRY" = 1 ] || prepare 32b
           driver 7 480 --setup vllm-offloading --model-dir $M32 --model-name qwen3-32b --load-format dummy \
               --max-model-len 131072 --offloading-gib 48 --lengths $L32_SHORT $L32_LONG --prompts 1 ;;
        8|9) [ "$DRY" = 1 ] || prepare 8b
           driver "$n" 560 --setup kvshare --modes startup ttft-routed --hints "$([ "$n" = 8 ] && echo on || echo off)" \
               --policy alternate --model-dir $M8 $LEN8 --kv-cache-memory-bytes $KV --lengths $L8 --prompts 2 ;;
        10) [ "$DRY" = 1 ] || prepare 8b
            driver 10 480 --setup kvshare --modes stall --model-dir $M8 $LEN8 --kv-cache-memory-bytes $KV \
                --lengths "${L8##* }" ;;
        11) lmcache_step_ready 8b || return 1
            driver 11 480 --setup lmcache-mp --modes stall --model-dir $M8 $LEN8 --kv-cache-memory-bytes $KV \
                --lengths "${L8##* }" ${LMCACHE_REPLICA_ARG:+--replica-arg=$LMCACHE_REPLICA_ARG} ;;
        12) [ "$DRY" = 1 ] || prepare 8b
            driver 12 420 --setup vllm-offloading --model-dir $M8 $LEN8 --offloading-gib 48 --lengths $L8 --prompts 2 ;;
        *) echo "no step $n (steps 1-12; no argument prints the plan)"; return 2 ;;
    esac
    [ "$DRY" = 1 ] || echo "step $n done in $(( $(date +%s) - t0 )) s"
}

run_steps "$@"
