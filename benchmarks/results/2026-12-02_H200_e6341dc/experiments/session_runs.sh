#!/usr/bin/env bash
# Session run 1: GPU suite, bars by head dim (v3, v2, cuDNN; median of 2) at e6341dc.
set -u
export PYTHONPATH=$PWD FLASHTILE_COMMIT=e6341dc PYTHONUNBUFFERED=1
R=$(mktemp -d)
save() { tar czf $OUT/results.tgz -C $R .; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee $R/gpu.txt
timeout 170 python -m pytest tests -q -n 8 -p no:cacheprovider --ignore=tests/test_sm90_compile.py > $R/gpu_tests.log 2>&1; tail -4 $R/gpu_tests.log; save
for d in 64 128 256; do
  timeout 125 python -m flashtile bench --head-dims $d --seqlens 1024,2048,4096,8192,16384 --repeats 2 \
    --providers flashtile-v3,flashtile-v2,sdpa-cudnn --baseline sdpa-cudnn --no-plots --out $R --name bars_e6341dc_d$d \
    > $R/bars_d$d.log 2>&1; grep "^| [0-9]" $R/bars_d$d.log | head -30; save
done
#!/usr/bin/env bash
# Session run 2: GPU suite on the tree; forward with Q released after the last S (tree vs e6341dc);
# backward's single pass and d256 persistent with one slot (tree vs e6341dc).
set -u
export PYTHONPATH=$PWD FLASHTILE_COMMIT=e6341dc+tree PYTHONUNBUFFERED=1
R=$(mktemp -d)
save() { tar czf $OUT/results.tgz -C $R .; }
timeout 150 python -m pytest tests -q -n 8 -p no:cacheprovider --ignore=tests/test_sm90_compile.py > $R/gpu_tests.log 2>&1; tail -3 $R/gpu_tests.log; save
timeout 170 python scripts/ab_module.py flashtile/kernels/v3_gluon.py --rev e6341dc --rev-file scratch/main_v3_gluon.py \
  --at flashtile.kernels.v3 --check --out $R/q_release.json \
  --cells "256 1024 plain fwd; 256 2048 plain fwd; 256 16384 plain fwd; 256 1024 causal fwd; 256 2048 causal fwd; 256 8192 causal fwd; 64 4096 plain fwd; 128 1024 causal fwd" \
  > $R/q_release.md 2> $R/q_release.err; grep -v "^Case" $R/q_release.md; tail -2 $R/q_release.err; save
timeout 200 python scripts/ab_module.py flashtile/kernels/v3_gluon_bwd.py --rev e6341dc --rev-file scratch/main_v3_gluon_bwd.py \
  --at flashtile.kernels.v3 --out $R/bwd_persistent.json \
  --cells "64 2048 plain bwd; 64 8192 plain bwd; 64 4096 causal bwd; 128 2048 plain bwd; 128 8192 plain bwd; 128 4096 causal bwd; 256 1024 plain bwd; 256 4096 causal bwd; 256 8192 causal bwd" \
  > $R/bwd_persistent.md 2> $R/bwd_persistent.err; grep -v "^Case" $R/bwd_persistent.md; tail -2 $R/bwd_persistent.err; save
#!/usr/bin/env bash
# Session run 3: GPU suite on the tree (Q parts as a ring of their own); forward tree vs e6341dc; memcheck.
set -u
export PYTHONPATH=$PWD FLASHTILE_COMMIT=e6341dc+tree PYTHONUNBUFFERED=1
R=$(mktemp -d)
save() { tar czf $OUT/results.tgz -C $R .; }
timeout 150 python -m pytest tests -q -n 8 -p no:cacheprovider --ignore=tests/test_sm90_compile.py > $R/gpu_tests.log 2>&1; tail -3 $R/gpu_tests.log; save
timeout 175 python scripts/ab_module.py flashtile/kernels/v3_gluon.py --rev e6341dc --rev-file scratch/main_v3_gluon.py \
  --at flashtile.kernels.v3 --check --out $R/q_ring.json \
  --cells "256 1024 plain fwd; 256 2048 plain fwd; 256 8192 plain fwd; 256 1024 causal fwd; 256 4096 causal fwd; 256 16384 causal fwd; 64 1024 causal fwd; 64 4096 plain fwd; 128 1024 plain fwd; 128 2048 causal fwd" \
  > $R/q_ring.md 2> $R/q_ring.err; grep -v "^Case" $R/q_ring.md; grep -c "equal: True" $R/q_ring.md; tail -2 $R/q_ring.err; save
OUT=$R timeout 220 bash scripts/gpu_check.sh sanitize > $R/sanitize_run.log 2>&1; tail -6 $R/sanitize_run.log; save
#!/usr/bin/env bash
# Session run 4: v3's ablation table (d128 8k) at 6ad05d3.
set -u
export PYTHONPATH=$PWD FLASHTILE_COMMIT=6ad05d3 PYTHONUNBUFFERED=1
R=$(mktemp -d)
timeout 225 python scripts/ablation_v3.py --out $R/ablation_v3.json > $R/ablation_v3.md 2> $R/ablation_v3.err; cat $R/ablation_v3.md; tail -2 $R/ablation_v3.err
tar czf $OUT/results.tgz -C $R .
