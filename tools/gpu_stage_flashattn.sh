#!/usr/bin/env bash
# The flash-attn-4 attention backend on the GPU (docs/attention_backends.md): versions, an import and
# smoke run of the package, the backend's GPU tests, and bench/bench_attention.py with its flash_attn column.
#
#   bash tools/gpu_stage_flashattn.sh [tests] [bench] [--full]
#     tests: versions, import + smoke run of the package, the backend's GPU tests; bench: bench_attention.py
#     (default both; the benchmark's --quick set, --full: every shape). Compiled kernels are cached on disk
#     (/tmp/fa_cute_cache) so that a later call on the same warm machine does not compile them again.
#
# Assumes the flash-attn-4 wheels installed with `pip install --no-deps --target /tmp/site` (FA_SITE to change it;
# the device-command sequence is in docs/attention_backends.md) and the shared assets in .gpu_assets/ (as for
# tools/gpu_check.sh). Builds the extension first if `import fuseinfer._C` fails. Logs and results go to
# $OUT/flashattn.tar.gz.
#
# Exit status: 0 when fuseinfer's parts passed. When flash-attn-4 itself does not import or run here, that is
# printed (the error and the versions) as "flash-attn-4: FAILED ..." and the script still exits 0, with the
# package's tests skipped and its benchmark column left out with the reason; a failure of our mapping onto a
# package that runs (a GPU test, or the benchmark's mapping check) exits 1.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fuseinfer-gpu}
mkdir -p "$OUT"
SITE=${FA_SITE:-/tmp/site}
# (nvidia-cutlass-dsl puts its dsl_packages on sys.path through a .pth file, which --target installs do not run)
export PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
export FUSEINFER_SHARED=${FUSEINFER_SHARED:-$PWD/.gpu_assets}
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} FUSEINFER_BENCH_DIR=${FUSEINFER_BENCH_DIR:-$OUT/bench}
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=${FLASH_ATTENTION_CUTE_DSL_CACHE_DIR:-/tmp/fa_cute_cache}
quick=--quick
do_tests=0 do_bench=0
for arg in "$@"; do
  case $arg in
    --full) quick= ;;
    tests) do_tests=1 ;;
    bench) do_bench=1 ;;
    *) echo "unknown argument $arg (tests, bench, --full)"; exit 2 ;;
  esac
done
[ $do_tests -eq 0 ] && [ $do_bench -eq 0 ] && do_tests=1 && do_bench=1
status=0
fa_state="OK"

run() {  # run NAME CMD...: logs to $OUT/NAME.log; returns the command's status
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  return "$rc"
}

finish() {
  (cd "$OUT" && tar czf /tmp/flashattn.tar.gz . && rm -rf ./* && mv /tmp/flashattn.tar.gz .)
  echo "flash-attn-4: $fa_state"
  echo "gpu_stage_flashattn: $([ "$status" -eq 0 ] && echo PASS || echo FAIL); logs and results in $OUT/flashattn.tar.gz"
  exit "$status"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
run versions python3 - <<'PY'
import importlib.metadata as md, torch, transformers, sys
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "transformers",
      transformers.__version__, "gpu", torch.cuda.get_device_name(0), "sm_%d%d" % torch.cuda.get_device_capability(0))
for d in ("flash-attn-4", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core",
          "nvidia-cutlass-dsl-libs-cu13", "quack-kernels", "apache-tvm-ffi", "torch-c-dlpack-ext", "einops",
          "cuda-bindings", "protobuf"):
    try:
        print(f"{d} {md.version(d)}")
    except md.PackageNotFoundError:
        print(f"{d} NOT INSTALLED")
PY

# the package alone: import, then one causal fp16 call (head dims 64 and 128) against SDPA, timed compile
if ! run fa_import python3 -c 'import flash_attn.cute as fa, cutlass; print("flash_attn.cute from", fa.__file__); print("cutlass", getattr(cutlass, "__version__", "?"))'; then
  fa_state="FAILED to import (error in fa_import.log, versions in versions.log): $(grep -E 'Error|error' "$OUT/fa_import.log" | tail -1)"
elif ! run fa_smoke python3 - <<'PY'
import time, torch
from flash_attn.cute import flash_attn_func
for d in (64, 128):
    q, k, v = (torch.randn(2, 256, 4, d, device="cuda", dtype=torch.float16) for _ in range(3))
    t0 = time.time()
    res = flash_attn_func(q, k, v, causal=True)
    out = res[0] if isinstance(res, tuple) else res
    torch.cuda.synchronize()
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2).float() for t in (q, k, v)),
                                                           is_causal=True).transpose(1, 2)
    err = (out.float() - ref).abs().max().item()
    print(f"head dim {d}: first call (compile + run) {time.time() - t0:.1f} s, max abs err vs fp32 SDPA {err:.2e}")
    assert err < 2e-2, err
PY
then
  fa_state="FAILED to run on this GPU (error in fa_smoke.log, versions in versions.log): $(grep -E 'Error|error' "$OUT/fa_smoke.log" | tail -1)"
fi

if ! python3 -c 'import fuseinfer._C' 2>/dev/null; then
  FUSEINFER_BUILD_CUDA=1 run build python3 -m pip install --no-deps --no-build-isolation --no-index -e . || { status=1; finish; }
fi

# GPU tests of the backend (they skip with the reason when flash-attn-4 does not import)
if [ $do_tests -eq 1 ]; then
  run pytest_flashattn python3 -m pytest -q -ra -p no:cacheprovider -m gpu tests/layers/test_attention_backend.py
  rc=$?
  if [ "$rc" -ne 0 ] && [ "$fa_state" = "OK" ]; then status=1; fi
fi
[ $do_bench -eq 1 ] || finish

# the benchmark: ours, SDPA backends, cuDNN and flash_attn timed in turn (the column is skipped with the reason
# when the package does not import or fails its mapping check)
run bench_attention python3 bench/bench_attention.py $quick --rounds 3 || status=1
skip=$(grep -E '^flash_attn column skipped' "$OUT/bench_attention.log" | head -1)
if [ -n "$skip" ] && [ "$fa_state" = "OK" ]; then status=1; fa_state="imports and runs, but the benchmark: $skip"; fi
grep -E '^AUTO_TABLE' "$OUT/bench_attention.log" || true
finish
