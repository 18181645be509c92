#!/usr/bin/env bash
# Session run 1: GPU suite at 51cc382; d256 O staging (tree) vs 63034a4's v3_gluon.py (rev); d256 bars.
set -u
export PYTHONPATH=$PWD FLASHTILE_COMMIT=51cc382 PYTHONUNBUFFERED=1
R=$(mktemp -d)
save() { tar czf $OUT/results.tgz -C $R .; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee $R/gpu.txt
timeout 160 python -m pytest tests -q -n 8 -p no:cacheprovider --ignore=tests/test_sm90_compile.py > $R/gpu_tests.log 2>&1; tail -4 $R/gpu_tests.log; save
timeout 190 python scripts/ab_module.py flashtile/kernels/v3_gluon.py --rev 63034a4 --rev-file scratch/main_v3_gluon.py \
  --at flashtile.kernels.v3 --check --out $R/o_staging.json \
  --cells "256 1024 plain fwd; 256 2048 plain fwd; 256 16384 plain fwd; 256 1024 causal fwd; 256 4096 causal fwd; 256 16384 causal fwd; 128 2048 plain fwd" \
  > $R/o_staging.md 2> $R/o_staging.err; grep -v "^Case" $R/o_staging.md; grep "bitwise" $R/o_staging.err; tail -3 $R/o_staging.err; save
timeout 130 python -m flashtile bench --head-dims 256 --seqlens 1024,2048,4096,8192,16384 --repeats 2 \
  --providers flashtile-v3,flashtile-v2,sdpa-cudnn --baseline sdpa-cudnn --no-plots --out $R --name bars_51cc382_d256 \
  > $R/bars_d256.log 2>&1; grep "^| [0-9]" $R/bars_d256.log | head -30; save
#!/usr/bin/env bash
# Session run 2: memcheck at 071902b; short causal forwards: settings
# A/B (K/V block 64, persistent off, ping-pong off); ncu of d64 causal 1k, v3 and cuDNN.
set -u
export PYTHONPATH=$PWD FLASHTILE_COMMIT=071902b PYTHONUNBUFFERED=1
R=$(mktemp -d)
save() { tar czf $OUT/results.tgz -C $R .; }
OUT=$R timeout 200 bash scripts/gpu_check.sh sanitize > $R/sanitize_run.log 2>&1; tail -5 $R/sanitize_run.log; save
timeout 170 python scripts/ab_env.py --out $R/short_causal.json \
  --cells "64 1024 causal fwd; 64 2048 causal fwd; 64 4096 causal fwd; 128 1024 causal fwd" \
  --variant default: --variant again: --variant "n64:FLASHTILE_CONFIG_V3_GLUON=64,4" \
  --variant "static:FLASHTILE_V3_ABLATE=persistent" --variant "nopingpong:FLASHTILE_V3_ABLATE=pingpong" \
  > $R/short_causal.md 2> $R/short_causal.err; grep -v "^Case" $R/short_causal.md; tail -2 $R/short_causal.err; save
for prov in flashtile-v3 sdpa-cudnn; do
  timeout 100 ncu --clock-control none --profile-from-start off --target-processes all \
    --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis --section LaunchStats \
    --csv --page details python scripts/profile_case.py --head-dim 64 --seqlen 1024 --mode fwd --causal \
    --provider $prov > $R/ncu_d64_causal_1k_$prov.csv 2> $R/ncu_$prov.log; echo "$prov $(wc -l < $R/ncu_d64_causal_1k_$prov.csv)"; save
done
#!/usr/bin/env bash
# Session run 3: GPU suite at 38ed6d3; per-thread arrivals (tree) vs 071902b's v3_gluon.py (rev).
set -u
export PYTHONPATH=$PWD FLASHTILE_COMMIT=38ed6d3 PYTHONUNBUFFERED=1
R=$(mktemp -d)
save() { tar czf $OUT/results.tgz -C $R .; }
timeout 160 python -m pytest tests -q -n 8 -p no:cacheprovider --ignore=tests/test_sm90_compile.py > $R/gpu_tests.log 2>&1; tail -3 $R/gpu_tests.log; save
timeout 260 python scripts/ab_module.py flashtile/kernels/v3_gluon.py --rev 071902b --rev-file scratch/main_v3_gluon.py \
  --at flashtile.kernels.v3 --check --out $R/thread_arrivals.json \
  --cells "64 1024 causal fwd; 64 2048 causal fwd; 64 4096 causal fwd; 64 1024 plain fwd; 64 8192 plain fwd; 128 1024 causal fwd; 128 4096 causal fwd; 128 2048 plain fwd; 128 16384 plain fwd; 256 2048 plain fwd; 256 4096 causal fwd" \
  > $R/thread_arrivals.md 2> $R/thread_arrivals.err; grep -v "^Case" $R/thread_arrivals.md; grep -c "bitwise equal: True" $R/thread_arrivals.err; tail -2 $R/thread_arrivals.err; save
#!/usr/bin/env bash
# Session run 5: GPU suite at 9f32b09; cheaper band masks (tree) vs 1ac4b28's v3_gluon.py (rev); d64 bars at 9f32b09.
set -u
export PYTHONPATH=$PWD FLASHTILE_COMMIT=9f32b09 PYTHONUNBUFFERED=1
R=$(mktemp -d)
save() { tar czf $OUT/results.tgz -C $R .; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee $R/gpu.txt
timeout 165 python -m pytest tests -q -n 8 -p no:cacheprovider --ignore=tests/test_sm90_compile.py > $R/gpu_tests.log 2>&1; tail -3 $R/gpu_tests.log; save
timeout 150 python scripts/ab_module.py flashtile/kernels/v3_gluon.py --rev 1ac4b28 --rev-file scratch/main_v3_gluon.py \
  --at flashtile.kernels.v3 --check --out $R/edge_masks.json \
  --cells "64 1024 causal fwd; 64 2048 causal fwd; 64 4096 causal fwd; 128 1024 causal fwd; 128 4096 causal fwd; 256 1024 causal fwd; 256 4096 causal fwd; 128 2048 plain fwd" \
  > $R/edge_masks.md 2> $R/edge_masks.err; grep -v "^Case" $R/edge_masks.md; grep -c "bitwise equal: True" $R/edge_masks.err; tail -1 $R/edge_masks.err; save
timeout 140 python -m flashtile bench --head-dims 64 --seqlens 1024,2048,4096,8192,16384 --repeats 2 \
  --providers flashtile-v3,flashtile-v2,sdpa-cudnn --baseline sdpa-cudnn --no-plots --out $R --name bars_9f32b09_d64 \
  > $R/bars_d64.log 2>&1; grep "^| [0-9]" $R/bars_d64.log | head -30; save
