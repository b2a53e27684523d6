"""bench/bench_ln_quant.py on the CPU: its command line (bad sizes are one usage error before any GPU work) and its
default shapes (the 2040-row prefill among them)."""
from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import BENCH_DIR

SCRIPT = "bench_ln_quant"  # (the ``bench`` fixture: tests/bench/conftest.py)


@pytest.mark.parametrize("args", [["--rows", "0"], ["--hidden", "-8"], ["--rows", "x"], ["--hidden"]])
def test_bad_sizes_are_one_usage_error(args):
    out = subprocess.run([sys.executable, str(BENCH_DIR / f"{SCRIPT}.py"), *args], capture_output=True, text=True)
    assert out.returncode == 2 and ("--rows" in out.stderr or "--hidden" in out.stderr), out.stderr[-500:]
    assert "Traceback" not in out.stderr


def test_default_shapes_include_the_2040_token_prefill(bench):
    assert 2040 in bench.ROWS and 2048 in bench.HIDDEN
    assert set(bench.QUICK_HIDDEN) <= set(bench.HIDDEN) and set(bench.QUICK_ROWS) <= set(bench.ROWS)
