"""bench/fp8_attention_accuracy.py on the CPU: the emulated attention without e4m3 rounding is the fp32 attention
(causal, and with a given mask), each e4m3 variant stays within its rounding of it, and the command line refuses
bad arguments with one usage error."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import BENCH_DIR

SCRIPT = "fp8_attention_accuracy"  # (the ``bench`` fixture: tests/bench/conftest.py)


def _qkv(seed=0, b=2, h=3, s=37, d=16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, d, generator=g) for _ in range(3)]


def test_without_rounding_it_is_the_fp32_attention(bench):
    q, k, v = _qkv()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0).transpose(1, 2)
    torch.testing.assert_close(bench.emulated_attention(q, k, v, None, False, False, 1.0), ref)
    mask = torch.rand(2, 1, 37, 37, generator=torch.Generator().manual_seed(1)) > 0.3
    mask |= torch.eye(37, dtype=torch.bool)  # (every query sees a key)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0).transpose(1, 2)
    torch.testing.assert_close(bench.emulated_attention(q, k, v, mask, False, False, 1.0), ref)


@pytest.mark.parametrize("name", ["qk", "qk+pv", "qk+pv p256"])
def test_e4m3_variants_round_and_stay_close(bench, name):
    q, k, v = _qkv(seed=2)
    ref = bench.emulated_attention(q, k, v, None, False, False, 1.0)
    out = bench.emulated_attention(q, k, v, None, *bench.VARIANTS[name])
    err = (out - ref).abs().max().item()
    assert 0 < err < 0.25 * ref.abs().max().item(), err  # rounded (not equal), yet an attention output


def test_e4m3_rounding_is_within_half_a_step():
    sys.path.insert(0, str(BENCH_DIR))
    try:
        import fp8_attention_accuracy as mod
    finally:
        sys.path.remove(str(BENCH_DIR))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    scale = x.abs().amax(-1, keepdim=True) / 448
    err = (mod.e4m3(x, -1) - x).abs() / scale  # in units of the scale
    step = torch.pow(2.0, torch.floor(torch.log2((x.abs() / scale).clamp_min(2.0 ** -6))) - 3)
    assert (err <= step / 2 + 1e-4).all()


@pytest.mark.parametrize("args", [[], ["--out", "x", "--max-windows", "0"], ["--out", "x", "--seq-len", "1"],
                                  ["--out", "x", "--model", "/nonexistent-folder"]])
def test_bad_arguments_are_one_usage_error(args):
    out = subprocess.run([sys.executable, str(BENCH_DIR / f"{SCRIPT}.py"), *args], capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-500:]
