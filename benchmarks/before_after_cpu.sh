#!/usr/bin/env bash
# Cross-replica TTFT on CPU of two trees, measured alternately: is one within the other's noise?
#
#   bash benchmarks/before_after_cpu.sh TREE_1 TREE_2 [ROUNDS]
#
# Each round runs, for each tree (the order swapped every round, so drift of the machine's load falls on
# both), with PYTHONPATH=TREE so that the tree's kvshare is what runs (the vLLM servers load the connector
# from the same tree):
#   builtin  `kvshare demo --scale smoke`: the built-in engine on the tiny model, two replicas and a router;
#            its records give the cross-replica TTFT of the ttft experiment and of the blocks' ON requests
#            (replica B loads what replica A stored), at 1024 tokens
#   vllm     `python -m kvshare.integrations.vllm.bench`: vLLM CPU with kvshare's connector on the tiny
#            model, A stores and B loads (cross_B) next to A's cold prefill (cold_A), at $VLLM_LENGTH tokens
# and prints, per figure and tree, the median over the rounds and their spread (min - max), with the load
# average each run began at. About 2.5 minutes a round and tree on a 2-core machine.
#
# Environment: VLLM_PYTHON (the vLLM virtual environment's python; default /work/.venv-vllm/bin/python;
# empty: the vLLM runs are skipped), VLLM_LENGTH (default 4096), VLLM_REPEATS (default 2), PYTHON
# (default python), OUT (default a new folder under /tmp: every run's records and logs stay there).
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: $0 TREE_1 TREE_2 [ROUNDS]" >&2
    exit 2
fi
TREES=("$(cd "$1" && pwd)" "$(cd "$2" && pwd)")
ROUNDS=${3:-3}
PYTHON=${PYTHON:-python}
VLLM_PYTHON=${VLLM_PYTHON-/work/.venv-vllm/bin/python}
VLLM_LENGTH=${VLLM_LENGTH:-4096}
VLLM_REPEATS=${VLLM_REPEATS:-2}
OUT=${OUT:-$(mktemp -d /tmp/before-after-cpu.XXXXXX)}
mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd)

describe() {  # a tree's commit, and whether its working tree differs from it
    git -C "$1" describe --always --dirty 2>/dev/null || echo "(not a git tree)"
}

run_tree() {  # run_tree INDEX ROUND: both benchmarks on one tree, into $OUT/tINDEX/rROUND
    local tree=${TREES[$1]} dir="$OUT/t$1/r$2"
    mkdir -p "$dir"
    cut -d' ' -f1 /proc/loadavg > "$dir/loadavg"
    echo "round $2, tree $((${1} + 1)) ($tree, $(describe "$tree")), load $(cat "$dir/loadavg")" >&2
    (cd "$tree" && PYTHONPATH="$tree" "$PYTHON" -m kvshare demo --scale smoke --port "$((18500 + RANDOM % 1000))" \
        --out "$dir/demo" > "$dir/demo.log" 2>&1) || echo "  builtin run failed: $dir/demo.log" >&2
    if [ -n "$VLLM_PYTHON" ]; then
        (cd "$tree" && PYTHONPATH="$tree" "$PYTHON" -m kvshare.integrations.vllm.bench --vllm-python "$VLLM_PYTHON" \
            --lengths "$VLLM_LENGTH" --repeats "$VLLM_REPEATS" --out "$dir/vllm" > "$dir/vllm.log" 2>&1) \
            || echo "  vllm run failed: $dir/vllm.log" >&2
    fi
}

for ((round = 1; round <= ROUNDS; round++)); do
    if ((round % 2)); then order=(0 1); else order=(1 0); fi
    for i in "${order[@]}"; do
        run_tree "$i" "$round"
    done
done

"$PYTHON" "$HERE/before_after_table.py" "$OUT" "${TREES[0]} ($(describe "${TREES[0]}"))" \
    "${TREES[1]} ($(describe "${TREES[1]}"))"
echo "runs: $OUT" >&2
