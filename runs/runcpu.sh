#!/usr/bin/env bash
# The whole pipeline, shrunk to a few minutes on a laptop CPU, on the sample data bundled with the
# package (no download): set up, train a tokenizer, pretrain a tiny model, evaluate, sample, report.
#
#   bash runs/runcpu.sh
#
# Settings (environment): NANOCHAT_BASE_DIR (default ~/.cache/nanochat/runcpu), STEPS (default 60).
set -euo pipefail
cd "$(dirname "$0")/.."
export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat/runcpu}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
STEPS="${STEPS:-60}"
mkdir -p "$NANOCHAT_BASE_DIR"

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q torch==2.13.0 || .venv/bin/python -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
    .venv/bin/python -m pip install -q -e ".[dev]"
fi
PY=.venv/bin/python

$PY -m nanochat.report reset
$PY -m scripts.tok_train --vocab-size 4096 --max-chars 20000000
$PY -m scripts.tok_eval --max-chars 1000000
$PY -m scripts.base_train --depth 4 --aspect-ratio 32 --head-dim 64 --max-seq-len 256 --window-pattern SL \
    --device-batch-size 8 --total-batch-size 4096 --num-iterations "$STEPS" --warmup-steps 5 \
    --eval-every 20 --eval-tokens 32768 --core-metric-every -1 --sample-every -1 --model-tag runcpu
$PY -m nanochat.report generate
