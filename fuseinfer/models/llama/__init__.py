"""The Llama-architecture families (Llama, Mistral, Qwen2): everything they need lives in this folder."""
from fuseinfer.models.llama.family import LlamaFamily, MistralFamily, Qwen2Family

__all__ = ["LlamaFamily", "MistralFamily", "Qwen2Family"]
