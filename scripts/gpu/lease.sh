#!/usr/bin/env bash
# Issue 30 in ONE device call, parts in fallback order within a total budget (LEASE_BUDGET_S, default
# 540 s of the 600 s a command may run). Each part runs under `timeout` capped by its own limit and by
# what is left, so a failing or slow part never eats the ones after it. After every part its folder is
# appended to $OUT/parts.tar and $OUT/summary.txt / results.md are rewritten: a run cut off at the
# budget still returns what it did. What comes back (5 files): summary.txt, results.md,
# environment.json, parts.tar, lease.log (this script's own output, when the caller tees it there).
#
#   here:    bash scripts/gpu/fetch_wheels.sh        (Python 3.12 wheels -> .whl/, git-ignored)
#   device:  run command="bash scripts/gpu/lease.sh 2>&1 | tee $OUT/lease.log", carry [".whl"], timeout_s 600
#   back:    python -m benchmarks.lease unpack <files_at>   (-> benchmarks/results/<device>-<date>/ + markdown)
#   rehearse here: DFM_GPU_DRYRUN=1 LEASE_BUDGET_S=1800 OUT=/tmp/lease-out bash scripts/gpu/lease.sh
#       (the CPU: the GPU tests with DFM_GPU_TESTS_ON_CPU=1, the gpu ladder's rungs at CPU size, caps x3)
#
# Parts: env (wheels, versions, GPU, torch API probes) | tests (pytest -m gpu) | accept (h4096-8k-L6 and
# xl2-256-img, dfm vs reference) | fp8 (the same two with mixed_precision.fp8=hybrid) | mix (mixed/fixed rungs) |
# backends (flex, sdpa) | compiled |
# variants (rows summed by index_add instead of the one-hot GEMM, uniform packs through varlen instead of one
# batched SDPA call: before/after pairs with accept's rungs) |
# recompiles | profile (the default order: profile right after accept). Parts run in the order PARTS names them; some only, or
# another order: PARTS="env accept profile" bash scripts/gpu/lease.sh.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
BUDGET=${LEASE_BUDGET_S:-540}
PARTS=${PARTS:-env tests accept profile fp8 mix digits backends compiled variants recompiles}
WORK=$(mktemp -d /tmp/lease.XXXXXX)
mkdir -p "$OUT"
rm -f "$OUT/parts.tar" "$OUT/summary.txt"
export PYTHONUNBUFFERED=1
if [[ ${DFM_GPU_DRYRUN:-0} == 1 ]]; then
    LADDER=gpu-rehearsal
    CAP_SCALE=${LEASE_CAP_SCALE:-3}  # 2 shared CPU cores: the stand-in rungs take longer than the real ones
    export DFM_GPU_TESTS_ON_CPU=1 PYTHONPATH=$PWD
    install() { echo "dry run: the wheels stay unpacked (this machine has the packages)"; }
else
    LADDER=gpu
    CAP_SCALE=${LEASE_CAP_SCALE:-1}
    export PYTHONPATH=/tmp/site:$PWD
    install() {
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    }
fi
echo "lease: ladder $LADDER, budget ${BUDGET}s, parts: $PARTS, started $(date -u +%FT%TZ)" | tee "$OUT/summary.txt"

# part NAME CAP COMMAND...: COMMAND (a program or a function below) for at most CAP x CAP_SCALE seconds
# and what the budget leaves, its output in $WORK/NAME/log.txt.
part() {
    local name=$1 cap=$2 start=$SECONDS
    shift 2
    [[ " $PARTS " == *" $name "* ]] || return 0
    local left=$((BUDGET - SECONDS - 10))
    cap=$((cap * CAP_SCALE))
    if ((left < 30)); then
        echo "$name: skipped, budget spent" | tee -a "$OUT/summary.txt"
        return 0
    fi
    ((cap > left)) && cap=$left
    mkdir -p "$WORK/$name"
    timeout --kill-after=10 "$cap" bash -c '"$@"' "$name" "$@" >"$WORK/$name/log.txt" 2>&1
    local rc=$? status
    case $rc in 0) status=ok ;; 124 | 137) status="cut at ${cap}s" ;; *) status="failed (rc $rc)" ;; esac
    echo "$name: $status, $((SECONDS - start)) s: $*" | tee -a "$OUT/summary.txt"
    # Each returned file must stay under 16 MiB: a log keeps its last 2 MB.
    if (($(stat -c %s "$WORK/$name/log.txt") > 2000000)); then
        tail -c 2000000 "$WORK/$name/log.txt" >"$WORK/$name/log.tail" && mv "$WORK/$name/log.tail" "$WORK/$name/log.txt"
    fi
    tar -rf "$OUT/parts.tar" -C "$WORK" "$name"
    python3 -m benchmarks.lease report "$WORK" >"$OUT/results.md" 2>>"$WORK/report-errors.log"
}

environment() { install && python3 -m benchmarks.lease env "$OUT/environment.json"; }
gpu_tests() {
    local files
    files=$(grep -rlE "pytest.mark.gpu|pytestmark = GPU|@gpu_test" tests --include='test_*.py' | sort)
    python3 -m pytest -m gpu -v -rA --durations=15 -p no:cacheprovider --junitxml="$WORK/tests/junit.xml" $files
}
bench() {  # bench PART STEPS WARMUP RUNGS [run_benchmarks options]
    local name=$1 steps=$2 warmup=$3 rungs=$4
    shift 4
    python3 -m benchmarks.run_benchmarks --ladder "$LADDER" --steps "$steps" --warmup "$warmup" \
        --only "$rungs" --out "$WORK/$name" "$@"
}

export -f install environment gpu_tests bench
export OUT WORK LADDER

# One part by name: its cap and command. Parts run in the order PARTS names them.
run_part() {
    case $1 in
        env) part env 120 environment ;;
        tests) part tests 260 gpu_tests ;;
        accept) part accept 150 bench accept 5 3 h4096-8k-L6,xl2-256-img ;;
        mix) part mix 150 bench mix 4 2 cross-1k-img-fixed,cross-256-img-fixed,cross-2k-video-fixed,cross-4k-video-fixed,cross-16k-mix-packed ;;
        backends) part backends 150 bench backends 3 2 h4096-8k-L6-flex,xl2-256-img-flex,cross-16k-mix-flex,xl2-256-img-sdpa ;;
        compiled) part compiled 150 bench compiled 3 2 h4096-8k-L6-compiled,xl2-256-img-compiled ;;
        variants) part variants 150 bench variants 3 2 h4096-8k-L6-rows-index-add,xl2-256-img-rows-index-add,h4096-8k-L6-uniform-varlen,xl2-256-img-uniform-varlen ;;
        digits) part digits 90 bench digits 4 2 digits-video-x16,digits-video-moviegen-x16 ;;
        fp8) part fp8 120 bench fp8 3 2 h4096-8k-L6-fp8,xl2-256-img-fp8 ;;
        recompiles) part recompiles 90 python3 -m benchmarks.recompiles --packs 50 ;;
        profile) part profile 120 python3 -m benchmarks.profile_rung --ladder "$LADDER" --rung h4096-8k-L6 --out "$WORK/profile" ;;
        *) echo "$1: no such part" | tee -a "$OUT/summary.txt" ;;
    esac
}
for name in $PARTS; do run_part "$name"; done
echo "lease: done after $SECONDS s; $OUT: $(ls "$OUT" | tr '\n' ' ')" | tee -a "$OUT/summary.txt"
