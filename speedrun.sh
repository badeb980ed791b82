#!/usr/bin/env bash
# The whole pipeline, end to end: data -> tokenizer -> pretraining -> evaluation -> samples -> report.
#
#   bash speedrun.sh                         # d20 on every visible GPU (or the CPU)
#   DEPTH=12 RATIO=4 bash speedrun.sh        # a smaller, shorter run
#   NANOCHAT_DATA_DIR=/data/shards bash speedrun.sh   # your own parquet shards, no download
#
# Settings (environment variables):
#   DEPTH=20              model depth: the one dial
#   RATIO=12              tokens per scaling parameter (the horizon)
#   NPROC=<all GPUs>      processes for torchrun; 1 runs without torchrun (one GPU, or the CPU)
#   RUN=dummy             wandb run name (dummy = no wandb)
#   FP8=0                 1 = fp8 linears (torchao, H100-class GPUs)
#   MODEL_TAG=d$DEPTH     checkpoint folder name
#   DEVICE_BATCH_SIZE=32  sequences per GPU per micro-batch (lower it if memory runs out; d20 fits 64 on a
#                         141 GB H200, 1-2% faster)
#   NANOCHAT_BASE_DIR     where everything goes (default ~/.cache/nanochat)
#   NANOCHAT_DATA_DIR     a folder of parquet shards to use instead of downloading
#   EVAL_BUNDLE           a local CORE bundle folder (default: download it)
#   TOK_ARGS, TRAIN_ARGS, EVAL_ARGS   extra flags for tok_train / base_train / base_eval
#   PYTHON=python3        the interpreter (runs/runcpu.sh points it at its .venv)
#   FRESH=1               run every stage again (training resumes from MODEL_TAG's last checkpoint: a new
#                         MODEL_TAG trains anew; nothing is deleted)
#
# Re-running skips the stages that finished with the same command and settings (markers in
# $NANOCHAT_BASE_DIR/speedrun/) and resumes training from the last checkpoint; a stage that runs again (its settings
# changed) runs the later ones again too, the data stage apart (it only adds shards). A training run stopped before its
# last step (a STOP file, SIGTERM) ends the script there: run it again to resume. Everything printed also goes to
# $NANOCHAT_BASE_DIR/speedrun.log.
set -euo pipefail
source "$(dirname "$0")/runs/lib.sh"  # launch, logged, absolute
absolute NANOCHAT_BASE_DIR NANOCHAT_DATA_DIR EVAL_BUNDLE
cd "$(dirname "$0")"

export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat}"
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export PYTHONUNBUFFERED=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # torchrun's choice for its workers, said here so it need not warn
DEPTH="${DEPTH:-20}"
RATIO="${RATIO:-12}"
RUN="${RUN:-dummy}"
FP8="${FP8:-0}"
MODEL_TAG="${MODEL_TAG:-d$DEPTH}"
DEVICE_BATCH_SIZE="${DEVICE_BATCH_SIZE:-32}"
PYTHON="${PYTHON:-python3}"
TOK_ARGS="${TOK_ARGS:-}"
TRAIN_ARGS="${TRAIN_ARGS:-}"
EVAL_ARGS="${EVAL_ARGS:-}"
if [ -z "${NPROC:-}" ]; then
    NPROC=$(nvidia-smi -L 2>/dev/null | wc -l || true)
    [ "$NPROC" -ge 1 ] 2>/dev/null || NPROC=1
fi

MARKS="$NANOCHAT_BASE_DIR/speedrun"
mkdir -p "$MARKS"
[ "${FRESH:-0}" = "1" ] && rm -f "$MARKS"/*.done
LOG="$NANOCHAT_BASE_DIR/speedrun.log"
exec > >(tee -a "$LOG") 2>&1
echo "=== speedrun $(date '+%Y-%m-%d %H:%M:%S'): depth $DEPTH, ratio $RATIO, $NPROC process(es), base dir $NANOCHAT_BASE_DIR"

# stage NAME "SETTINGS" COMMAND...: run COMMAND unless NAME finished before with the same command and the same values
# of the SETTINGS it reads (variable names) and no stage before it ran again; record its wall time in the report
RAN_AGAIN=0
STAGES=" data tokenizer tok_eval train eval sample "
stage() {
    local name="$1" settings="$2" v s; shift 2
    local done_as="$*"
    for v in $settings; do done_as+=" $v=${!v:-}"; done
    if [ "$RAN_AGAIN" = 0 ] && [ "$(cat "$MARKS/$name.done" 2>/dev/null)" = "$done_as" ]; then
        echo "--- $name: done before, skipping (FRESH=1 to redo)"
        return 0
    fi
    if [ "$name" != data ]; then  # what this stage makes, the later ones read (more shards change none of it): they
        RAN_AGAIN=1               # are not done until they run again, even if this script is cut off before them
        for s in $name ${STAGES#* $name }; do rm -f "$MARKS/$s.done"; done
    fi
    echo "--- $name"
    # its wall time in the report: added to the last launch's where that one stopped (training), else replacing it
    local t0 mode=replace; t0=$(date +%s)
    if [ -e "$MARKS/$name.stopped" ]; then mode=add; rm "$MARKS/$name.stopped"; fi
    "$@"
    "$PYTHON" -m nanochat.report stage "$name" "$(( $(date +%s) - t0 ))" "$mode"
    echo "$done_as" > "$MARKS/$name.done"
}


if [ ! -f "$MARKS/data.done" ]; then  # a new run: a new report
    "$PYTHON" -m nanochat.report reset
fi

# --- data: local shards, or download what this depth needs ---
get_data() {
    if [ -n "${NANOCHAT_DATA_DIR:-}" ]; then
        echo "using the shards in NANOCHAT_DATA_DIR=$NANOCHAT_DATA_DIR"
        "$PYTHON" -c "from nanochat.dataset import check_data, DataError; from nanochat.common import fail
try: check_data()
except DataError as e: fail(str(e))"
        return
    fi
    # shards for the horizon (~4.8 chars/token, ~250M chars/shard, 1.5x for cropping) + 1 validation,
    # and at least 8 so the tokenizer sees ~2B characters
    local n
    n=$("$PYTHON" - <<EOF
import math, torch
from nanochat.gpt import GPT
from nanochat.recipe import config_for_depth
with torch.device("meta"):
    m = GPT(config_for_depth($DEPTH))
tokens = $RATIO * m.num_scaling_params()
print(max(8, math.ceil(tokens * 4.8 * 1.5 / 250e6) + 1))
EOF
)
    echo "depth $DEPTH at ratio $RATIO needs about $n shards"
    "$PYTHON" -m nanochat.dataset -n "$n"
}
stage data "DEPTH RATIO NANOCHAT_DATA_DIR" get_data

# --- tokenizer ---
stage tokenizer "NANOCHAT_DATA_DIR" "$PYTHON" -m scripts.tok_train $TOK_ARGS
stage tok_eval "" "$PYTHON" -m scripts.tok_eval

# --- pretraining (resumes from the last checkpoint of $MODEL_TAG) ---
finished() {  # whether the run's metrics.jsonl ends with a launch that trained to its last step
    [ -e "$1" ] && "$PYTHON" - "$1" <<'EOF'
import sys
from nanochat.run_log import Run
end = Run(sys.argv[1]).end  # a line a crash cut off is skipped (json.loads line by line would fail on it)
sys.exit(0 if end and end.get("completed") else 1)
EOF
}
train() {
    local resume=()
    local ckpt="$NANOCHAT_BASE_DIR/base_checkpoints/$MODEL_TAG"
    if ls "$ckpt"/meta_*.json >/dev/null 2>&1; then
        resume=(--resume-from-step latest)
    elif [ -e "$ckpt/metrics.jsonl" ]; then  # a run that ended before its first checkpoint: start again
        resume=(--start-over)
    fi
    finished "$ckpt/metrics.jsonl" && mode=add  # the stage's: a wrap-up again (evaluations, report) adds its time
    local fp8=()
    [ "$FP8" = "1" ] && fp8=(--fp8)
    local bundle=()
    [ -n "${EVAL_BUNDLE:-}" ] && bundle=(--eval-bundle "$EVAL_BUNDLE")
    launch scripts.base_train --depth="$DEPTH" --target-param-data-ratio="$RATIO" --device-batch-size="$DEVICE_BATCH_SIZE" \
        --model-tag="$MODEL_TAG" --wandb-run="$RUN" ${fp8[@]+"${fp8[@]}"} ${bundle[@]+"${bundle[@]}"} \
        ${resume[@]+"${resume[@]}"} $TRAIN_ARGS || {
        [ "${resume[0]:-}" != --resume-from-step ] || echo "=== training failed resuming $MODEL_TAG: if DEPTH, RATIO, TOK_ARGS or the data" \
            "changed since its checkpoints, give another MODEL_TAG=NAME (or TRAIN_ARGS=--start-over to set them aside)"
        exit 1; }
    if ! finished "$ckpt/metrics.jsonl"; then
        echo "=== training stopped before its last step; run this script again to resume it"
        "$PYTHON" -m nanochat.report stage train "$(( $(date +%s) - t0 ))" "$mode"  # stage's t0 and mode
        touch "$MARKS/train.stopped"  # the resuming launch's time adds to this one's
        exit 0
    fi
}
stage train "DEPTH RATIO FP8 MODEL_TAG DEVICE_BATCH_SIZE RUN EVAL_BUNDLE TRAIN_ARGS" train

# --- evaluation: CORE and bits per byte ---
evaluate() {
    local bundle=()
    [ -n "${EVAL_BUNDLE:-}" ] && bundle=(--eval-bundle "$EVAL_BUNDLE")
    launch scripts.base_eval --model-tag="$MODEL_TAG" --device-batch-size="$DEVICE_BATCH_SIZE" ${bundle[@]+"${bundle[@]}"} $EVAL_ARGS
}
stage eval "MODEL_TAG DEVICE_BATCH_SIZE EVAL_BUNDLE EVAL_ARGS" evaluate

# --- samples ---
stage sample "" "$PYTHON" -m scripts.sample --model-tag="$MODEL_TAG" --fixed-prompts --temperature 0 --max-tokens 32 --report

# --- report (always regenerated) ---
"$PYTHON" -m nanochat.report generate
echo "=== speedrun finished $(date '+%Y-%m-%d %H:%M:%S'); report: $NANOCHAT_BASE_DIR/report/report.md"
