"""bench/bench_kv_fp8.py on the CPU: the K/V bytes per decode step it records (OPT-1.3b at batch 32, context 2048:
~12.9 GB in fp16, half in e4m3) and its command line."""
from __future__ import annotations

from helpers import assert_bench_requires_out

SCRIPT = "bench_kv_fp8"  # (the ``bench`` fixture: tests/bench/conftest.py)


def test_kv_bytes_per_step_of_opt_1_3b(bench):
    from transformers import OPTConfig

    cfg = OPTConfig(hidden_size=2048, num_attention_heads=32, num_hidden_layers=24, ffn_dim=8192)
    fp16 = bench.kv_bytes_per_step(cfg, 32, 2048, 2)
    assert fp16 == 2 * 24 * 32 * 32 * 2048 * 64 * 2 and round(fp16 / 1e9, 1) == 12.9
    assert bench.kv_bytes_per_step(cfg, 32, 2048, 1) * 2 == fp16


def test_gqa_heads_count_the_key_value_heads(bench):
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4)
    assert bench.kv_bytes_per_step(cfg, 1, 10, 1) == 2 * 4 * 1 * 2 * 10 * 64


def test_the_output_folder_is_required():
    assert_bench_requires_out(SCRIPT)
