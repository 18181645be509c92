# The device commands of the experiments (scratch/v3_gluon_aa16618.py: git show aa16618:flashtile/kernels/v3_gluon.py)
# run 1 (three_consumers_run1, tests_three_consumers_forced with TESTS=1):
# usage: bash scratch/run1.sh  (FLASHTILE_COMMIT set by the caller)
R=$(mktemp -d); save() { tar czf $OUT/results.tgz -C $R .; }
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader > $R/gpu.txt
[ -n "$TESTS" ] && { FLASHTILE_CONFIG_V3_GLUON=128,3,3 timeout 200 python -m pytest tests/test_accuracy.py -q -n 8 -p no:cacheprovider -k "v3" > $R/tests_three.log 2>&1; tail -3 $R/tests_three.log; save; }
G=FLASHTILE_CONFIG_V3_GLUON
timeout 150 python scripts/ab_module.py flashtile/kernels/v3_gluon.py --rev aa16618 --at flashtile.kernels.v3 --check \
  --cells "256 1024 plain fwd; 256 4096 plain fwd; 256 16384 plain fwd; 256 1024 causal fwd; 256 4096 causal fwd; 128 1024 plain fwd; 128 1024 causal fwd; 64 1024 plain fwd" \
  --out $R/ab_early_q.json > $R/ab_early_q.md 2> $R/ab_early_q.err; cat $R/ab_early_q.md; tail -3 $R/ab_early_q.err; save
C="64 1024 plain fwd; 64 4096 plain fwd; 64 16384 plain fwd; 64 1024 causal fwd; 64 4096 causal fwd; 64 16384 causal fwd"
timeout 220 python scripts/ab_env.py --cells "$C" --variant two: --variant two_again: --variant "three:$G=128,3,3" \
  --variant "three_s2:$G=128,2,3" --variant "three_s4:$G=128,4,3" --variant "three_nopp:$G=128,3,3 FLASHTILE_V3_ABLATE=pingpong" \
  --check --out $R/ab_three.json > $R/ab_three.md 2> $R/ab_three.err; cat $R/ab_three.md; tail -8 $R/ab_three.err; save
# run 2 (early_q_release, three_consumers_run2):
R=$(mktemp -d); save() { tar czf $OUT/results.tgz -C $R .; }
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
G=FLASHTILE_CONFIG_V3_GLUON
timeout 200 python scripts/ab_module.py flashtile/kernels/v3_gluon.py --rev aa16618 --rev-file scratch/v3_gluon_aa16618.py --at flashtile.kernels.v3 --check \
  --cells "256 1024 plain fwd; 256 4096 plain fwd; 256 16384 plain fwd; 256 1024 causal fwd; 256 4096 causal fwd; 128 1024 plain fwd; 128 1024 causal fwd; 64 1024 plain fwd" \
  --out $R/ab_early_q.json > $R/ab_early_q.md 2> $R/ab_early_q.err; cat $R/ab_early_q.md; tail -3 $R/ab_early_q.err; save
C="64 2048 plain fwd; 64 8192 plain fwd; 64 2048 causal fwd; 64 8192 causal fwd; 64 16384 causal fwd"
timeout 200 python scripts/ab_env.py --cells "$C" --variant two: --variant "three:$G=128,3,3" --variant two_again: \
  --out $R/ab_three2.json > $R/ab_three2.md 2> $R/ab_three2.err; cat $R/ab_three2.md; tail -3 $R/ab_three2.err; save
# run 3 (d256_techniques, d64_causal_three), tree c46b5ae-10fff46:
R=$(mktemp -d); save() { tar czf $OUT/results.tgz -C $R .; }
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
G=FLASHTILE_CONFIG_V3_GLUON
timeout 150 python scripts/ab_env.py --cells "256 1024 plain fwd; 256 4096 plain fwd; 256 16384 plain fwd; 256 4096 causal fwd" \
  --variant shipped: --variant shipped_again: --variant "no_pingpong:FLASHTILE_V3_ABLATE=pingpong" --variant "no_overlap:FLASHTILE_V3_ABLATE=overlap" \
  --out $R/d256_techniques.json > $R/d256_techniques.md 2> $R/d256_techniques.err; cat $R/d256_techniques.md; tail -2 $R/d256_techniques.err; save
timeout 120 python scripts/ab_env.py --cells "64 2048 causal fwd; 64 4096 causal fwd; 64 8192 causal fwd" \
  --variant shipped: --variant "three_n64:$G=64,4,3" --variant "three:$G=128,3,3" --variant shipped_again: \
  --out $R/d64_causal_three.json > $R/d64_causal_three.md 2> $R/d64_causal_three.err; cat $R/d64_causal_three.md; tail -2 $R/d64_causal_three.err; save
