"""bench/bench_attention_8bit_out.py on the CPU: its default cases are OPT prefills of both head dims, it times every
implementation it checks, and its command line."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        import bench_attention_8bit_out
        yield bench_attention_8bit_out
    finally:
        sys.path.remove(str(BENCH))


def test_default_cases_are_prefills_of_both_head_dims(bench):
    dims, lengths = set(), set()
    for case in bench.CASES.split(","):
        b, h, s, d = (int(x) for x in case.split("x"))
        assert b >= 1 and h >= 1 and s > 16, case  # (more than 16 queries: the prefill kernels, which quantize)
        dims.add(d), lengths.add(s)
    assert dims == {64, 128} and max(lengths) >= 2040


def test_both_formats_fused_and_unfused_are_timed(bench):
    assert {"fp16", "dynamic", "fused", "int8_dynamic", "int8_fused"} <= set(bench.IMPLS)


def test_the_output_folder_is_required():
    out = subprocess.run([sys.executable, str(BENCH / "bench_attention_8bit_out.py")], capture_output=True, text=True)
    assert out.returncode == 2 and "--out" in out.stderr
