"""bench/bench_qkv_gemm.py on the CPU: its shapes (the published q/k/v sizes of the models the eval builds; its
command line: test_bench_silu_gemm.py)."""
from __future__ import annotations

SCRIPT = "bench_qkv_gemm"  # (the ``bench`` fixture: tests/bench/conftest.py)


def test_shapes_are_the_published_projections(bench):
    from fuseinfer.models.llama.configs import RANDOM_CONFIGS as LLAMA
    from fuseinfer.models.opt.configs import RANDOM_CONFIGS as OPT
    hub = {"llama-3.2-1b": LLAMA["meta-llama/Llama-3.2-1B"], "qwen2.5-1.5b": LLAMA["Qwen/Qwen2.5-1.5B"],
           "llama-3.1-8b": LLAMA["meta-llama/Llama-3.1-8B"], "opt-1.3b": OPT["facebook/opt-1.3b"]}
    for name, (k, h, hkv, d, bias, rotary) in bench.PROJECTIONS.items():
        cfg = hub[name]
        kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
        assert (cfg["hidden_size"], cfg["num_attention_heads"], kv) == (k, h, hkv), name
        assert cfg["hidden_size"] // h == d, name
        assert bias == (name in ("qwen2.5-1.5b", "opt-1.3b")) and rotary == (name != "opt-1.3b"), name
