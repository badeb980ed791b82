#!/usr/bin/env bash
# The miniseries: compute-optimal models (the default ratio picks each horizon) at a series of depths,
# each evaluated with base_eval; bpb and CORE go to $NANOCHAT_BASE_DIR/miniseries.csv, which
# dev/plot_scaling.py also plots (loss vs FLOPs, one point per depth).
#
#   bash runs/miniseries.sh                                # d10 ... d26 on the visible GPUs
#   DEPTHS="2 3" RATIO=1 TRAIN_ARGS="--aspect-ratio 32 --head-dim 32 --max-seq-len 128 --device-batch-size 8 \
#     --total-batch-size 4096 --eval-tokens 4096" EVAL_ARGS="--max-per-task 8 --eval-tokens 4096" bash runs/miniseries.sh
#
# Settings (environment): DEPTHS, RATIO, NPROC, TRAIN_ARGS, EVAL_ARGS, EVAL_BUNDLE, PYTHON,
# NANOCHAT_BASE_DIR, NANOCHAT_DATA_DIR. Needs a tokenizer (python -m scripts.tok_train). Running it again goes on where
# it stopped: a depth with a row in the CSV (trained and evaluated) is skipped; delete the row, or the CSV, to train it
# again (with other settings, say).
set -euo pipefail
source "$(dirname "$0")/lib.sh"  # launch, logged, absolute
absolute NANOCHAT_BASE_DIR NANOCHAT_DATA_DIR EVAL_BUNDLE
cd "$(dirname "$0")/.."
export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat}"
DEPTHS="${DEPTHS:-10 12 14 16 18 20 22 24 26}"
RATIO="${RATIO:-12}"
NPROC="${NPROC:-1}"
PYTHON="${PYTHON:-python3}"
TRAIN_ARGS="${TRAIN_ARGS:-}"
EVAL_ARGS="${EVAL_ARGS:-}"
OUT="$NANOCHAT_BASE_DIR/miniseries.csv"
LOGS="$NANOCHAT_BASE_DIR/miniseries_logs"
mkdir -p "$LOGS"
[ -s "$OUT" ] || echo "depth,flops,params,scaling_params,tokens,val_bpb,core" > "$OUT"
bundle=()
[ -n "${EVAL_BUNDLE:-}" ] && bundle=(--eval-bundle "$EVAL_BUNDLE")
if [[ " $EVAL_ARGS " != *" --skip-core "* ]]; then  # the CORE bundle (or its download) before any training
    "$PYTHON" - "${EVAL_BUNDLE:-}" <<'EOF'
import sys
from nanochat.common import fail
from nanochat.core_eval import find_eval_bundle, EvalBundleError
try:
    find_eval_bundle(sys.argv[1] or None)
except EvalBundleError as e:
    fail(f"{e} (or give EVAL_ARGS=--skip-core)")
EOF
fi

for depth in $DEPTHS; do
    tag="mini_d${depth}"
    if grep -q "^$depth," "$OUT"; then
        echo "--- depth $depth: in $OUT already, skipped (delete its row to train it again)"
        continue
    fi
    echo "--- depth $depth (ratio $RATIO)"
    # --start-over: an earlier run of this depth that did not finish is moved into replaced_<time>/ (not deleted)
    logged "$LOGS/$tag.train.log" scripts.base_train --depth="$depth" --target-param-data-ratio="$RATIO" --model-tag="$tag" \
        --start-over --core-metric-every=-1 --sample-every=-1 $TRAIN_ARGS
    logged "$LOGS/$tag.eval.log" scripts.base_eval --model-tag="$tag" ${bundle[@]+"${bundle[@]}"} $EVAL_ARGS
    bpb=$(sed -nE 's/^val bpb: ([0-9.]+)$/\1/p' "$LOGS/$tag.eval.log")
    core=$(sed -nE 's/^CORE \([0-9]+\/[0-9]+ tasks\): (-?[0-9.]+)$/\1/p' "$LOGS/$tag.eval.log")
    echo "$depth,$(train_log_numbers "$LOGS/$tag.train.log"),$bpb,$core" | tee -a "$OUT"
done
echo "wrote $OUT; plot with: $PYTHON -m dev.plot_scaling $OUT"
