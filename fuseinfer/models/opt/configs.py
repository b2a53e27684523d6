"""The published facebook/opt-* configurations, built in so that ``random:opt-1.3b`` needs no network and no cache.

Plain data (no transformers import): the model registry reads ``RANDOM_CONFIGS`` to list the ``random:`` names
without loading the family; :meth:`OPTFamily.build_config` turns an entry into an ``OPTConfig``.
"""
from __future__ import annotations

# (hidden_size, num_hidden_layers, ffn_dim, num_attention_heads) of each published checkpoint
_SHAPES = {
    "opt-125m": (768, 12, 3072, 12),
    "opt-350m": (1024, 24, 4096, 16),
    "opt-1.3b": (2048, 24, 8192, 32),
    "opt-2.7b": (2560, 32, 10240, 32),
    "opt-6.7b": (4096, 32, 16384, 32),
    "opt-13b": (5120, 40, 20480, 40),
    "opt-30b": (7168, 48, 28672, 56),
    "opt-66b": (9216, 64, 36864, 72),
}
_COMMON = dict(
    vocab_size=50272, max_position_embeddings=2048, activation_function="relu", enable_bias=True,
    layer_norm_elementwise_affine=True, dropout=0.1, attention_dropout=0.0, layerdrop=0.0, init_std=0.02,
    pad_token_id=1, bos_token_id=2, eos_token_id=2, tie_word_embeddings=True, use_cache=True,
    _remove_final_layer_norm=False,
)


def _config_kwargs(short: str) -> dict:
    hidden, layers, ffn, heads = _SHAPES[short]
    post_ln = short == "opt-350m"  # the only post-LN OPT, with 512-wide word embeddings projected to 1024
    return dict(_COMMON, hidden_size=hidden, num_hidden_layers=layers, ffn_dim=ffn, num_attention_heads=heads,
                word_embed_proj_dim=512 if post_ln else hidden, do_layer_norm_before=not post_ln)


# hub id -> OPTConfig keyword arguments; the short name of ``random:<short>`` is the part after the '/'
RANDOM_CONFIGS = {f"facebook/{short}": _config_kwargs(short) for short in _SHAPES}
OPT_CONFIGS = RANDOM_CONFIGS  # the name the benchmarks and tools use
