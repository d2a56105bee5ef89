# Sourced by the vLLM GPU step scripts (vllm_gpu_all.sh, vllm_hybrid_gpu.sh): LMCache's install and one run of
# the driver (benchmarks/vllm_gpu.py). Needs VK, OUT and DRY set.
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
