"""Fast decode runtime: static KV cache + CUDA-graph replay of the decode step for patched models."""
from .cache import StaticKVCache
from .decode import generate, release
from .hf_generate import GenerateHook, patched_generate

__all__ = ["GenerateHook", "StaticKVCache", "generate", "patched_generate", "release"]
