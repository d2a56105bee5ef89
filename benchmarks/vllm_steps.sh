# Sourced by the vLLM GPU step scripts (vllm_gpu_all.sh, vllm_hybrid_gpu.sh): LMCache's install, a step's start-up
# beside LMCache, one run of the driver (benchmarks/vllm_gpu.py) and the run of the steps asked for. Needs VK, OUT
# and DRY set, and the sourcing script's plan, prepare and step functions.
# shellcheck shell=bash

lmcache_ready() {  # LMCache 0.5.3 installed (once per machine) and its environment
    if [ ! -f /tmp/lmc_site/lmc_env.sh ]; then
        cp "$VK"/lmcache053.tar.xz /tmp/vk/ && bash "$VK/lmcache_install.sh" > "$OUT/lmcache-install.log" 2>&1 \
            || { tail -20 "$OUT/lmcache-install.log"; return 1; }
    fi
    # shellcheck disable=SC1091
    source /tmp/lmc_site/lmc_env.sh
    export PYTHONPATH=$PWD:$PYTHONPATH
}

lmcache_step_ready() {  # ARGS...: a step beside LMCache, on a real run: prepare ARGS..., then LMCache ready
    [ "$DRY" = 1 ] && return 0
    prepare "$@"
    lmcache_ready
}

driver() {  # STEP SECONDS ARGS...: one run of the driver under a time limit, its command line kept
    local step=$1 limit=$2; shift 2
    local dir=$OUT/step$step
    local cmd=(python3 benchmarks/vllm_gpu.py --out "$dir" "$@")
    if [ "$DRY" = 1 ]; then echo "${cmd[*]}"; return 0; fi
    mkdir -p "$dir"
    echo "timeout $limit ${cmd[*]}" | tee -a "$dir/commands.txt"
    timeout "$limit" "${cmd[@]}" 2>&1 | tee -a "$dir/driver.log"
    grep -hE "Traceback|Error|error:|UnsupportedHybrid" "$dir"/*.log 2>/dev/null | grep -v "driver.log" | head -10
}

run_steps() {  # STEP...: each step in turn, nonzero when one failed; no step: the plan, printed and kept
    mkdir -p "$OUT"
    if [ $# -eq 0 ]; then plan | tee "$OUT/plan.txt"; exit 0; fi
    [ "$DRY" = 1 ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    local status=0 n
    for n in "$@"; do step "$n" || status=$?; done
    return $status
}
