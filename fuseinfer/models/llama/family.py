"""The Llama-architecture model families (Llama, Mistral, Qwen2): the module swaps (``modules.py``), the fast-decode
forward (``decode.py``), the lean prefill loop (``lean.py``) and what the feature packages need (``quant.py``,
``configs.py``) behind the :class:`~fuseinfer.models.base.ModelFamily` interface. One class per ``model_type``; they
differ only in the transformers classes they patch and the random: configurations they list."""
from __future__ import annotations

from fuseinfer.core.errors import FuseInferError
from fuseinfer.models.base import ModelFamily
from fuseinfer.models.llama import configs, decode as llama_decode, lean, modules as llama, quant as llama_quant
from fuseinfer.models.llama import export as llama_export


class LlamaFamily(ModelFamily):
    model_type = "llama"
    architectures = ("LlamaForCausalLM", "LlamaModel")

    def __init__(self):
        self._rules = llama.LlamaPatchRules()

    def patch(self, model, config, report):
        return self._rules.patch(model, config, report)

    def unpatch(self, model, state):
        self._rules.unpatch(model, state)

    def decode_forward(self, model):
        return llama_decode.decode_forward(model)

    def decode_step_kernel(self, model, cache):
        return llama_decode.decode_step_kernel(model, cache)

    # ---- what the feature packages need (quant, profile, the harness's random: configurations)

    qkv_names = llama.QKV.parts
    config_fields = ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "attention_bias", "mlp_bias",
                     "tie_word_embeddings")
    _MODULE_KINDS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "attn_out", "gate_proj": "mlp_in",
                     "up_proj": "mlp_in", "down_proj": "mlp_out", "act_fn": "activation", "lm_head": "lm_head"}

    def decoder_layers(self, model):
        return llama_quant.decoder_layers(model)

    def fused_weights(self, module):
        return tuple(g for g in getattr(module, "_groups", ()) if module.__dict__.get(g.weight) is not None)

    def relink_fused(self, module, fused):
        llama.link(module, fused)

    def relink_qkv(self, attn):
        llama.link(attn, llama.QKV)

    def quant_targets(self, model):
        return llama_quant.quant_targets(model)

    def smoothing_groups(self, model):
        raise FuseInferError(llama_quant.SMOOTHQUANT_REFUSAL)

    def init_buffers(self, model):
        llama.init_rotary(model)

    def row_read_tensors(self, model):
        """The input embedding table when the LM head does not share it: a decode step reads one row of it."""
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        if head is not None and head.weight is embed.weight:
            return []
        return [embed.weight]

    def intermediate_size(self, config):
        return config.intermediate_size

    def kv_layout(self, config):
        return config.num_key_value_heads, llama.head_dim_of(config)

    def module_kinds(self):
        return dict(self._MODULE_KINDS)

    def random_configs(self):
        return {name: {k: v for k, v in kwargs.items() if k != "model_type"}
                for name, kwargs in configs.RANDOM_CONFIGS.items() if kwargs["model_type"] == self.model_type}

    _config_class = "LlamaConfig"

    def config_class(self):
        import transformers

        return getattr(transformers, self._config_class)

    # --- ONNX export (fuseinfer.export) ---
    def export_spec(self, model):
        return llama_export.spec(model)

    def export_config_fields(self):
        return llama_export.CONFIG_FIELDS

    def export_graph(self, model, ops):
        return llama_export.LlamaStepGraph(model, ops)

    def ort_matmul_kinds(self):
        return dict(llama_export.ORT_MATMUL_KINDS)

    # ---- the runtime's lean prefill (``lean.py``)

    def prefill_reason(self, model, weights=True):
        return lean.lean_reason(model, weights)

    def lean_logits(self, model, tokens, positions, key_mask=None, q_start=None, cache=None, slots=None, last=None):
        return lean.lean_logits(model, tokens, positions, key_mask, q_start, cache, slots, last)

    def lean_hidden(self, model, tokens, positions, key_mask=None, kv_out=None):
        """The lean loop without a cache (check :meth:`prefill_reason` first): the final hidden states after the final
        RMSNorm for every position, (B, S, E) in the model's dtype. tokens, positions: (B, S) int64; key_mask: (B, S)
        bool or None; ``kv_out``: None, or a list to which each layer appends its (k, v), each (B, Hkv, S, D) in the
        model's dtype as transformers' DynamicCache holds them (k after the rotary embedding)."""
        return lean.lean_hidden(model, tokens, positions, key_mask, kv_out)

    # ---- tensor parallel (``tp.py``)

    def tp_reason(self, model, size):
        return _tp().tp_reason(model, size)

    def tp_shard_spec(self, info):
        return _tp().tp_shard_spec(info)

    def tp_prepare(self, model, info):
        _tp().tp_prepare(model, info)

    def tp_finish(self, model, info, state, report):
        return _tp().tp_finish(model, info, state, report)


def _tp():
    """The tensor-parallel plan (imports torch.distributed: loaded when a model is split)."""
    from fuseinfer.models.llama import tp

    return tp


_NO_LLAMA_BIAS_FIELDS = tuple(f for f in LlamaFamily.config_fields if f not in ("attention_bias", "mlp_bias"))


class MistralFamily(LlamaFamily):
    model_type = "mistral"
    architectures = ("MistralForCausalLM", "MistralModel")
    config_fields = _NO_LLAMA_BIAS_FIELDS
    _config_class = "MistralConfig"


class Qwen2Family(LlamaFamily):
    model_type = "qwen2"
    architectures = ("Qwen2ForCausalLM", "Qwen2Model")
    config_fields = _NO_LLAMA_BIAS_FIELDS
    _config_class = "Qwen2Config"
