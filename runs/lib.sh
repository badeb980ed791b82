# Shell helpers shared by speedrun.sh and the runs/ scripts (sourced, not run).

# absolute VAR...: each variable holding a relative path made absolute against the folder the script was called from
# (the scripts cd into the repo first)
absolute() {
    local v
    for v in "$@"; do
        if [ -n "${!v:-}" ] && [ "${!v:0:1}" != / ]; then export "$v=$PWD/${!v}"; fi
    done
}

# launch MODULE ARGS...: a script on $NPROC processes (torchrun), or plainly when NPROC is 1. torchrun reads
# the options after the script too and stops at an abbreviation of its own (--run could be --run-path): `--`
# ends its options, so every script flag reaches the script.
launch() {
    if [ "${NPROC:-1}" -gt 1 ]; then
        local module="$1"; shift
        "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" -m "$module" -- "$@"
    else
        "$PYTHON" -m "$@"
    fi
}

# logged LOG MODULE ARGS...: launch into LOG; when it fails, say so with the end of LOG (the error), then fail
logged() {
    local log="$1"; shift
    if ! launch "$@" > "$log" 2>&1; then
        echo "FAILED: $1 (full log: $log); its last lines:" >&2
        tail -n 15 "$log" >&2
        return 1
    fi
}

# train_log_numbers LOG: "flops,params,scaling_params,tokens" as base_train printed them
train_log_numbers() {
    local params scaling tokens flops
    params=$(sed -nE 's/^parameters: ([0-9,]+) total \| ([0-9,]+) scaling.*/\1/p' "$1" | tr -d ,)
    scaling=$(sed -nE 's/^parameters: ([0-9,]+) total \| ([0-9,]+) scaling.*/\2/p' "$1" | tr -d ,)
    tokens=$(sed -nE 's/^horizon: ([0-9,]+) tokens.*/\1/p' "$1" | tr -d ,)
    flops=$(sed -nE 's/.*total FLOPs ([0-9.e+]+)$/\1/p' "$1")
    echo "$flops,$params,$scaling,$tokens"
}
