"""bench/bench_silu_gemm.py on the CPU: its command line and bench_qkv_gemm.py's (a bad choice is one usage error
before any GPU work) and its shapes (the published MLP sizes of the Llama-architecture models the eval builds)."""
from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import BENCH_DIR

SCRIPT = "bench_silu_gemm"  # (the ``bench`` fixture: tests/bench/conftest.py)


@pytest.mark.parametrize("script", [SCRIPT, "bench_qkv_gemm"])  # (the fused-projection benches share their CLI)
@pytest.mark.parametrize("args", [["--dtype", "fp32"], ["--dtype"], ["--rows", "8"]])
def test_bad_arguments_are_one_usage_error(script, args):
    out = subprocess.run([sys.executable, str(BENCH_DIR / f"{script}.py"), *args], capture_output=True, text=True)
    assert out.returncode == 2 and "usage:" in out.stderr, out.stderr[-500:]
    assert "Traceback" not in out.stderr


def test_shapes_are_the_published_mlps(bench):
    from fuseinfer.models.llama.configs import RANDOM_CONFIGS
    hub = {"llama-3.2-1b": "meta-llama/Llama-3.2-1B", "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B",
           "llama-3.1-8b": "meta-llama/Llama-3.1-8B"}
    for name, (k, f) in bench.MLPS.items():
        cfg = RANDOM_CONFIGS[hub[name]]
        assert (cfg["hidden_size"], cfg["intermediate_size"]) == (k, f), name
