#!/usr/bin/env bash
# One device call (`run` with carry [".whl"]): install the carried wheels, then the GPU tests and the
# varlen / compile before-after rungs, writing JSON and logs under $OUT. Each part is well under the
# 10-minute limit on an H100; pass the part to run: tests | varlen | compile | adaln | mix | recompiles.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
bench() { python3 -m benchmarks.run_benchmarks --ladder gpu --steps 5 --warmup 3 --only "$1" --out "$OUT/$2"; }
case "${1:-tests}" in
    tests) python3 -m pytest -q -m gpu tests 2>&1 | tee "$OUT/gpu-tests.log" ;;
    varlen) bench h4096-8k-L6,h4096-8k-L6-flex,xl2-256-img,xl2-256-img-flex,cross-16k-mix-packed,cross-16k-mix-flex varlen ;;
    compile) bench h4096-8k-L6,h4096-8k-L6-compiled,xl2-256-img,xl2-256-img-compiled compile ;;
    adaln) bench h4096-8k-L6,h4096-8k-L6-adaln-gather,xl2-256-img,xl2-256-img-adaln-gather adaln ;;
    mix) bench cross-1k-img-fixed,cross-256-img-fixed,cross-2k-video-fixed,cross-4k-video-fixed,cross-16k-mix-packed mix ;;
    recompiles) python3 -m benchmarks.recompiles --packs 50 2>&1 | tee "$OUT/recompiles.log" ;;
    *) echo "next_run.sh: unknown part $1" >&2; exit 2 ;;
esac
