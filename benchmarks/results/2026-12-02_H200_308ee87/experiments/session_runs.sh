#!/usr/bin/env bash
# Session run 1: the two branches' GPU tests, the forward overlap A/B, the d64 backward tiles A/B.
set -u
export PYTHONPATH=$PWD FLASHTILE_COMMIT=6a4b1eb PYTHONUNBUFFERED=1
R=$(mktemp -d)
save() { tar czf $OUT/results.tgz -C $R .; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee $R/gpu.txt
timeout 170 python -m pytest tests/test_accuracy.py -q -n 8 -p no:cacheprovider \
  -k "shared_scores or gluon_backward or three_consumers or v3" > $R/tests.log 2>&1; tail -4 $R/tests.log; save
timeout 200 python scripts/ab_module.py flashtile/kernels/v3_gluon.py --rev main --rev-file scratch/main_v3_gluon.py \
  --at flashtile.kernels.v3 --check --out $R/fwd_overlap.json \
  --cells "64 4096 plain fwd; 64 16384 plain fwd; 64 1024 causal fwd; 128 1024 plain fwd; 128 16384 plain fwd; 128 2048 causal fwd; 256 1024 plain fwd; 256 16384 plain fwd; 256 4096 causal fwd" \
  > $R/fwd_overlap.md 2>&1; grep -v "^bench" $R/fwd_overlap.md | tail -22; save
timeout 200 python scripts/ab_env.py --out $R/d64_bwd.json \
  --cells "64 1024 plain bwd; 64 2048 plain bwd; 64 4096 plain bwd; 64 16384 plain bwd; 64 2048 causal bwd; 64 8192 causal bwd" \
  --variant default: --variant "reduce:FLASHTILE_V3_BWD=gluon-reduce" \
  --variant "fa3:FLASHTILE_V3_BWD=gluon-reduce FLASHTILE_CONFIG_V3_GLUON_BWD=128,128,2" --variant again: \
  > $R/d64_bwd.md 2>&1; grep -v "^bench" $R/d64_bwd.md | tail -16; save
#!/usr/bin/env bash
# Session run 2: GPU suite, bars by head dim (v3, v2, cuDNN; median of 2).
set -u
export PYTHONPATH=$PWD FLASHTILE_COMMIT=308ee87 PYTHONUNBUFFERED=1
R=$(mktemp -d)
save() { tar czf $OUT/results.tgz -C $R .; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee $R/gpu.txt
timeout 160 python -m pytest tests -q -n 8 -p no:cacheprovider --ignore=tests/test_sm90_compile.py > $R/gpu_tests.log 2>&1; tail -4 $R/gpu_tests.log; save
for d in 64 128 256; do
  timeout 125 python -m flashtile bench --head-dims $d --seqlens 1024,2048,4096,8192,16384 --repeats 2 \
    --providers flashtile-v3,flashtile-v2,sdpa-cudnn --baseline sdpa-cudnn --no-plots --out $R --name bars_308ee87_d$d \
    > $R/bars_d$d.log 2>&1; grep "^| [0-9]" $R/bars_d$d.log | head -30; save
done
#!/usr/bin/env bash
# Session run 3: d256 forward with 128-column K/V blocks and one slot; short causal forwards with 64-column blocks.
set -u
export PYTHONPATH=$PWD FLASHTILE_COMMIT=308ee87 PYTHONUNBUFFERED=1
R=$(mktemp -d)
save() { tar czf $OUT/results.tgz -C $R .; }
G=FLASHTILE_CONFIG_V3_GLUON
timeout 130 python scripts/ab_env.py --out $R/d256_n128.json \
  --cells "256 1024 plain fwd; 256 4096 plain fwd; 256 16384 plain fwd; 256 4096 causal fwd" \
  --variant shipped: --variant "n128s1:$G=128,1" --variant again: \
  > $R/d256_n128.md 2> $R/d256_n128.err; cat $R/d256_n128.md; tail -2 $R/d256_n128.err; save
timeout 130 python scripts/ab_env.py --out $R/short_causal_n64.json \
  --cells "64 1024 causal fwd; 64 2048 causal fwd; 64 4096 causal fwd; 128 1024 causal fwd" \
  --variant shipped: --variant "n64s4:$G=64,4" --variant "n64s3:$G=64,3" --variant again: \
  > $R/short_causal_n64.md 2> $R/short_causal_n64.err; cat $R/short_causal_n64.md; tail -2 $R/short_causal_n64.err; save
#!/usr/bin/env bash
# Session run 4: the single pass against the two passes where the two run by default (1k).
set -u
export PYTHONPATH=$PWD FLASHTILE_COMMIT=f45288d PYTHONUNBUFFERED=1
R=$(mktemp -d)
save() { tar czf $OUT/results.tgz -C $R .; }
timeout 150 python scripts/ab_env.py --out $R/bwd_1k.json \
  --cells "64 1024 plain bwd; 64 1024 causal bwd; 128 1024 plain bwd; 128 1024 causal bwd; 128 2048 causal bwd" \
  --variant shipped: --variant "single:FLASHTILE_V3_BWD=gluon-reduce" --variant again: \
  > $R/bwd_1k.md 2> $R/bwd_1k.err; cat $R/bwd_1k.md; tail -2 $R/bwd_1k.err; save
#!/usr/bin/env bash
# Session run 5: the forward with Q in registers for S = Q K^T (tree) against main's v3_gluon.py.
set -u
export PYTHONPATH=$PWD FLASHTILE_COMMIT=b4e685c PYTHONUNBUFFERED=1
R=$(mktemp -d)
save() { tar czf $OUT/results.tgz -C $R .; }
timeout 110 python -m pytest tests/test_accuracy.py -q -n 8 -p no:cacheprovider -k "v3 and not backward and not grad" > $R/tests_q_regs.log 2>&1; tail -3 $R/tests_q_regs.log; save
timeout 170 python scripts/ab_module.py flashtile/kernels/v3_gluon.py --rev main --rev-file scratch/main_v3_gluon.py \
  --at flashtile.kernels.v3 --check --out $R/q_regs.json \
  --cells "64 1024 plain fwd; 64 4096 plain fwd; 64 16384 plain fwd; 64 1024 causal fwd; 64 4096 causal fwd; 128 1024 plain fwd; 128 4096 plain fwd; 128 16384 plain fwd; 128 1024 causal fwd; 128 4096 causal fwd" \
  > $R/q_regs.md 2> $R/q_regs.err; grep -v "^Case" $R/q_regs.md; grep -c "equal: True" $R/q_regs.md; tail -2 $R/q_regs.err; save
