"""The OPT model family (facebook/opt-125m ... opt-66b): the module swaps (``modules.py``), the fast-decode parts
(``decode.py``), the lean prefill loop (``lean.py``), the tensor-parallel plan (``tp.py``), the ONNX graph
(``export.py``) and what the feature packages need (``quant.py``, ``configs.py``) behind the
:class:`~fuseinfer.models.base.ModelFamily` interface."""
from __future__ import annotations

from fuseinfer.models.base import ModelFamily
from fuseinfer.models.opt import configs, decode as opt_decode, export as opt_export, lean, modules as opt, tp
from fuseinfer.models.opt import quant as opt_quant


class OPTFamily(ModelFamily):
    model_type = "opt"
    architectures = ("OPTForCausalLM", "OPTModel", "OPTForSequenceClassification", "OPTForQuestionAnswering")

    def __init__(self):
        self._rules = opt.OPTPatchRules()

    def patch(self, model, config, report):
        return self._rules.patch(model, config, report)

    def unpatch(self, model, state):
        self._rules.unpatch(model, state)

    def decode_forward(self, model):
        return opt_decode.decode_forward(model)

    def decode_step_kernel(self, model, cache):
        return opt_decode.decode_step_kernel(model, cache)

    # ---- what the feature packages need (quant, profile, the harness's random: configurations)

    qkv_names = opt_quant.QKV
    config_fields = ("model_type", "hidden_size", "num_hidden_layers", "ffn_dim", "num_attention_heads",
                     "vocab_size", "word_embed_proj_dim", "max_position_embeddings", "do_layer_norm_before",
                     "enable_bias", "layer_norm_elementwise_affine", "_remove_final_layer_norm")
    _MODULE_KINDS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "out_proj": "attn_out", "fc1": "mlp_in",
                     "fc2": "mlp_out", "activation_fn": "activation", "project_in": "projection",
                     "project_out": "projection", "lm_head": "lm_head"}

    def decoder_layers(self, model):
        return opt_quant.decoder_layers(model)

    def relink_qkv(self, attn):
        opt._link_qkv(attn)

    def quant_targets(self, model):
        return opt_quant.quant_targets(model)

    def smoothing_groups(self, model):
        return opt_quant.smoothing_groups(model)

    def intermediate_size(self, config):
        return config.ffn_dim

    def row_read_tensors(self, model):
        return [_positions(model)]

    def module_kinds(self):
        return dict(self._MODULE_KINDS)

    def random_configs(self):
        return configs.RANDOM_CONFIGS

    def config_class(self):
        from transformers import OPTConfig

        return OPTConfig

    # --- ONNX export (fuseinfer.export) ---
    def export_spec(self, model):
        return opt_export.spec(model)

    def export_config_fields(self):
        return opt_export.CONFIG_FIELDS

    def export_graph(self, model, ops):
        return opt_export.OPTStepGraph(model, ops)

    def ort_matmul_kinds(self):
        return dict(opt_export.ORT_MATMUL_KINDS)

    # ---- the runtime's lean prefill and tensor parallel ----

    def prefill_reason(self, model, weights=True):
        return lean.lean_reason(model, weights)

    def lean_logits(self, model, tokens, positions, key_mask=None, q_start=None, cache=None, slots=None, last=None):
        return lean.lean_logits(model, tokens, positions, key_mask, q_start, cache, slots, last)

    def lean_hidden(self, model, tokens, positions, key_mask=None, kv_out=None):
        return lean.lean_hidden(model, tokens, positions, key_mask, kv_out)

    def forward_positions(self, model, input_ids, attention_mask):
        if attention_mask is None:
            return super().forward_positions(model, input_ids, attention_mask)
        mask = attention_mask.long()
        return mask.cumsum(1) * mask - 1  # (B, S), -1 on padding, as OPTDecoder computes them

    def tp_reason(self, model, size):
        return tp.tp_reason(model, size)

    def tp_shard_spec(self, info):
        return tp.tp_shard_spec(info)

    def tp_prepare(self, model, info):
        tp.tp_prepare(model, info)

    def tp_finish(self, model, info, state, report):
        return tp.tp_finish(model, info, state, report)


def _positions(model):
    """OPT's learned position table (a decode step reads one row of it)."""
    base = getattr(model, "model", model)
    return base.decoder.embed_positions.weight
