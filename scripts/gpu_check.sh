#!/usr/bin/env bash
# On the GPU machine, in one call: the sm_90 compile report, the test suite on CUDA (bf16 and
# fp16, seqlen up to 4k), and the benchmark; everything lands under $OUT.
#   scripts/gpu_check.sh [tests] [sweep] [bench] [memory]    (default: tests bench)
# BENCH_ARGS narrows or widens the benchmark grid (flashtile bench options).
set -uo pipefail
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export FLASHTILE_COMMIT=${FLASHTILE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
stages=${*:-tests bench}
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
python -m flashtile info
for stage in $stages; do
  case $stage in
    tests)
      timeout "${TEST_TIMEOUT:-330}" python -m pytest tests -q -n "${TEST_WORKERS:-8}" -p no:cacheprovider \
        ${TEST_ARGS:-} 2>&1 | tee "$OUT/tests.log" | tail -25 || status=1 ;;
    memory)
      python scripts/memory_check.py --out "$OUT/memory.json" || status=1 ;;
    sweep)
      python scripts/sweep_configs.py --out "$OUT/sweep.jsonl" ${SWEEP_ARGS:-} || status=1 ;;
    bench)
      python -m flashtile bench ${BENCH_ARGS:-} --out "$OUT" --name bench 2>&1 | tee "$OUT/bench.log" | tail -80 || status=1 ;;
    *) echo "unknown stage $stage"; status=2 ;;
  esac
done
exit $status
