#!/usr/bin/env bash
# Issue 39 (models larger than one GPU) on the nvidia-h100-x2 machine (two H100s), one device call:
#
#   bash tools/gpu_stage_multigpu.sh        (carry .gpu_assets: tools/stage_gpu_assets.sh copies the tiny model)
#
# Builds the extension if it is not built yet, then: TP=2 correctness and speed (torchrun, bench_parallel.py tp),
# OPT-30b on one GPU and the device_map runs (bench_parallel.py single), the eval CLI with --tp 2, and the report
# (bench/results/parallel.{json,md} under $FUSEINFER_BENCH_DIR). Everything, logs included, is packed into
# $OUT/multigpu.tar.gz. Exit 0 only when every part ran and every correctness check passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fuseinfer-multigpu}
mkdir -p "$OUT"
# never NVLink multicast / SHARP (set in every process started here; bench_parallel.py and init_distributed
# setdefault them too)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FUSEINFER_SHARED=${FUSEINFER_SHARED:-$PWD/.gpu_assets}
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} FUSEINFER_BUILD_CUDA=1
export FUSEINFER_BENCH_DIR=${FUSEINFER_BENCH_DIR:-$OUT/bench}
mkdir -p "$FUSEINFER_BENCH_DIR"
status=0

RUN_LOGS="$OUT"
. tools/gpu_run.sh  # run NAME CMD...: logs to $RUN_LOGS/NAME.log, remembers failure

finish() {
  (cd "$OUT" && tar czf /tmp/multigpu.tar.gz --exclude multigpu.tar.gz . && find . -mindepth 1 ! -name multigpu.tar.gz -delete &&
    mv /tmp/multigpu.tar.gz .)
  echo "gpu_stage_multigpu: $([ "$1" -eq 0 ] && echo PASS || echo FAIL); logs and results in $OUT/multigpu.tar.gz"
  exit "$1"
}

nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpus.log"
python3 -c 'import torch, transformers, accelerate; print("torch", torch.__version__, "cuda", torch.version.cuda,
"transformers", transformers.__version__, "accelerate", accelerate.__version__, "gpus", torch.cuda.device_count(),
"nccl", torch.cuda.nccl.version())' | tee -a "$OUT/gpus.log"
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
[ "$gpus" -ge 2 ] || { echo "needs 2 GPUs, found $gpus (run on nvidia-h100-x2)"; finish 2; }
if ! python3 -c 'import fuseinfer._C' 2>/dev/null; then
  run build python3 -m pip install --no-deps --no-build-isolation --no-index -e . || finish 1
  run import python3 -c 'import fuseinfer._C' || finish 1
fi
TORCHRUN=(python3 -m torch.distributed.run --standalone --nproc-per-node 2)
# accelerate placement on the GPUs: dispatched over 1 GPU + CPU offload and over 2 GPUs, patched vs unpatched
run pytest_gpu timeout 300 python3 -m pytest -q -ra -p no:cacheprovider -m gpu tests/parallel
# TP=2: OPT-1.3b logits vs fp32, tiny-model tokens vs one GPU, OPT-66b decode/prefill/memory, OPT-30b decode
if ! run tp timeout 420 "${TORCHRUN[@]}" bench/bench_parallel.py tp; then
  # (the stage stays FAILED) figures without CUDA graphs, in case capturing the NCCL all-reduces is what failed
  run tp_eager env FUSEINFER_TP_GRAPHS=0 timeout 420 "${TORCHRUN[@]}" bench/bench_parallel.py tp
fi
# one process: OPT-30b on one GPU (the speed-up's baseline), device_map over 2 GPUs (1.3b logits, 66b auto decode)
run single timeout 420 python3 bench/bench_parallel.py single
# the eval CLI under torchrun (rank 0 prints and writes)
run eval_tp timeout 240 "${TORCHRUN[@]}" -m fuseinfer.eval --model random:opt-1.3b --dtype fp16 --tp 2 --skip-ppl \
  --prompt-len 512 --gen-len 64 --warmup 1 --repeats 3 --output "$FUSEINFER_BENCH_DIR/eval_opt-1.3b_fp16_tp2.json" \
  --markdown "$FUSEINFER_BENCH_DIR/eval_opt-1.3b_fp16_tp2.md"
run report python3 bench/bench_parallel.py report
finish "$status"
