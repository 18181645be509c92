#!/usr/bin/env bash
# On the GPU machine, in one call, any of these stages; everything lands under $OUT.
#   tests   the test suite on CUDA (bf16 and fp16, seqlen up to 4k)
#   bars    flashtile v2/v3 against SDPA flash and cuDNN, d64/d128, 1k-16k, 3 passes (bars.*)
#   v3bars  v3's bars: v3, v2 and cuDNN, d64/d128/d256, causal and not, 1k-16k, BARS_REPEATS
#           passes (2), one run per head dim (bars_v3_d*.*, kept if a later one is cut short),
#           then one table (bars_v3.md: scripts/bars_table.py; BARS_PREVIOUS: an earlier run's JSON, a glob)
#   claims  FlashAttention-1 vs -2 vs standard attention: speed (fa1_fa2_standard.*), the IO
#           model's regime of each run (io_regimes.*), exactness, memory up to 128k
#   bench   the default `flashtile bench` grid (BENCH_ARGS narrows or widens it), timed
#   sweep   tile candidates (SWEEP_ARGS: scripts/sweep_configs.py options)
#   memory  peak memory alone
#   sanitize  compute-sanitizer memcheck over one small case of every kernel (sanitize.log)
#   ablation  v3's techniques switched off one at a time, d128 8k (ablation_v3.*)
#   ab      the working tree's v3 against a revision's (AB_REV, extracted into .ab by
#           scripts/ab_revision.py: carry .ab) over the bars grid, with a null pair and cuDNN (ab.*)
#   features v3 with each score feature (softcap 30, ALiBi, sinks, dropout 0.1) against v3 without, d128 8k,
#           forward and backward: a run per feature (features_*.json), joined by
#           scripts/features_table.py (features.json, features.md); FEATURES: a ','-separated subset
#   dropout  issue 30's dropout bars: v3 and v2 with p = 0.1, and v3 without, d64/d128 8k, forward and
#           backward, 2 passes (dropout.*, nodropout.*; DROPOUT_ARGS, e.g. --kernel-options backward=v2)
#   headdimv  V with a head dim of its own, MLA prefill's 192 / 128 (16 heads, 16k tokens, 8k): v3, v2
#           and SDPA's backends that take the pair (headdimv.*)
#   fp8     FP8 forwards and backwards beside bf16 in one run: flashtile-v3 on bf16 and e4m3 inputs
#           (the backward: fp8_attn_func's FP8 backward), d64/d128/d256, causal and not, 4k-16k,
#           2 passes (fp8.*); FlashAttention-3's accuracy protocol, RMSE against float64
#           (fp8_accuracy.json, .md: scripts/fp8_accuracy.py)
#   train   scripts/train_llama.py: "sdpa", "flashtile" and (TRAIN_ARGS, e.g. --fp8) more, loss curves,
#           throughput, generation (training.*)
#   host    host time per call, flashtile against SDPA (scripts/host_time.py): HOST_ROUNDS processes (2),
#           alternating with HOST_TREE's flashtile where set (another checkout's root), one table (host_time.md)
#   decode  decoding over a KV cache: TB/s of K/V read by flashtile (contiguous, paged 16) and
#           SDPA's backends, batch 1-64 x cache 4k-128k, 32/8 heads, d128 (decode.*; DECODE_ARGS, e.g.
#           --kernel-options "tiles.decode_paged=128,4,4" for a tile candidate, --num-splits 16 for a
#           split count)
#   gluon   v3's Gluon forward: its tile sweep at 1k and 16k
#           (sweep_gluon_*.jsonl)
#   profile Nsight Compute over v3's kernels on a few bars cells (PROFILE_CASES: "head_dim seqlen
#           causal|plain fwd|bwd [dtype]" entries, ';'-separated): speed of light, memory, warp stalls
#           (ncu_*.csv), the SASS with its stall samples and their summary (ncu_*_sass.csv,
#           ncu_*_stalls.md; ncu with --clock-control none, as METHOD.md asks)
#   scripts/gpu_check.sh [stage ...]    (default: tests bench)
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
    bars)
      python -m flashtile bench --head-dims 64,128 --seqlens 1024,2048,4096,8192,16384 --repeats 3 \
        --providers flashtile-v2,flashtile-v3,sdpa-flash,sdpa-cudnn --baseline sdpa-flash --no-plots \
        --out "$OUT" --name bars 2>&1 | grep -v "bench:" | tee "$OUT/bars.log" || status=1 ;;
    v3bars)
      for d in 64 128 256; do
        python -m flashtile bench --head-dims $d --seqlens 1024,2048,4096,8192,16384 --repeats "${BARS_REPEATS:-2}" \
          --providers flashtile-v3,flashtile-v2,sdpa-cudnn --baseline sdpa-cudnn --no-plots --out "$OUT" \
          --name "bars_v3_d$d" 2>&1 | grep -v "bench:" > "$OUT/bars_v3_d$d.log" || status=1
      done
      python scripts/bars_table.py "$OUT"/bars_v3_d*.json ${BARS_PREVIOUS:+--previous $BARS_PREVIOUS} \
        | tee "$OUT/bars_v3.md" || status=1 ;;
    claims)
      python -m flashtile bench --head-dims 64,128 --seqlens 1024,2048,4096,8192 \
        --providers flashtile-v1,flashtile-v2,standard --baseline standard --out "$OUT" \
        --name fa1_fa2_standard 2>&1 | grep -v "bench:" | tee "$OUT/fa1_fa2_standard.log" || status=1
      python -m flashtile io --measured "$OUT/fa1_fa2_standard.json" --out "$OUT/io_regimes.json" \
        | tee "$OUT/io_regimes.md" || status=1
      python scripts/exactness_check.py --out "$OUT/exactness.json" | tee "$OUT/exactness.md" || status=1
      python scripts/memory_check.py --providers standard,flashtile-v1,flashtile-v2,flashtile-v3,sdpa-flash \
        --out "$OUT/memory.json" || status=1 ;;
    sanitize)
      sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
      # No caching allocator: an out-of-bounds access must leave the allocation to be seen.
      (rc=0
       # v3's kernels each: the Gluon and the plain-Triton forward; the Gluon backwards (two
       # passes, one with TMA reduce-add; the float8 passes) and v2's, FP8 mode too; the decoding kernels
       for run in "backward=gluon v1,v2,v3,fp8,kvcache" "backward=gluon-reduce v3" "backward=v2 fp8" \
                  "forward=triton;backward=v2 v3"; do
         set -- $run
         echo "kernel options: $1"
         PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$sanitizer" --tool memcheck --error-exitcode 1 \
           python scripts/sanitize_cases.py --versions "$2" --kernel-options "$1" || rc=1
       done
       exit $rc) 2>&1 | tee "$OUT/sanitize.log" | tail -25 || status=1 ;;
    ablation)
      python scripts/ablation_v3.py --out "$OUT/ablation_v3.json" | tee "$OUT/ablation_v3.md" || status=1 ;;
    ab)
      python scripts/ab_revision.py warm "${AB_REV:?AB_REV names the revision in .ab}" --bars 64,128,256 || status=1
      python scripts/ab_revision.py run "$AB_REV" --bars 64,128,256 \
        --rounds "${AB_ROUNDS:-2}" --out "$OUT/ab.json" 2>&1 | tee "$OUT/ab.md" || status=1 ;;
    features)
      IFS=',' read -ra features <<< "${FEATURES:-none,softcap 30,alibi,sinks,dropout 0.1}"
      for feature in "${features[@]}"; do
        set -- $feature
        python -m flashtile bench --head-dims 128 --seqlens 8192 --causal false,true \
          $([ "$1" != none ] && echo "--$*") --providers flashtile-v3 --repeats 3 --no-plots --out "$OUT" \
          --name "features_$1" 2>&1 | grep -v "bench:"
      done > "$OUT/features.log" || status=1
      python scripts/features_table.py "$OUT"/features_*.json --out "$OUT/features.json" || status=1 ;;
    dropout)
      for p in 0.1 0; do
        python -m flashtile bench --head-dims 64,128 --seqlens 8192 --causal false,true --modes fwd,bwd \
          $([ $p != 0 ] && echo "--dropout $p --providers flashtile-v3,flashtile-v2" || echo "--providers flashtile-v3") \
          --repeats 2 --no-plots ${DROPOUT_ARGS:-} --out "$OUT" --name "$([ $p != 0 ] && echo dropout || echo nodropout)" \
          2>&1 | grep -v "bench:"
      done > "$OUT/dropout.log" || status=1 ;;
    headdimv)
      python -m flashtile bench --head-dims 192 --head-dim-v 128 --seqlens 8192 --hidden 3072 --repeats 2 \
        --providers flashtile-v3,flashtile-v2,sdpa-cudnn,sdpa-efficient --baseline sdpa-cudnn --no-plots \
        --out "$OUT" --name headdimv 2>&1 | grep -v "bench:" | tee "$OUT/headdimv.log" || status=1 ;;
    fp8)
      python -m flashtile bench --head-dims 64,128,256 --seqlens 4096,8192,16384 --modes fwd,bwd --dtype bf16,e4m3 \
        --providers flashtile-v3 --baseline flashtile-v3 --repeats 2 --out "$OUT" --name fp8 2>&1 \
        | grep -v "bench:" | tee "$OUT/fp8.log" || status=1
      python scripts/fp8_accuracy.py --out "$OUT/fp8_accuracy.json" | tee "$OUT/fp8_accuracy.md" || status=1 ;;
    train)
      python scripts/train_llama.py ${TRAIN_ARGS:-} --out "$OUT" 2>&1 | tee "$OUT/training.log" || status=1 ;;
    host)
      for i in $(seq "${HOST_ROUNDS:-2}"); do
        python scripts/host_time.py --out "$OUT/host_tree_$i.json" || status=1
        if [ -n "${HOST_TREE:-}" ]; then
          PYTHONPATH="$HOST_TREE:$PYTHONPATH" python scripts/host_time.py --out "$OUT/host_other_$i.json" || status=1
        fi
      done > "$OUT/host_time.log"
      python scripts/host_time.py --table "$OUT"/host_*.json | tee "$OUT/host_time.md" || status=1 ;;
    decode)
      python -m flashtile decode ${DECODE_ARGS:-} --out "$OUT" --name decode 2>&1 | tee "$OUT/decode.log" || status=1 ;;
    gluon)
      # (v3's default forward wherever it applies: the tests stage checks it)
      for seqlen in 1024 16384; do
        python scripts/sweep_configs.py --only v3-gluon --seqlen $seqlen --out "$OUT/sweep_gluon_$seqlen.jsonl" \
          2>&1 | tee -a "$OUT/sweep_gluon.log" || status=1
      done ;;
    profile)
      cases=${PROFILE_CASES:-"64 2048 plain bwd;128 2048 plain bwd;256 1024 plain fwd"}
      IFS=';' read -ra entries <<< "$cases"
      for entry in "${entries[@]}"; do
        set -- $entry
        name="ncu_d$1_s$2_$3_$4${5:+_$5}"
        timeout 300 ncu --clock-control none --profile-from-start off --target-processes all \
          --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
          --section LaunchStats --section Occupancy --section SourceCounters --import-source no \
          -f -o "$OUT/$name" python scripts/profile_case.py --head-dim "$1" --seqlen "$2" --mode "$4" \
          --dtype "${5:-bf16}" $([ "$3" = causal ] && echo --causal) > "$OUT/$name.log" 2>&1 || status=1
        ncu --import "$OUT/$name.ncu-rep" --csv --page details > "$OUT/$name.csv" || status=1
        # The SASS with each instruction's stall samples, and where the warps wait (ncu_stalls.py).
        ncu --import "$OUT/$name.ncu-rep" --csv --page source --print-source sass > "$OUT/${name}_sass.csv" || status=1
        python scripts/ncu_stalls.py "$OUT/${name}_sass.csv" | tee "$OUT/${name}_stalls.md" || status=1
      done ;;
    memory)
      python scripts/memory_check.py --out "$OUT/memory.json" || status=1 ;;
    sweep)
      python scripts/sweep_configs.py --out "$OUT/sweep.jsonl" ${SWEEP_ARGS:-} || status=1 ;;
    bench)
      start=$(date +%s)
      python -m flashtile bench ${BENCH_ARGS:-} --out "$OUT" --name bench 2>&1 | tee "$OUT/bench.log" | tail -80 || status=1
      echo "bench grid took $(( $(date +%s) - start )) s" | tee -a "$OUT/bench.log" ;;
    *) echo "unknown stage $stage"; status=2 ;;
  esac
done
exit $status
