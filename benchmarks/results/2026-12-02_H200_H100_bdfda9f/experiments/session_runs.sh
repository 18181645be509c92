#!/usr/bin/env bash
# The device commands of this run, as they ran (scratch/commit held bdfda9f; scratch/main_v3_gluon.py: bdfda9f's file).
# ---- session run 1 (scratch/run1.sh)
# Session run 1: exp2 by polynomial (tiles.exp2_shared_with_fma): its unit test, the v3 accuracy
# tests with one exponential in four by polynomial, and the same-run A/B of the pack sizes.
set -u
export PYTHONPATH=$PWD FLASHTILE_COMMIT=$(cat scratch/commit) PYTHONUNBUFFERED=1
R=$OUT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee $R/gpu.txt
FLASHTILE_V3_EXP2_POLY=4 timeout 120 python -m pytest tests/test_exp2.py tests/test_accuracy.py -q -n 8 -p no:cacheprovider -k "exp2 or v3" > $R/tests_poly4.log 2>&1; tail -3 $R/tests_poly4.log
timeout 330 python scripts/ab_env.py --out $R/exp2_poly.json \
  --cells "64 1024 causal fwd; 64 2048 causal fwd; 64 4096 causal fwd; 64 8192 causal fwd; 64 1024 plain fwd; 64 2048 plain fwd; 64 8192 plain fwd; 128 1024 causal fwd; 128 4096 plain fwd" \
  --variant mufu:FLASHTILE_V3_EXP2_POLY=0 --variant again:FLASHTILE_V3_EXP2_POLY=0 \
  --variant p16:FLASHTILE_V3_EXP2_POLY=16 --variant p8:FLASHTILE_V3_EXP2_POLY=8 --variant p4:FLASHTILE_V3_EXP2_POLY=4 \
  > $R/exp2_poly.md 2> $R/exp2_poly.err; grep -v "^Case" $R/exp2_poly.md; tail -2 $R/exp2_poly.err
# ---- session run 2 (scratch/run2.sh)
# Session run 2: the Gluon forward stores a tile's O under the next tile's first S = Q K^T
# (DEFER_STORE): v3 accuracy tests, then same-run A/B against FLASHTILE_V3_ABLATE=defer_store.
set -u
export PYTHONPATH=$PWD FLASHTILE_COMMIT=$(cat scratch/commit) PYTHONUNBUFFERED=1
R=$OUT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee $R/gpu.txt
timeout 120 python -m pytest tests/test_accuracy.py -q -n 8 -p no:cacheprovider -k "v3" > $R/tests_defer.log 2>&1; tail -3 $R/tests_defer.log
timeout 330 python scripts/ab_env.py --out $R/defer_store.json --check \
  --cells "64 1024 causal fwd; 64 2048 causal fwd; 64 4096 causal fwd; 64 1024 plain fwd; 128 1024 causal fwd; 128 2048 causal fwd; 128 1024 plain fwd; 256 1024 causal fwd; 256 2048 causal fwd; 256 1024 plain fwd; 128 16384 plain fwd" \
  --variant defer: --variant again: --variant store:FLASHTILE_V3_ABLATE=defer_store \
  > $R/defer_store.md 2> $R/defer_store.err; grep -v "^Case" $R/defer_store.md; grep -c "bitwise equal: True" $R/defer_store.err; tail -2 $R/defer_store.err
# ---- session run 3 (scratch/run3.sh)
# Session run 3: the Gluon forward's row max and row sum reduced as shallow trees (_row_max,
# _row_sum): v3 accuracy tests, then the same-run A/B against bdfda9f's v3_gluon.py.
set -u
export PYTHONPATH=$PWD FLASHTILE_COMMIT=$(cat scratch/commit)+tree PYTHONUNBUFFERED=1
R=$OUT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee $R/gpu.txt
timeout 120 python -m pytest tests/test_accuracy.py -q -n 8 -p no:cacheprovider -k "v3" > $R/tests_tree.log 2>&1; tail -3 $R/tests_tree.log
timeout 380 python scripts/ab_module.py flashtile/kernels/v3_gluon.py --rev bdfda9f --rev-file scratch/main_v3_gluon.py \
  --at flashtile.kernels.v3 --check --out $R/row_trees.json \
  --cells "64 1024 causal fwd; 64 2048 causal fwd; 64 4096 causal fwd; 64 1024 plain fwd; 64 8192 plain fwd; 128 1024 causal fwd; 128 2048 causal fwd; 128 1024 plain fwd; 128 16384 plain fwd; 256 1024 causal fwd; 256 4096 plain fwd" \
  > $R/row_trees.md 2> $R/row_trees.err; grep -v "^Case" $R/row_trees.md; grep -c "bitwise equal: True" $R/row_trees.err; tail -1 $R/row_trees.err
# ---- session run 4 (H100, warm after run 3): the row trees again, five rounds
export PYTHONPATH=$PWD FLASHTILE_COMMIT=$(cat scratch/commit)+tree PYTHONUNBUFFERED=1; nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw --format=csv,noheader; timeout 400 python scripts/ab_module.py flashtile/kernels/v3_gluon.py --rev bdfda9f --rev-file scratch/main_v3_gluon.py --at flashtile.kernels.v3 --rounds 5 --out $OUT/row_trees_run2.json --cells "64 1024 causal fwd; 64 2048 causal fwd; 64 4096 causal fwd; 64 2048 plain fwd; 64 8192 plain fwd; 128 4096 causal fwd; 128 4096 plain fwd; 128 16384 plain fwd" > $OUT/row_trees_run2.md 2> $OUT/row_trees_run2.err
# ---- session run 5 (scratch/run4.sh at the time: Nsight Compute)
# Session run 4: Nsight Compute source-level stall sampling of the Gluon forward (bdfda9f):
# d64 causal 4k and d128 16k, the SASS with the samples per instruction.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader
ncu --version | tail -1
for c in "64 4096 causal" "128 16384 plain"; do
  set -- $c
  name=ncu_fwd_d$1_s$2_$3
  timeout 150 ncu --clock-control none --profile-from-start off --target-processes all \
    --section SourceCounters --section WarpStateStats --section SpeedOfLight --import-source no \
    -o $OUT/$name python scripts/profile_case.py --head-dim $1 --seqlen $2 --mode fwd $([ $3 = causal ] && echo --causal) \
    > $OUT/$name.log 2>&1; echo "$name rc=$?"; tail -2 $OUT/$name.log
  timeout 60 ncu --import $OUT/$name.ncu-rep --page source --csv --print-source sass > $OUT/${name}_sass.csv 2> $OUT/${name}_sass.err
  echo "$(wc -l < $OUT/${name}_sass.csv) lines"; head -c 600 $OUT/${name}_sass.csv; echo; tail -2 $OUT/${name}_sass.err
  timeout 60 ncu --import $OUT/$name.ncu-rep --page details --csv > $OUT/${name}_details.csv 2>&1
done
# ---- session run 6: the d64 report's SASS page again (its CSV had not come back)
ncu --import scratch/ncu_fwd_d64_s4096_causal.ncu-rep --page source --csv --print-source sass > $OUT/d64_sass.csv
# ---- session run 7 (scratch/run5.sh)
# Session run 5: the Gluon forward's row trees (FLASHTILE_ROW_TREE=1, an experiment switch)
# against the shipped row reductions (=0: SASS equal to bdfda9f's), two of each and cuDNN,
# 5 rounds of bench.compare's rotated order (each variant once in every place).
set -u
export PYTHONPATH=$PWD FLASHTILE_COMMIT=bdfda9f+row_tree PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader
timeout 480 python scripts/ab_env.py --rounds 5 --out $OUT/row_trees_env.json \
  --cells "64 1024 causal fwd; 64 2048 causal fwd; 64 4096 causal fwd; 64 1024 plain fwd; 64 8192 plain fwd; 128 1024 causal fwd; 128 4096 causal fwd; 128 16384 plain fwd" \
  --variant main:FLASHTILE_ROW_TREE=0 --variant tree:FLASHTILE_ROW_TREE=1 --variant main2:FLASHTILE_ROW_TREE=0 --variant tree2:FLASHTILE_ROW_TREE=1 \
  > $OUT/row_trees_env.md 2> $OUT/row_trees_env.err; grep -v "^Case" $OUT/row_trees_env.md; tail -1 $OUT/row_trees_env.err
# ---- session run 8 (H100, 783c6ad: kernels as bdfda9f's): d64 K/V ring depth on short bands
# Session run 8: d64 forward on short bands, K/V ring depth 2 and 4 against the default 3.
set -u
export PYTHONPATH=$PWD FLASHTILE_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo 4b5f1d7) PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader
timeout 300 python scripts/ab_env.py --rounds 5 --out $OUT/d64_stages.json \
  --cells "64 1024 causal fwd; 64 2048 causal fwd; 64 4096 causal fwd; 64 1024 plain fwd" \
  --variant default: --variant again: --variant "s2:FLASHTILE_CONFIG_V3_GLUON=128,2" --variant "s4:FLASHTILE_CONFIG_V3_GLUON=128,4" \
  > $OUT/d64_stages.md 2> $OUT/d64_stages.err; grep -v "^Case" $OUT/d64_stages.md; tail -2 $OUT/d64_stages.err
