#!/usr/bin/env bash
# One run on a GPU machine that builds the extension, tests and benchmarks.
#
#   bash tools/gpu_check.sh [stage ...]     stages: build gputest test sanitize bench decode eval e2e ppl interference
#                                           and the features' export profile int8 w8a8 generate prefill multigpu flashattn
#                                           wheel (tools/gpu_stage_<name>.sh) (default: build test sanitize)
#
# Needs the shared assets copied to .gpu_assets/ (git-ignored; tools/stage_gpu_assets.sh does it) and named in
# the remote run's `carry`; the wheel stage also needs .whl/ (tools/stage_wheel_assets.sh). Logs and results go
# to $OUT (default /tmp/fuseinfer-gpu), one file per stage.
# FUSEINFER_GPU_TRANSFORMERS=path/to/transformers-*.whl runs every stage under that transformers instead of the
# machine's (installed without dependencies into /tmp/fuseinfer-transformers, put first on PYTHONPATH; the
# machine's huggingface_hub and tokenizers must satisfy it). stage_gpu_assets.sh downloads the wheel.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fuseinfer-gpu}
mkdir -p "$OUT"
export FUSEINFER_SHARED=${FUSEINFER_SHARED:-$PWD/.gpu_assets}
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} FUSEINFER_BUILD_CUDA=1
export FUSEINFER_BENCH_DIR=${FUSEINFER_BENCH_DIR:-$OUT/bench}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(build test sanitize)
status=0

RUN_LOGS="$OUT"
. tools/gpu_run.sh  # run NAME CMD...: logs to $RUN_LOGS/NAME.log, remembers failure

finish() {  # finish CODE: pack $OUT into one file (a remote run returns few files), print the summary, exit CODE
  (cd "$OUT" && tar czf /tmp/gpu_check.tar.gz . && rm -rf ./* && mv /tmp/gpu_check.tar.gz .)
  echo "gpu_check: $([ "$1" -eq 0 ] && echo PASS || echo FAIL) (stages: ${stages[*]}); logs and results in $OUT/gpu_check.tar.gz"
  exit "$1"
}

if [ -n "${FUSEINFER_GPU_TRANSFORMERS:-}" ]; then
  python3 -m pip install -q --no-deps --no-index --target /tmp/fuseinfer-transformers "$FUSEINFER_GPU_TRANSFORMERS" ||
    { echo "cannot install $FUSEINFER_GPU_TRANSFORMERS"; exit 2; }
  export PYTHONPATH=/tmp/fuseinfer-transformers${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)'

for stage in "${stages[@]}"; do
  case $stage in
    build)
      find_cutlass || finish 1  # (the sm_90a build stops without CUTLASS's headers)
      run build python3 -m pip install --no-deps --no-build-isolation --no-index -e . || finish 1
      # a build that does not import is a failed build (fuseinfer would quietly run its references)
      run import python3 -c 'import fuseinfer._C' || finish 1 ;;
    gputest)  # one line per test as it ends (-v), so that a run cut short by a time limit still names its failures.
      # With several GPUs (or GPUTEST_SHARDS=N): one pytest per GPU over its share of the test files
      # (tools/gpu_shards.py), side by side, logs pytest_gpu_<i>.log; tests that need two GPUs then skip (the
      # multigpu stage runs them); GPUTEST_SHARDS=1 keeps one process.
      # With pytest-xdist there, each pytest spreads its tests over GPUTEST_WORKERS processes (default 4) sharing
      # its GPU: most GPU tests are small launches bound by the host, so one GPU serves several at once.
      # GPUTEST_ARGS: what pytest runs instead of all of tests/ (test paths, --ignore=..., -k ...; one process).
      xd=()
      workers=${GPUTEST_WORKERS:-4}
      if [ "$workers" -gt 1 ] && python3 -c 'import xdist' 2>/dev/null; then xd=(-n "$workers" --dist load); fi
      cvd=${CUDA_VISIBLE_DEVICES:-}; devs=(${cvd//,/ })
      [ ${#devs[@]} -eq 0 ] && devs=($(seq 0 $(( $(nvidia-smi -L | wc -l) - 1 ))))
      shards=${GPUTEST_SHARDS:-${#devs[@]}}
      [ -n "${GPUTEST_ARGS:-}" ] && shards=1
      # CPU threads per test process sized to share the cores: torch's default (every core, in each of the
      # shards x workers processes) oversubscribes them, which slows the tests whose CPU references are heavy
      threads=$(( $(nproc) / (shards * (${#xd[@]} > 0 ? workers : 1)) ))
      export FUSEINFER_TEST_FAILURES=$OUT/test_failures.log  # (each failure's report as it happens: tests/conftest.py)
      export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}
      if [ "$shards" -gt 1 ]; then
        python3 -m pytest --collect-only -q -p no:cacheprovider -m gpu tests 2>/dev/null |
          python3 tools/gpu_shards.py "$shards" > "$OUT/gpu_shards.txt"
        pids=(); i=0
        while IFS= read -r files; do
          if [ -n "$files" ]; then
            CUDA_VISIBLE_DEVICES=${devs[$(( i % ${#devs[@]} ))]} run_quiet pytest_gpu_$i \
              python3 -m pytest -v -ra --durations=20 -p no:cacheprovider "${xd[@]}" -m gpu $files &
            pids+=($!)
          fi
          i=$((i + 1))
        done < "$OUT/gpu_shards.txt"
        for pid in "${pids[@]}"; do wait "$pid" || status=1; done
        grep -h -E "^(FAILED|ERROR) |[0-9]+ (passed|failed)" "$OUT"/pytest_gpu_*.log
      else
        run pytest_gpu python3 -m pytest -v -ra --durations=20 -p no:cacheprovider "${xd[@]}" -m gpu ${GPUTEST_ARGS:-tests}
      fi ;;
    test)
      run pytest python3 -m pytest -q -ra -p no:cacheprovider tests
      run compare_logits python3 tools/compare_logits.py --shape opt-1.3b --dtype fp16 --seq 512 ;;
    sanitize)  # every kernel under memcheck, synccheck and racecheck (see tools/kernel_smoke.py for the parts); the
      # runs are independent processes, so they go side by side (logs <name>.log), then the ring-wrap gates
      pids=()
      for tool in memcheck synccheck; do
        run_quiet $tool compute-sanitizer --tool $tool --error-exitcode 1 python3 tools/kernel_smoke.py & pids+=($!)
      done
      for part in no-ring-wrap sampling sampling-cluster prefill prefill-fp8; do
        run_quiet racecheck_$part compute-sanitizer --tool racecheck --error-exitcode 1 \
          python3 tools/kernel_smoke.py --part $part & pids+=($!)
      done
      # decode steps whose rings wrap: racecheck reports every reuse of a TMA-filled stage (as it does for the correct
      # ring of tools/racecheck_ring.cu, the control below), so these runs fail on any other hazard only
      for part in d64 d128; do
        run_quiet racecheck_ring_wrap_$part timeout 300 compute-sanitizer --tool racecheck \
          python3 tools/kernel_smoke.py --part ring-wrap-$part & pids+=($!)
      done
      for pid in "${pids[@]}"; do wait "$pid" || status=1; done
      for part in d64 d128; do
        run racecheck_ring_wrap_${part}_gate python3 tools/racecheck_tma.py "$OUT/racecheck_ring_wrap_$part.log"
      done
      grep -h -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT"/memcheck.log "$OUT"/synccheck.log \
        "$OUT"/racecheck_*.log
      nvcc -arch=sm_90 -o "$OUT/racecheck_ring" tools/racecheck_ring.cu &&
        compute-sanitizer --tool racecheck "$OUT/racecheck_ring" 2>&1 | grep -E "racecheck_ring|SUMMARY" |
        tee "$OUT/racecheck_control.log"
      rm -f "$OUT/racecheck_ring" ;;
    bench)
      for b in bench/bench_layernorm.py bench/bench_linear.py bench/bench_attention.py; do
        [ -f "$b" ] && run "$(basename "$b" .py)" python3 "$b" ${BENCH_ARGS:-}
      done ;;
    decode) run bench_decode python3 bench/bench_decode.py ${DECODE_ARGS:-} ;;
    eval)  # the main comparison; decode at batch 1, prompt 512
      run eval python3 -m fuseinfer.eval --model random:opt-1.3b --dtype fp16 --backends eager,compile,fuseinfer \
        --skip-ppl --batch-size 1 --prompt-len 512 --gen-len 128 --output "$FUSEINFER_BENCH_DIR/eval_opt-1.3b_fp16_b1.json" \
        --markdown "$FUSEINFER_BENCH_DIR/eval_opt-1.3b_fp16_b1.md" --plot "$FUSEINFER_BENCH_DIR/eval_opt-1.3b_fp16_b1.png" ;;
    e2e)  # end-to-end prefill of 1 x 2040 tokens (+ 8 decoded = the 2048 positions)
      run e2e python3 -m fuseinfer.eval --model random:opt-1.3b --dtype fp16 --backends eager,compile,fuseinfer \
        --skip-ppl --batch-size 1 --prompt-len 2040 --gen-len 8 --output "$FUSEINFER_BENCH_DIR/e2e_prefill_opt-1.3b_2040.json" \
        --markdown "$FUSEINFER_BENCH_DIR/e2e_prefill_opt-1.3b_2040.md" ;;
    ppl)  # perplexity of the trained tiny model on the GPU in fp16
      run ppl python3 -m fuseinfer.eval --model "$FUSEINFER_SHARED/models/opt-wt2-tiny" --dtype fp16 \
        --backends eager,compile,fuseinfer --data-dir "$FUSEINFER_SHARED/data/wikitext-2-raw" \
        --output "$FUSEINFER_BENCH_DIR/eval_opt-wt2-tiny_fp16_ppl.json" --markdown "$FUSEINFER_BENCH_DIR/eval_opt-wt2-tiny_fp16_ppl.md" ;;
    export|profile|int8|w8a8|generate|prefill|multigpu|flashattn|wheel)  # a feature's stage: tools/gpu_stage_<name>.sh
      mkdir -p "$OUT/$stage"
      run "stage_$stage" env OUT="$OUT/$stage" bash "tools/gpu_stage_$stage.sh" ;;
    interference) run interference python3 tools/compile_interference.py ;;
    *) echo "unknown stage $stage"; finish 2 ;;
  esac
done
finish "$status"
