"""bench/bench_attention_8bit_out.py on the CPU: its default cases are OPT prefills of both head dims, it times every
implementation it checks, and its command line."""
from __future__ import annotations

from helpers import assert_bench_requires_out

SCRIPT = "bench_attention_8bit_out"  # (the ``bench`` fixture: tests/bench/conftest.py)


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
    assert_bench_requires_out(SCRIPT)
