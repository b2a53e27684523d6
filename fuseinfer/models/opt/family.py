"""The OPT model family (facebook/opt-125m ... opt-66b): ``opt.py``'s module swaps and ``opt_decode.py``'s
fast-decode parts behind the :class:`~fuseinfer.models.base.ModelFamily` interface."""
from __future__ import annotations

from fuseinfer.models.opt import modules as opt, decode as opt_decode
from fuseinfer.models.base import ModelFamily
from fuseinfer.models.opt import export as opt_export  # ONNX export


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

    # --- ONNX export (fuseinfer.export) ---
    def export_spec(self, model):
        return opt_export.spec(model)

    def export_config_fields(self):
        return opt_export.CONFIG_FIELDS

    def export_graph(self, model, ops):
        return opt_export.OPTStepGraph(model, ops)

    def ort_matmul_kinds(self):
        return dict(opt_export.ORT_MATMUL_KINDS)
