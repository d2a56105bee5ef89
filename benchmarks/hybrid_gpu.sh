#!/usr/bin/env bash
# The Qwen3.5 hybrid (the study's model class) on one GPU, one step per command of at most 9 minutes; each step
# writes its rows under $OUT (from the repository root, on the GPU machine):
#
#   benchmarks/hybrid_gpu.sh STEP
#
#   27b-32k       the 27B shape in bf16, one replica at a time against one pool (two do not fit 80 GB): A (its
#                 weights made on the GPU at start) prefills two fresh 32k prompts cold and again (local), is
#                 stopped; B starts in its place and sends both (its first request of the cluster, then the
#                 steady state): KV pages and the state checkpoint through the pool. Rows: cold_s, cross_s,
#                 kv_bytes + state_bytes moved, bound_s = bytes / pinned H2D measured in the same run,
#                 cross_over_bound, tokens_equal | first_divergence (service_ttft_gpu.py)
#   27b-128k      the same at 128k (131072 tokens less the answer's)
#   32b-32k       the 32B shape (full attention) beside it, the same rows; 32b-128k at 128k. Both need an H200:
#   32b-128k      61 GiB of weights and the KV do not fit an 80 GB H100 (the planner skips the case there); rows
#                 of this script at 128k: docs/results/2026-12-04-c73dae1-h200-service-ttft/
#   9b-sessions-32k   the study's six-turn sessions, alternate vs sticky placement, pool OFF vs ON, two replicas
#   9b-sessions-128k  of the 9B shape on the GPU (gpu_bench.sh's sessions step with M8=qwen3.5-9b); 128k: one
#                     session per condition
#
# Wheels: .whl/ carries fla_core (the GDN kernels: flash-linear-attention's Triton kernels) and einops beside
# msgspec; they install with pip --no-deps --target /tmp/site. A replica without them would run the GDN layers
# in plain torch (far slower): this script refuses to start then.
#
# Measured on an H100 80 GB (docs/results/2026-12-07-efd2ed6-h100-hybrid-tail-graphs; a fresh machine takes 1-2 min
# to start before the command, and its first Triton compiles add up to a minute): 27b-32k 98-106 s (two replica
# starts: 50 GiB of weights made on the GPU, the GDN self-test, the warm-up and the tail graphs' capture; two 32k
# cold and local prefills), 27b-128k 117-146 s (two ~21 s cold prefills; no local cache fits beside the weights),
# 9b-sessions-32k 196 s with `kvshare validate`; estimated: 9b-sessions-128k ~6-8 min; on an H200 32b-32k ~3 min,
# 32b-128k ~5 min. The driver skips a case whose estimate exceeds BUDGET: keep BUDGET at its default.
set -uo pipefail
STEP=${1:?usage: benchmarks/hybrid_gpu.sh 27b-32k|27b-128k|32b-32k|32b-128k|9b-sessions-32k|9b-sessions-128k}
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the folder that receives the rows}
PY=${PYTHON:-python3}
BUDGET=${BUDGET:-500}  # seconds a step may take (a command runs at most 600)
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "installing .whl/ failed"; exit 2; }
fi
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
$PY -c "import fla, einops" 2>/dev/null || { echo "fla-core and einops are missing: carry their wheels in .whl/"; exit 2; }
$PY -c "import msgspec" 2>/dev/null || { echo "msgspec is missing: carry its wheel in .whl/"; exit 2; }
export KVSHARE_COMMIT=${KVSHARE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
echo "== hybrid_gpu $STEP ($(date -u +%FT%TZ), commit $KVSHARE_COMMIT)"

ttft() {  # one case of service_ttft_gpu.py, B's requests straight to its port
    timeout --signal=TERM --kill-after=60 "$BUDGET" $PY benchmarks/service_ttft_gpu.py --out "$OUT" --cases "$1" \
        --paths replica --time-budget "$((BUDGET - 20))" 2>&1 | tee -a "$OUT/hybrid_gpu_$STEP.log"
}

case $STEP in
    27b-32k) ttft 27b:32768 ;;
    27b-128k) ttft 27b:131072 ;;
    32b-32k) ttft 32b:32768 ;;
    32b-128k) ttft 32b:131072 ;;
    9b-sessions-32k|9b-sessions-128k)
        # two 9B replicas share the GPU: 2 x (17 GiB of weights + 4 GiB of KV at 131072 + a 10 GiB local cache)
        ctx=${STEP#9b-sessions-}
        sessions=$([ "$ctx" = 128k ] && echo 1 || echo 2)
        validated=$([ "$ctx" = 128k ] && echo "the 32k step" || echo "")  # kvshare validate once, in the 32k step
        M8=qwen3.5-9b LOCAL8=10GiB SESSION_CONTEXTS=$ctx SESSIONS=${SESSIONS:-$sessions} KVSHARE_BENCH_SECONDS=$BUDGET \
            VALIDATED=${VALIDATED:-$validated} benchmarks/gpu_bench.sh 8b-sessions "results/hybrid-sessions-$ctx"
        ;;
    *) echo "unknown step $STEP"; exit 2 ;;
esac
echo "== hybrid_gpu $STEP done in $SECONDS s"
