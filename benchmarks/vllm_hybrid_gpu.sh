#!/usr/bin/env bash
# The Qwen3.5-27B hybrid (48 Gated DeltaNet + 16 gated attention layers) through real vLLM 0.26 on the GPU machine:
# cold, cross-replica first and steady TTFT at 32k and 128k, with kvshare's connector and beside LMCache 0.5.3's
# MP mode (../shared/vllm-gpu/README.md), in steps that each fit one 10-minute command. No figure of it is claimed
# anywhere yet.
#
#   bash benchmarks/vllm_hybrid_gpu.sh              print the plan (also written to $OUT/plan.txt)
#   bash benchmarks/vllm_hybrid_gpu.sh 1            run step 1
#   DRY=1 bash benchmarks/vllm_hybrid_gpu.sh 1      print step 1's command, run nothing
#   bash benchmarks/vllm_hybrid_gpu.sh 3            the check that the connector moves the GDN state on vLLM CUDA
#                                                   (tests/integrations/vllm/test_hybrid_cuda.py); run it first
#
# Every replica gets what the hybrid's state needs, read from the model's config (launch.hybrid_settings: vLLM's
# block of 784 tokens as block and chunk, --max-num-batched-tokens 784, --mamba-cache-mode align), LMCache's too.
# kvshare's connector has moved the GDN state end to end on vLLM CPU 0.32 only so far: on CUDA it refuses the model
# at start unless "allow_untested_vllm" is set (step 3 sets it for its tiny model; steps 1-2 do not, and step 1 then
# records the refusal in its log, not a row). Needs in .vk/ what benchmarks/vllm_gpu_all.sh needs (step 2: the
# LMCache bundle too). Results: $OUT/stepN/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/vllm_hybrid_gpu}
VK=${VK_DIR:-.vk}
DRY=${DRY:-0}
M27=/tmp/m27
BLOCK=784  # vLLM's block for Qwen3.5-27B with bf16 KV on CUDA (kvshare.integrations.vllm.hybrid.hybrid_block_size)
# LMCache's chunk must be a multiple of the block; its MP server's flag for it is taken as given here: check it
# against `python3 -m lmcache.v1.multiprocess.server --help` (step 2 prints those lines first)
LMCACHE_CHUNK_ARGS=${LMCACHE_CHUNK_ARGS:-"--chunk-size=$BLOCK"}
L_SHORT=32768
L_LONG=131072

plan() {
    cat <<EOF
step  minutes  what (setup: modes; model; lengths)
1     9        kvshare-restart: ttft; 27B (--load-format dummy); $L_SHORT x2 then $L_LONG x2. A computes them all
               (cold), stops; B starts on the same pool and loads them (its first request, then steady)
2     9        lmcache-mp: ttft; 27B; $L_SHORT $L_LONG x2. LMCache 0.5.3's MP server ($LMCACHE_CHUNK_ARGS) and
               two replicas with LMCacheMPConnector, align mode; on one H200 two 27B replicas leave ~8 GiB of
               KV each: run the $L_LONG rows on two GPUs (one replica each) where they do not fit
3     6        check: two vLLM replicas of the tests' tiny Qwen3-Next on this GPU share one pool with the
               connector (allow_untested_vllm); B resumes from A's GDN checkpoint and answers as its own cold run
               (pytest tests/integrations/vllm/test_hybrid_cuda.py)
Each step: install ~0.5 min and the 27B config ~0.1 min on a fresh machine (the weights are vLLM's dummy ones).
EOF
}

prepare() {  # the vLLM bundle, its environment, and the 27B model directory (config and tokenizer only)
    # shellcheck source=benchmarks/vllm_bundle.sh
    source benchmarks/vllm_bundle.sh || exit 1
    export PYTHONUNBUFFERED=1
    [ -f $M27/config.json ] || python3 -m kvshare make-model qwen3.5-27b --out $M27 --no-weights 2>&1 | tail -1
}

# shellcheck source=benchmarks/vllm_steps.sh
source benchmarks/vllm_steps.sh

check_state_move() {  # step 3: the GPU test of the GDN state's move, under a time limit
    local dir=$OUT/step3
    local cmd=(python3 -m pytest -q -p no:cacheprovider -rs -m "gpu and vllm" tests/integrations/vllm/test_hybrid_cuda.py
               --basetemp "$dir/tmp")
    if [ "$DRY" = 1 ]; then printf '%q ' "${cmd[@]}"; echo; return 0; fi
    mkdir -p "$dir"
    { printf 'timeout 540 '; printf '%q ' "${cmd[@]}"; echo; } | tee -a "$dir/commands.txt"
    timeout 540 "${cmd[@]}" 2>&1 | tee -a "$dir/pytest.log"  # the servers' logs stay under $dir/tmp
    return "${PIPESTATUS[0]}"
}

lmcache_chunk_flags() {  # the MP server's chunk flags, to check LMCACHE_CHUNK_ARGS against
    python3 -m lmcache.v1.multiprocess.server --help 2>&1 | grep -i -A1 chunk | head -6
}

step() {
    local n=$1 t0 lmc_args=()
    t0=$(date +%s)
    case $n in
        1) [ "$DRY" = 1 ] || prepare
           driver 1 560 --setup kvshare-restart --model-dir $M27 --model-name qwen3.5-27b --load-format dummy \
               --model-revision qwen3.5-27b-vllm-dummy-seed --max-model-len 131328 --pool-size 64GiB \
               --lengths $L_SHORT $L_SHORT $L_LONG $L_LONG --prompts 1 ;;
        2) lmcache_step_ready || return 1
           [ "$DRY" = 1 ] || lmcache_chunk_flags
           for a in $LMCACHE_CHUNK_ARGS; do lmc_args+=("--lmcache-server-arg=$a"); done
           driver 2 560 --setup lmcache-mp --model-dir $M27 --model-name qwen3.5-27b --load-format dummy \
               --max-model-len 131328 --lengths $L_SHORT $L_LONG --prompts 2 "${lmc_args[@]}" ;;
        3) [ "$DRY" = 1 ] || prepare
           check_state_move || return $? ;;
        *) echo "no step $n (steps 1-3; no argument prints the plan)"; return 2 ;;
    esac
    [ "$DRY" = 1 ] || echo "step $n done in $(( $(date +%s) - t0 )) s"
}

run_steps "$@"
