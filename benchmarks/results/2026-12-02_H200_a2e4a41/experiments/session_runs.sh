#!/usr/bin/env bash
# The device commands of this run, as they ran (scratch/main_v3_gluon*.py there: b78f857's files).
# Session run 1: GPU suite at a2e4a41; forward without the left-edge test and backward's two-bound
# masks (tree) vs b78f857's modules (rev).
set -u
export PYTHONPATH=$PWD FLASHTILE_COMMIT=a2e4a41 PYTHONUNBUFFERED=1
R=$(mktemp -d)
save() { tar czf $OUT/results.tgz -C $R .; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee $R/gpu.txt
timeout 170 python -m pytest tests -q -n 8 -p no:cacheprovider --ignore=tests/test_sm90_compile.py > $R/gpu_tests.log 2>&1; tail -3 $R/gpu_tests.log; save
timeout 165 python scripts/ab_module.py flashtile/kernels/v3_gluon.py --rev b78f857 --rev-file scratch/main_v3_gluon.py \
  --at flashtile.kernels.v3 --check --out $R/right_edge.json \
  --cells "64 1024 causal fwd; 64 2048 causal fwd; 64 4096 causal fwd; 128 1024 causal fwd; 128 4096 causal fwd; 256 1024 causal fwd; 256 4096 causal fwd; 128 2048 plain fwd" \
  > $R/right_edge.md 2> $R/right_edge.err; grep -v "^Case" $R/right_edge.md; grep -c "bitwise equal: True" $R/right_edge.err; tail -1 $R/right_edge.err; save
timeout 200 python scripts/ab_module.py flashtile/kernels/v3_gluon_bwd.py --rev b78f857 --rev-file scratch/main_v3_gluon_bwd.py \
  --at flashtile.kernels.v3 --check --out $R/bwd_row_bounds.json \
  --cells "64 2048 plain bwd; 64 4096 causal bwd; 128 1024 causal bwd; 128 2048 causal bwd; 128 4096 causal bwd; 256 4096 causal bwd; 256 8192 causal bwd" \
  > $R/bwd_row_bounds.md 2> $R/bwd_row_bounds.err; grep -v "^Case" $R/bwd_row_bounds.md; grep -c "bitwise equal: True" $R/bwd_row_bounds.err; tail -1 $R/bwd_row_bounds.err; save
# Session run 2: v3 bars d128, d64 and d256 at a2e4a41; memcheck, Gluon backward with TMA reduce-add.
set -u
export PYTHONPATH=$PWD FLASHTILE_COMMIT=a2e4a41 PYTHONUNBUFFERED=1
R=$(mktemp -d)
save() { tar czf $OUT/results.tgz -C $R .; }
for d in 128 64 256; do
  timeout 150 python -m flashtile bench --head-dims $d --seqlens 1024,2048,4096,8192,16384 --repeats 2 \
    --providers flashtile-v3,flashtile-v2,sdpa-cudnn --baseline sdpa-cudnn --no-plots --out $R --name bars_a2e4a41_d$d \
    > $R/bars_d$d.log 2>&1; grep "^| [0-9]" $R/bars_d$d.log | head -30; save
done
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
FLASHTILE_V3_DQ=pass FLASHTILE_V3_FWD=gluon FLASHTILE_V3_BWD=gluon-reduce PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
  timeout 110 "$sanitizer" --tool memcheck --error-exitcode 1 python scripts/sanitize_cases.py --versions v3 \
  > $R/sanitize_reduce.log 2>&1; echo "memcheck reduce rc=$?"; tail -3 $R/sanitize_reduce.log; save
# Session run 3: d64 forward, two consumers against three (THREE_CONSUMERS_FROM); memcheck, Gluon forward and two-pass backward.
export PYTHONPATH=$PWD FLASHTILE_COMMIT=a2e4a41 PYTHONUNBUFFERED=1; R=$OUT; timeout 190 python scripts/ab_env.py --out $R/d64_consumers.json --cells "64 1024 plain fwd; 64 2048 plain fwd; 64 4096 plain fwd; 64 8192 plain fwd; 64 2048 causal fwd; 64 4096 causal fwd; 64 8192 causal fwd" --variant default: --variant again: --variant "two:FLASHTILE_CONFIG_V3_GLUON=128,3,2" --variant "three:FLASHTILE_CONFIG_V3_GLUON=128,3,3" > $R/d64_consumers.md 2> $R/d64_consumers.err
s=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer | head -1)
FLASHTILE_V3_DQ=pass FLASHTILE_V3_FWD=gluon FLASHTILE_V3_BWD=gluon PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 170 $s --tool memcheck --error-exitcode 1 python scripts/sanitize_cases.py --versions v3 > $R/sanitize_gluon.log 2>&1
# Session run 4: d64 bars and the v3 accuracy tests at 1681f37.
set -u
export PYTHONPATH=$PWD FLASHTILE_COMMIT=1681f37 PYTHONUNBUFFERED=1
timeout 140 python -m flashtile bench --head-dims 64 --seqlens 1024,2048,4096,8192,16384 --repeats 2 \
  --providers flashtile-v3,flashtile-v2,sdpa-cudnn --baseline sdpa-cudnn --no-plots --out $OUT --name bars_1681f37_d64 \
  > $OUT/bars_d64.log 2>&1; grep "^| [0-9]" $OUT/bars_d64.log | head -30
timeout 75 python -m pytest tests/test_accuracy.py -q -n 8 -p no:cacheprovider -k "v3" > $OUT/gpu_tests_1681f37.log 2>&1; tail -2 $OUT/gpu_tests_1681f37.log
