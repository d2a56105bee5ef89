#!/usr/bin/env bash
# Real vLLM 0.26 on the H200: install the slim vLLM bundle, write the Qwen3-8B-shape model, then
# benchmarks/vllm_gpu.py: kvshare (two replicas on one GPU, one pool: cold, cross-replica, local) and
# vLLM's native CPU offloading (a local hit) on the same prompt lengths. Results: $OUT/rows.json, logs.
#
#   bash benchmarks/vllm_gpu.sh [LENGTHS...]        (default 32768 131072)
#
# Needs, in .vk/ (ignored, carried): vllm026-sm90.tar.xz.part-aa, SHA256SUMS, install_on_device.sh
# (from the vLLM bundle build). ENGINES="kvshare vllm-offloading" (default both; the driver's --setup), BUDGET_S
# (default 560): an engine is skipped when less than its estimated time is left. The other measurements (store
# cost, pool ON == OFF, the load run, vllm bench serve, LMCache, the 32B shape): benchmarks/vllm_gpu_all.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/vllm_gpu_out}
mkdir -p "$OUT"
VK=${VK_DIR:-.vk}
LENGTHS=${*:-32768 131072}
ENGINES=${ENGINES:-kvshare vllm-offloading}
BUDGET_S=${BUDGET_S:-560}
T0=$(date +%s)
left() { echo $((BUDGET_S - ($(date +%s) - T0))); }
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# shellcheck source=benchmarks/vllm_bundle.sh
source benchmarks/vllm_bundle.sh || exit 1
python3 -c "import vllm, kvshare.integrations.vllm.connector as c; print('connector loads on vLLM', vllm.__version__)" \
    2>&1 | tail -3
MODEL=/tmp/m8b
[ -f $MODEL/config.json ] || python3 -m kvshare make-model qwen3-8b --out $MODEL --device cuda 2>&1 | tail -2
echo "model written at $(( $(date +%s) - T0 )) s"

for engine in $ENGINES; do
    need=200; [ "$engine" = kvshare ] && need=260
    if [ "$(left)" -lt $need ]; then echo "skipped $engine: $(left) s left"; continue; fi
    timeout $(( $(left) - 10 )) python3 benchmarks/vllm_gpu.py --setup "$engine" --model-dir $MODEL \
        --lengths $LENGTHS --out "$OUT" ${DRIVER_ARGS:-} 2>&1 | tee -a "$OUT/driver.log"
    echo "$engine done at $(( $(date +%s) - T0 )) s"
done
grep -E "Traceback|Error|error:" "$OUT"/kvshare.log 2>/dev/null | head -20
