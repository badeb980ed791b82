# Sourced by the GPU scripts in this folder (the exact commands behind dev/LOG.md's session-2 figures):
# environment, tokenizer, and a `bench` helper pinned to given GPUs. They expect an ignored folder at the
# repository root, carried to the device: $CARRY, .carry4 unless set. It holds data/ (wiki shards; .carry4:
# 0-3 and 7), base/tokenizer (the tokenizer trained on shards 0-6), and what the script needs of: whl/
# (torchao 0.17.0 for fp8), old/ (an earlier tree), fa4site.tar.xz (flash-attn-4 and its dependencies,
# installed for Python 3.12 with `pip install --target`). Run from anywhere: bash dev/gpu/tp.sh
# (Scripts before session 8 define D20/D12 and copy patched trees themselves; kept as they ran.)
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
CARRY=${CARRY:-.carry4}
export NANOCHAT_BASE_DIR=/tmp/base PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NANOCHAT_DATA_DIR=$(pwd)/$CARRY/data
mkdir -p $NANOCHAT_BASE_DIR && cp -r $CARRY/base/tokenizer $NANOCHAT_BASE_DIR/
# bench GPUS SECONDS NAME ARGS... : one dev.bench_train run on the given GPUs, log in $OUT/NAME.log
bench() {
    local gpus=$1 secs=$2 name=$3; shift 3
    CUDA_VISIBLE_DEVICES=$gpus timeout -k 10 $secs python3 -m dev.bench_train --out $OUT/bench.csv --label "$name" "$@" \
        > $OUT/$name.log 2>&1
    echo "== $name (exit $?): $(grep -E '^RESULT' $OUT/$name.log | tail -1)"
    grep -E "Error|error:|Traceback" $OUT/$name.log | head -3
}
# fp8_wheels: torchao (carried in .carry4/whl) on the path, for --fp8
fp8_wheels() {
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $CARRY/whl/*.whl && export PYTHONPATH=/tmp/site
}
# old_tree: the tree before the session (nanochat/, scripts/, dev/ of an earlier commit, carried in .carry4/old;
# session 5: 5275b0a, session 6: 2e89d52) in /tmp/old, for A/B runs on the same machine (cd /tmp/old && bench ...)
old_tree() {
    rm -rf /tmp/old && mkdir /tmp/old && cp -r $CARRY/old/* /tmp/old/
}
# fa4_site: unpack flash-attn-4 and its dependencies (carried as $CARRY/fa4site.tar.xz) into /tmp/fa4site;
# `with_fa4 CMD...` then runs CMD with them on the path (Python ignores a --target folder's .pth files, so
# cutlass's own path is added by hand)
fa4_site() {
    mkdir -p /tmp/fa4site && tar -C /tmp/fa4site -xJf $CARRY/fa4site.tar.xz
}
with_fa4() {
    ( export PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/python_packages${PYTHONPATH:+:$PYTHONPATH}; "$@" )
}
# patched_tree DIR FILE SED_SCRIPT: a copy of nanochat/, scripts/ and dev/ in DIR with SED_SCRIPT applied to FILE
# (a path inside the copy), for A/B runs on one machine; stops the script if the patch changed nothing
patched_tree() {
    rm -rf $1 && mkdir $1 && cp -r nanochat scripts dev $1/
    sed -i "$3" $1/$2
    cmp -s $2 $1/$2 && { echo "patch of $2 changed nothing"; exit 1; } || true
}
# the bench settings of sessions 3-8 (524,288-token steps): d20 at device batch 32, d12 at 128
D20="--depth 20 --steps 12 --warmup 5"
D12="--depth 12 --steps 16 --warmup 6 --device-batch-size 128"
# clock_log: every GPU's SM clock, power draw and temperature every 100 ms into $OUT/smi.log, in the background
# (job %1 when called first; `kill $CLOCK_LOG` ends it)
clock_log() {
    nvidia-smi --query-gpu=index,timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 100 > $OUT/smi.log &
    CLOCK_LOG=$!
}
