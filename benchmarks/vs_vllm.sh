#!/usr/bin/env bash
# The headline table on the GPU machine: install the vLLM 0.26 bundle, write the preset's model directory, then
# benchmarks/vs_vllm.py: kvshare (`kvshare up`, 2 replicas, built-in engine) and vLLM 0.26 (1 replica, its native
# CPU offloading) on the same model, prompts and client. Results: $OUT/vs-vllm/ (README.md, rows.json, logs/).
#
#   bash benchmarks/vs_vllm.sh [LENGTHS...]        (default 32768 131072)
#
# Needs, in .vk/ (ignored, carried): vllm026-sm90.tar.xz.part-aa, SHA256SUMS, install_on_device.sh (from the
# vLLM bundle build, ../shared/vllm-gpu/README.md). PRESET (default qwen3-8b; qwen3-32b is written without its
# weights, which each engine then draws on the GPU: --no-weights), ATTENTION (the built-in engine's
# --attention: auto, the default, takes the bundle's vllm_flash_attn), CLIENTS (default token_ids), ENGINES
# (default "kvshare vllm"; one per command where both do not fit a time limit: the same RESULTS folder completes
# the table; on a machine that gives each command a fresh $OUT, set RESULTS=/tmp/vs-vllm-results in both and the
# folder is copied to $OUT at the end of each), DRIVER_ARGS.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/vs_vllm_out}
mkdir -p "$OUT"
VK=${VK_DIR:-.vk}
LENGTHS=${*:-32768 131072}
PRESET=${PRESET:-qwen3-8b}
ATTENTION=${ATTENTION:-auto}
CLIENTS=${CLIENTS:-token_ids}
ENGINES=${ENGINES:-kvshare vllm}
RESULTS=${RESULTS:-$OUT/vs-vllm}
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# shellcheck source=benchmarks/vllm_bundle.sh
source benchmarks/vllm_bundle.sh || exit 1
python3 -c "import vllm; from kvshare.engine.flash import find_flash_kernel as f; k, why = f(); \
print('vLLM', vllm.__version__, '| built-in engine prefill attention:', k.name if k else why)" 2>&1 | tail -2
MODEL=/tmp/vs-vllm-$PRESET
# the 32B shape's 65 GB of weights do not fit the machine's disk: each engine draws them on the GPU instead
NO_WEIGHTS=(); [ "$PRESET" = qwen3-32b ] && NO_WEIGHTS=(--no-weights)
[ -f "$MODEL/config.json" ] || python3 -m kvshare make-model "$PRESET" --out "$MODEL" --device cuda "${NO_WEIGHTS[@]}" \
    2>&1 | tail -1
client_args=()
for c in $CLIENTS; do client_args+=(--client "$c"); done
# shellcheck disable=SC2086
python3 benchmarks/vs_vllm.py --preset "$PRESET" --model-dir "$MODEL" --device cuda --vllm-python python3 \
    --lengths $LENGTHS "${client_args[@]}" --engines $ENGINES --replica-arg="--attention=$ATTENTION" "${NO_WEIGHTS[@]}" \
    --out "$RESULTS" ${DRIVER_ARGS:-} 2>&1 | tee -a "$OUT/driver.log"
[ "$RESULTS" = "$OUT/vs-vllm" ] || cp -r "$RESULTS" "$OUT/vs-vllm"
