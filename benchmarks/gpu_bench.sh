#!/usr/bin/env bash
# The study's experiments on the H200 (built-in engine, synthetic Qwen3 shapes), one step per
# command of at most 10 minutes; each step appends to a results folder, so a step cut short is continued by
# running it again with the same folder.
#
#   benchmarks/gpu_bench.sh STEP [RESULTS]        (from the repository root, on the GPU machine)
#
#   32b-128k     blocks (OFF-ON-ON-OFF, PER_BLOCK_128K per block, default 4: bootstrap CIs; primes
#                two at a time, --prime-batch 2, as two 31.3 GiB primes are what an 80 GiB pool
#                holds) then ttft (1 prompt) at 128k, Qwen3-32B shape; the study's headline figure;
#                blocks first, so that a command cut short has it and leaves the ttft for a continuation
#   8b-256k      blocks at 256k (256000 tokens), Qwen3-8B shape, PER_BLOCK_256K per block (default 4),
#                primes two at a time (two 35 GiB primes in an 80 GiB pool), local caches off (two
#                replicas with 256k of KV leave no room for them); the study's second headline
#   32b-32k      kvshare validate (if the command exists), then ttft (2 prompts) and blocks
#                (8 per block, bootstrap CIs) at 32k, Qwen3-32B shape
#   8b-sessions  sessions: 2 replicas of the Qwen3-8B shape on the GPU, 6 turns, alternate vs
#                sticky, pool off vs on, at 32k then 128k (2 sessions each, as time allows)
#   32b-sessions the same sessions with 2 replicas of the Qwen3-32B shape, one GPU each
#                (--device cuda:0,cuda:1: run on an nvidia-h200-x2 machine), as the study's 27B
#                replicas ran; the 8B shape's prefill is fast enough beside its decode that at 32k an
#                alternating session can save at most ~26% (the runs of 2026-12-02 at d602ddb)
#   report       only rewrite and print the report of RESULTS
#
# Environment: M8 (the 8b steps' model, e.g. qwen3.5-9b: hybrid_gpu.sh), LOCAL8 (their local caches, default 20GiB),
# SESSIONS (8b-sessions: sessions per condition, default 2; their requests keep their
# timelines), SESSION_CONTEXTS (8b-sessions' initial contexts, default "32k,128k"; e.g. 128k to
# continue with 128k only), PER_BLOCK_32K (default 8), KVSHARE_BENCH_SECONDS (default 520),
# VALIDATED (set in a command that continues a step whose first command ran `kvshare validate` on the
# same tree: skips it, ~30 s of GPU time; the log says so).
#
# 32B: two replicas with 128k of KV do not fit one GPU together, so replicas run one after the
# other against one pool (kvshare bench --sequential): prime on replica A, stop it, start B,
# measure; B never saw the prompt. Each started replica is warmed up (two small requests) before
# it is measured. 128k = 128000 tokens (the presets' limit is 131072).
#
# Time: a step stops starting new work so that it ends within KVSHARE_BENCH_SECONDS (default
# 520 s: under the 600 s a device command may run, with room to stop the replicas); `timeout`
# sends SIGTERM, which the harness treats as Ctrl-C (keeps what it measured). Run a step again
# to continue it.
# Estimates from the prefill times measured on the H200 (docs/results/README.md)
# (32B cold prefill ~6 s at 32k, ~48 s at 128k; 8B
# ~13 s at 128k, ~48 s at 256k; a 32B replica start ~45 s), not yet measured with this script:
#   32b-128k ~20 min with 4 per block (8 OFF + 8 primes + 1 ttft cold prefill at 128k, ~10 replica starts:
#            each batch of primes is one switch A -> B): three commands, each continuing the last
#   8b-256k  ~15 min with 4 per block (8 OFF + 8 primes at ~48 s, one cluster start): two commands
#   8b-sessions ~5 min; 32b-32k ~6-7 min
# In this order of priority if GPU time is short (the 128k blocks are the study's headline).
#
# Between commands (the machine starts bare each time), on the machine that starts them:
#   run:   carry [".whl", "results/gpu"], command "benchmarks/gpu_bench.sh 32b-128k"
#   after: mkdir -p results/gpu && tar xzf <files_at>/gpu-results.tgz -C results/gpu
# $OUT receives gpu-results.tgz (the whole folder: records, report, plots, replica logs),
# report.md, the two plots and this step's log.
set -uo pipefail
STEP=${1:?usage: benchmarks/gpu_bench.sh 32b-32k|32b-128k|8b-256k|8b-sessions|32b-sessions|report [RESULTS]}
cd "$(dirname "$0")/.."
RESULTS=${2:-results/gpu}
TOTAL=${KVSHARE_BENCH_SECONDS:-520}
MARGIN=40  # seconds kept for the report and packing
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$RESULTS"
if [ -n "${OUT:-}" ] && [ -z "${GPU_BENCH_LOGGED:-}" ]; then  # run again under tee: the log comes back in $OUT
    GPU_BENCH_LOGGED=1 "$0" "$@" 2>&1 | tee -a "$OUT/gpu_bench_$STEP.log"
    exit "${PIPESTATUS[0]}"
fi
echo "== gpu_bench $STEP -> $RESULTS ($(date -u +%FT%TZ))"

# msgspec (the server's JSON) is not on the GPU image: install the carried wheels
if ! $PY -c "import msgspec" 2>/dev/null; then
    if ls .whl/*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            || { echo "installing .whl/ failed"; exit 2; }
        export PYTHONPATH=$PYTHONPATH:/tmp/site
    else
        echo "msgspec is missing and no .whl/ was carried (see .whl in the repository root)"; exit 2
    fi
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true

left() { echo $(( TOTAL - MARGIN - SECONDS )); }

bench() {  # kvshare bench ARGS..., stopped (SIGTERM) at the step's deadline
    local budget; budget=$(left)
    if [ "$budget" -lt 30 ]; then echo "no time left for: $*"; return 0; fi
    timeout --signal=TERM --kill-after=60 "$budget" \
        $PY -m kvshare --log-level WARNING bench "$@" --out "$RESULTS" --no-progress --no-tables --time-budget "$budget"
    local rc=$?
    case $rc in
        0) ;;
        3|124|130) echo "(stopped before the end: run this step again to continue)" ;;
        *) echo "kvshare bench exited with $rc" ;;
    esac
}

validate() {
    if [ -n "${VALIDATED:-}" ]; then  # a continuation: the first command of this step validated this tree
        echo "== kvshare validate skipped: VALIDATED=$VALIDATED (this step's first command ran it)"
    elif $PY -m kvshare validate --help >/dev/null 2>&1; then
        echo "== kvshare validate --level bytes,helpers,full-pool"
        timeout --signal=TERM 180 $PY -m kvshare validate --level bytes,helpers,full-pool \
            || echo "VALIDATION FAILED OR TIMED OUT (exit $?): treat the numbers below with suspicion"
    else
        echo "== (kvshare validate does not exist in this tree yet: validation skipped)"
    fi
}

# overridable for a dry run of this script on CPU, e.g. KVSHARE_BENCH_DRY=1 (tiny model, 1k/2k contexts)
if [ -n "${KVSHARE_BENCH_DRY:-}" ]; then M32=tiny M8=${M8:-tiny} DEV=cpu DEV2=cpu POOL=2GiB CTX_A=1k CTX_B=2k CTX_C=3k LEN8=8192 LEN32=8192; fi
# the pool holds one block's primes below its 90% low watermark (above 95%, LRU evicts down to 90%,
# tails first): 8 x 7.8 GiB at 32k, 2 x 31.3 GiB at 128k. With 66 GiB, 2 x 31.3 GiB at 128k plus the
# warm-ups crossed the watermark and the measured requests found only 446-450 of 500 chunks; 8 x 7.8
# GiB at 32k (after the ttft unit's prompts) did the same: 71 of 125 chunks (2026-12-02). The report's
# "min pool tokens (ON)" shows it.
case $STEP in 32b-32k|32b-128k|8b-256k|32b-sessions) POOL=${POOL:-80GiB} ;; esac
M32=${M32:-qwen3-32b} M8=${M8:-qwen3-8b} DEV=${DEV:-cuda} POOL=${POOL:-66GiB} CTX_A=${CTX_A:-32k} CTX_B=${CTX_B:-128k} CTX_C=${CTX_C:-256k}
PER_BLOCK_32K=${PER_BLOCK_32K:-8} PER_BLOCK_128K=${PER_BLOCK_128K:-4} PER_BLOCK_256K=${PER_BLOCK_256K:-4}
SESSION_CONTEXTS=${SESSION_CONTEXTS:-$CTX_A,$CTX_B}  # e.g. SESSION_CONTEXTS=128k to continue with 128k only
GPU32=(--model "$M32" --device "$DEV" --sequential --replicas 2 --pool-size "$POOL" --unit-allowance 60)
# two 8B replicas share the GPU: the preset's 262144 positions would give each a 36 GiB sequence KV,
# which with 20 GiB local caches overfills the GPU (out of memory in the runs of 2026-12-01 at 237d68f);
# 131072 holds the 128k turns
GPU8=(--model "$M8" --device "$DEV" --replicas 2 --pool-size "$POOL" --replica-arg=--local-cache-size="${LOCAL8:-20GiB}"
      --replica-arg=--max-model-len="${LEN8:-131072}")
# the study's placement: two replicas of the 32B shape, one GPU each (an nvidia-h200-x2 machine): 61 GiB of
# weights, 32 GiB of sequence KV at 131072 and a 32 GiB local cache per GPU
GPU32X2=(--model "$M32" --device "${DEV2:-cuda:0,cuda:1}" --replicas 2 --pool-size "$POOL"
         --replica-arg=--local-cache-size=32GiB --replica-arg=--max-model-len="${LEN32:-131072}")

case $STEP in
    32b-32k)
        validate
        bench suite --experiments ttft,blocks "${GPU32[@]}" --replica-arg=--local-cache-size=12GiB \
            --contexts "$CTX_A" --repetitions 2 --per-block "$PER_BLOCK_32K" --max-tokens 16 --verify 1
        ;;
    32b-128k)
        validate
        bench suite --experiments blocks,ttft "${GPU32[@]}" --replica-arg=--local-cache-size=32GiB \
            --contexts "$CTX_B" --repetitions 1 --per-block "$PER_BLOCK_128K" --prime-batch 2 --max-tokens 16 --verify 0
        ;;
    8b-256k)
        validate
        bench blocks --model "$M8" --device "$DEV" --replicas 2 --pool-size "$POOL" --replica-arg=--local-cache-size=0 \
            --contexts "$CTX_C" --per-block "$PER_BLOCK_256K" --prime-batch 2 --max-tokens 16 --verify 0
        ;;
    32b-sessions)
        validate
        bench sessions "${GPU32X2[@]}" --contexts "$SESSION_CONTEXTS" --sessions "${SESSIONS:-2}" --turns 6 \
            --turn-tokens 200 --answer-tokens 32 --verify 1 --timeline
        ;;
    8b-sessions)
        validate
        bench sessions "${GPU8[@]}" --contexts "$SESSION_CONTEXTS" --sessions "${SESSIONS:-2}" --turns 6 --turn-tokens 200 \
            --answer-tokens 32 --verify 1 --timeline
        ;;
    report) ;;
    *) echo "unknown step $STEP"; exit 2 ;;
esac

echo "== report ($RESULTS)"
$PY -m kvshare --log-level WARNING bench report --compact --out "$RESULTS"
if [ -n "${OUT:-}" ]; then
    tar czf "$OUT/gpu-results.tgz" -C "$RESULTS" .
    for f in report.md ttft_by_context.png session_turns.png; do
        [ -f "$RESULTS/$f" ] && cp "$RESULTS/$f" "$OUT/"
    done
fi
echo "== gpu_bench $STEP done in $SECONDS s"
