#!/usr/bin/env bash
# Models larger than one GPU, on a machine with two H100s, in one run:
#
#   bash tools/gpu_stage_multigpu.sh        (carry .gpu_assets: tools/stage_gpu_assets.sh copies the tiny model;
#                                            optionally a prebuilt fuseinfer/_C*.so: the build is then skipped)
#
# Builds the extension unless `import fuseinfer._C` works, then, each step under its own timeout and all under one
# deadline (MULTIGPU_BUDGET_S, default 450 s from the script's start, build included; a step that would start with
# too little time left is skipped and reported):
#   1. pytest -m gpu tests/parallel          accelerate placement on 1 GPU + CPU offload and over 2 GPUs
#   2. torchrun bench_parallel.py tp         TP=2: OPT-1.3b logits vs fp32, tiny tokens vs 1 GPU, OPT-66b decode /
#                                            prefill / peak memory, OPT-30b decode, OPT-66b int8 decode
#   3. the TP parts step 2 did not finish, again with FUSEINFER_TP_GRAPHS=0 (no CUDA graphs), if any
#   4. bench_parallel.py single              OPT-30b on one GPU, device_map OPT-1.3b logits, OPT-66b auto decode
#   5. torchrun -m fuseinfer.eval --tp 2     the eval CLI, random OPT-1.3b
#   6. bench_parallel.py report              parallel.md (every target's figure, GPU names, floors)
# Everything is packed into $OUT/multigpu.tar.gz; the report is also left beside it as $OUT/multigpu_report.md.
# Exit 0 only when every step ran and every correctness check passed.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$SECONDS
BUDGET_S=${MULTIGPU_BUDGET_S:-450}
OUT=${OUT:-/tmp/fuseinfer-multigpu}
mkdir -p "$OUT"
# never NVLink multicast / SHARP: exported here, so every process below (torchrun's workers included) has them;
# bench_parallel.py and init_distributed setdefault them too
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# NCCL errors end the process instead of hanging (the default in torch 2.x; stated for the record)
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}
export FUSEINFER_SHARED=${FUSEINFER_SHARED:-$PWD/.gpu_assets}
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-32} FUSEINFER_BUILD_CUDA=1 TOKENIZERS_PARALLELISM=false
export FUSEINFER_BENCH_DIR=${FUSEINFER_BENCH_DIR:-$OUT/bench}
mkdir -p "$FUSEINFER_BENCH_DIR"
status=0

RUN_LOGS="$OUT"
. tools/gpu_run.sh  # run NAME CMD...: logs to $RUN_LOGS/NAME.log, remembers failure

left() { echo $((BUDGET_S - (SECONDS - T0))); }

# step NAME CAP_S RESERVE_S CMD...: CMD under `timeout` of min(CAP_S, time left - RESERVE_S) (RESERVE_S: what the
# steps after it need at least); skipped, and the stage FAILED, when under 20 s would be left for it
step() {
  local name=$1 cap=$2 reserve=$3; shift 3
  local t=$(( $(left) - reserve ))
  [ "$t" -gt "$cap" ] && t=$cap
  if [ "$t" -lt 20 ]; then
    echo "=== $name: SKIPPED, out of time ($(left) s left of $BUDGET_S)" | tee "$OUT/$name.log"
    status=1
    return 124
  fi
  run "$name" timeout -k 10 "$t" "$@"
}

finish() {
  [ -f "$FUSEINFER_BENCH_DIR/parallel.md" ] && cp "$FUSEINFER_BENCH_DIR/parallel.md" /tmp/multigpu_report.md
  (cd "$OUT" && tar czf /tmp/multigpu.tar.gz --exclude multigpu.tar.gz . && find . -mindepth 1 ! -name multigpu.tar.gz -delete &&
    mv /tmp/multigpu.tar.gz .)
  [ -f /tmp/multigpu_report.md ] && mv /tmp/multigpu_report.md "$OUT/multigpu_report.md"
  echo "gpu_stage_multigpu: $([ "$1" -eq 0 ] && echo PASS || echo FAIL) after $((SECONDS - T0)) s; logs and results" \
    "in $OUT/multigpu.tar.gz, the report in $OUT/multigpu_report.md"
  exit "$1"
}

nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpus.log"
nvidia-smi topo -m >>"$OUT/gpus.log" 2>&1
python3 -c 'import torch, transformers, accelerate; print("torch", torch.__version__, "cuda", torch.version.cuda,
"transformers", transformers.__version__, "accelerate", accelerate.__version__, "gpus", torch.cuda.device_count(),
"nccl", torch.cuda.nccl.version())' 2>&1 | tee -a "$OUT/gpus.log"
env | grep -E '^(NCCL_|TORCH_SYMM|NVSHMEM_|TORCH_NCCL)' | sort | tee -a "$OUT/gpus.log"
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
[ "$gpus" -ge 2 ] || { echo "needs 2 GPUs, found $gpus (run on nvidia-h100-x2)"; finish 2; }
if python3 -c 'import fuseinfer._C' 2>/dev/null; then
  echo "=== build: skipped (fuseinfer._C imports)" | tee "$OUT/build.log"
else
  run build timeout 300 python3 -m pip install --no-deps --no-build-isolation --no-index -e . || finish 1
  run import python3 -c 'import fuseinfer._C' || finish 1
fi
echo "=== $(left) s left of $BUDGET_S after the build"
TORCHRUN=(python3 -m torch.distributed.run --standalone --nproc-per-node 2)
# reserves: what the later steps need at least (tp ~70 s, single ~60 s, eval ~40 s, report ~10 s on 2 H100s)
step pytest_gpu 90 190 python3 -m pytest -q -ra -p no:cacheprovider -m gpu tests/parallel
step tp 200 120 "${TORCHRUN[@]}" bench/bench_parallel.py tp
todo=$(python3 bench/bench_parallel.py missing)
if [ -n "$todo" ]; then  # (the stage stays FAILED) the parts without a result, without CUDA graphs
  # shellcheck disable=SC2086
  step tp_eager 150 110 env FUSEINFER_TP_GRAPHS=0 "${TORCHRUN[@]}" bench/bench_parallel.py tp $todo
fi
step single 150 50 python3 bench/bench_parallel.py single
step eval_tp 80 10 "${TORCHRUN[@]}" -m fuseinfer.eval --model random:opt-1.3b --dtype fp16 --tp 2 --skip-ppl \
  --prompt-len 512 --gen-len 32 --warmup 1 --repeats 3 --output "$FUSEINFER_BENCH_DIR/eval_opt-1.3b_fp16_tp2.json" \
  --markdown "$FUSEINFER_BENCH_DIR/eval_opt-1.3b_fp16_tp2.md"
run report timeout 60 python3 bench/bench_parallel.py report
finish "$status"
