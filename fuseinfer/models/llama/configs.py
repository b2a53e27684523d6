"""The published configurations of the Llama-architecture models fuseinfer builds for ``random:<name>``
(Llama 3.2 1B, Llama 3.1 8B, Qwen2.5 1.5B, Mistral 7B v0.3), built in so that no network or cache is needed.

Plain data (no transformers import): the model registry reads ``RANDOM_CONFIGS`` (hub id -> config keyword
arguments, ``model_type`` included) to list the names without loading the family. Values are those of the released
``config.json`` files; rotary settings use transformers' ``rope_parameters``.
"""
from __future__ import annotations

_LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)

RANDOM_CONFIGS = {
    "meta-llama/Llama-3.2-1B": dict(
        model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, intermediate_size=8192, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
        hidden_act="silu", attention_bias=False, mlp_bias=False, tie_word_embeddings=True, bos_token_id=128000,
        eos_token_id=128001, rope_parameters=dict(_LLAMA3_ROPE, factor=32.0)),
    "meta-llama/Llama-3.1-8B": dict(
        model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
        hidden_act="silu", attention_bias=False, mlp_bias=False, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_id=128001, rope_parameters=dict(_LLAMA3_ROPE, factor=8.0)),
    "Qwen/Qwen2.5-1.5B": dict(
        model_type="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        intermediate_size=8960, vocab_size=151936, max_position_embeddings=131072, rms_norm_eps=1e-6,
        hidden_act="silu", tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643,
        use_sliding_window=False, rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
    "mistralai/Mistral-7B-v0.3": dict(
        model_type="mistral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=14336, vocab_size=32768, max_position_embeddings=32768, rms_norm_eps=1e-5,
        hidden_act="silu", tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, sliding_window=None,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
}
