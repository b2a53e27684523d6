"""bench/bench_splitkv.py on the CPU: its default cases are decode layers the split count matters for, and its
command line."""
from __future__ import annotations

from helpers import assert_bench_requires_out

SCRIPT = "bench_splitkv"  # (the ``bench`` fixture: tests/bench/conftest.py)


def test_default_cases_are_decode_layers_of_both_head_dims_and_groupings(bench):
    dims, groups, contexts = set(), set(), set()
    for case in bench.CASES.split(","):
        b, h, hkv, ctx, d = (int(x) for x in case.split("x"))
        assert h % hkv == 0, case
        dims.add(d), groups.add(h // hkv), contexts.add(ctx)
    assert dims == {64, 128} and {1, 4} <= groups and min(contexts) <= 512 and max(contexts) >= 8192


def test_the_output_folder_is_required():
    assert_bench_requires_out(SCRIPT)
