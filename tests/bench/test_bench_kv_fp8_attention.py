"""bench/bench_kv_fp8_attention.py on the CPU: its default cases stream well past L2 and its command line."""
from __future__ import annotations

from helpers import assert_bench_requires_out

SCRIPT = "bench_kv_fp8_attention"  # (the ``bench`` fixture: tests/bench/conftest.py)


def test_default_cases_read_over_100_mb_of_fp8_keys_and_values(bench):
    rows = set()
    for case in bench.CASES.split(","):
        b, h, hkv, ctx, d = (int(x) for x in case.split("x"))
        assert h % hkv == 0
        assert 2 * b * hkv * ctx * d > 100e6, case  # e4m3: one byte an element
        rows.add(h // hkv)
    assert {1, 2, 4, 7} <= rows  # every block shape of the kernel: 1, 2, 4 and 8 rows per block


def test_the_output_folder_is_required():
    assert_bench_requires_out(SCRIPT)
