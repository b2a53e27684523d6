"""Fast decode runtime: static KV cache + CUDA-graph replay of the decode step for patched models."""
from fuseinfer.runtime.cache import StaticKVCache
from fuseinfer.runtime.decode import generate, model_lock, release, set_cache_budget, set_runtime, using_runtime
from fuseinfer.runtime.hf_generate import GenerateHook, patched_generate

__all__ = ["GenerateHook", "StaticKVCache", "generate", "model_lock", "patched_generate", "release",
           "set_cache_budget", "set_runtime", "using_runtime"]
