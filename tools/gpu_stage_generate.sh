#!/usr/bin/env bash
# GPU stage of patched model.generate (its paths, concurrency): the gpu tests of tests/runtime/,
# bench/bench_generate.py and bench/bench_beam.py. Writes logs and results to $OUT and one tarball
# $OUT/generate_results.tar.gz.
# Needs the extension built (pip install --no-deps --no-build-isolation -e .) and FUSEINFER_SHARED.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/generate"
export FUSEINFER_BENCH_DIR="$OUT/generate"
export FUSEINFER_SHARED=${FUSEINFER_SHARED:-$(pwd)/shared}
rc=0
python3 -m pytest -q -m gpu tests/runtime/ tests/runtime/test_decode.py -p no:cacheprovider \
    > "$OUT/generate/pytest_gpu.log" 2>&1 || rc=1
tail -3 "$OUT/generate/pytest_gpu.log"
timeout 420 python3 bench/bench_generate.py > "$OUT/generate/bench_generate.log" 2>&1 || rc=1
tail -40 "$OUT/generate/bench_generate.log"
timeout 480 python3 bench/bench_beam.py --out "$OUT/generate" > "$OUT/generate/bench_beam.log" 2>&1 || rc=1
tail -12 "$OUT/generate/bench_beam.log"
tar -czf "$OUT/generate_results.tar.gz" -C "$OUT" generate
exit $rc
