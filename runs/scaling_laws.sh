#!/usr/bin/env bash
# Scaling laws: train a grid of depths at fixed FLOP budgets and collect the final validation bpb
# into $NANOCHAT_BASE_DIR/scaling_laws.csv; dev/plot_scaling.py draws loss vs FLOPs per depth.
#
#   bash runs/scaling_laws.sh                                        # GPU defaults
#   DEPTHS="2 3 4" FLOPS="2e11 5e11" TRAIN_ARGS="--aspect-ratio 32 --head-dim 32 --max-seq-len 128 \
#     --device-batch-size 8 --total-batch-size 4096 --eval-tokens 4096" bash runs/scaling_laws.sh   # CPU, minutes
#
# Settings (environment): DEPTHS, FLOPS (budgets), NPROC, TRAIN_ARGS (extra base_train flags),
# PYTHON, NANOCHAT_BASE_DIR, NANOCHAT_DATA_DIR. Needs a tokenizer (python -m scripts.tok_train). Running it again goes
# on where it stopped: a (budget, depth) with a row in the CSV is skipped; delete the row, or the CSV, to train it again.
set -euo pipefail
source "$(dirname "$0")/lib.sh"  # launch, logged, absolute
absolute NANOCHAT_BASE_DIR NANOCHAT_DATA_DIR
cd "$(dirname "$0")/.."
export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat}"
DEPTHS="${DEPTHS:-8 10 12 14 16}"
FLOPS="${FLOPS:-1e18 3e18 1e19}"
NPROC="${NPROC:-1}"
PYTHON="${PYTHON:-python3}"
TRAIN_ARGS="${TRAIN_ARGS:-}"
OUT="$NANOCHAT_BASE_DIR/scaling_laws.csv"
LOGS="$NANOCHAT_BASE_DIR/scaling_laws_logs"
mkdir -p "$LOGS"
[ -s "$OUT" ] || echo "budget,depth,flops,params,scaling_params,tokens,val_bpb" > "$OUT"

for flops in $FLOPS; do
    for depth in $DEPTHS; do
        tag="scaling_f${flops}_d${depth}"
        log="$LOGS/$tag.log"
        if grep -q "^$flops,$depth," "$OUT"; then
            echo "--- depth $depth at $flops FLOPs: in $OUT already, skipped (delete its row to train it again)"
            continue
        fi
        echo "--- depth $depth at $flops FLOPs -> $log"
        # --start-over: an earlier run of this cell that did not finish is moved into replaced_<time>/ (not deleted)
        logged "$log" scripts.base_train --depth="$depth" --target-flops="$flops" --model-tag="$tag" --start-over --core-metric-every=-1 \
            --sample-every=-1 --eval-every=-1 --save-every=0 $TRAIN_ARGS
        bpb=$(sed -nE 's/^Validation bpb: ([0-9.]+)$/\1/p' "$log")
        # flops: what the run did (steps x batch rounds the budget)
        echo "$flops,$depth,$(train_log_numbers "$log"),$bpb" | tee -a "$OUT"
    done
done
echo "wrote $OUT; plot with: $PYTHON -m dev.plot_scaling $OUT"
