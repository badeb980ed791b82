#!/usr/bin/env bash
# The speedrun pipeline shrunk to a few minutes on a laptop CPU, on the sample data bundled with the
# package (no download): set up a .venv, train a 4096-token tokenizer, pretrain a tiny model
# (depth 4, context 256), evaluate bpb and CORE (a few items per task), sample, write the report.
#
#   bash runs/runcpu.sh
#
# Settings (environment): NANOCHAT_BASE_DIR (default ~/.cache/nanochat/runcpu), STEPS (default 60),
# EVAL_BUNDLE (a local CORE bundle folder; without one CORE is skipped, and the report says so), FRESH (default 1:
# each call deletes the previous call's runcpu checkpoints and runs every stage again; 0 keeps them, resumes, and
# skips the stages that finished).
set -euo pipefail
source "$(dirname "$0")/lib.sh"  # launch, logged, absolute
absolute NANOCHAT_BASE_DIR EVAL_BUNDLE
cd "$(dirname "$0")/.."
export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat/runcpu}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
STEPS="${STEPS:-60}"

if [ ! -e .venv/installed ]; then  # none yet, or an install cut off: (re)install, then mark it done
    [ -x .venv/bin/python ] || python3 -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q torch==2.13.0 || .venv/bin/python -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
    .venv/bin/python -m pip install -q -e ".[dev]"
    touch .venv/installed
fi
CORE_ARGS="--max-per-task 8"
if [ -n "${EVAL_BUNDLE:-}" ]; then
    export EVAL_BUNDLE
else  # no download: CORE needs the bundle (set EVAL_BUNDLE=DIR, or run base_eval, which fetches it)
    echo "no local CORE bundle (EVAL_BUNDLE): the evaluation stage skips CORE"
    CORE_ARGS="--skip-core"
fi

export NANOCHAT_DATA_DIR="$(pwd)/nanochat/sample_data"  # the bundled sample: no download (its validation split holds
                                                        # 5 batches of 8 x 256 tokens: 8,192 evaluation tokens score each row once)
[ "${FRESH:-1}" = "1" ] && rm -rf "$NANOCHAT_BASE_DIR/base_checkpoints/runcpu"
PYTHON=.venv/bin/python NPROC=1 DEPTH=4 MODEL_TAG=runcpu DEVICE_BATCH_SIZE=8 FRESH="${FRESH:-1}" \
TOK_ARGS="--vocab-size 4096 --max-chars 20000000" \
TRAIN_ARGS="--aspect-ratio 32 --head-dim 64 --max-seq-len 256 --window-pattern SL --total-batch-size 4096 \
 --num-iterations $STEPS --warmup-steps 5 --eval-every 20 --eval-tokens 8192 --core-metric-every -1 --sample-every -1" \
EVAL_ARGS="$CORE_ARGS --eval-tokens 8192" \
bash speedrun.sh
