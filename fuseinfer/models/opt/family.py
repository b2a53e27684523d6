"""The OPT model family (facebook/opt-125m ... opt-66b): the module swaps (``modules.py``), the fast-decode parts
(``decode.py``), the lean prefill loop (``lean.py``) and the tensor-parallel plan (``tp.py``) behind the
:class:`~fuseinfer.models.base.ModelFamily` interface."""
from __future__ import annotations

from fuseinfer.models.opt import modules as opt, decode as opt_decode, lean, tp
from fuseinfer.models.base import ModelFamily


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

    # ---- the runtime's lean prefill and tensor parallel ----

    def prefill_reason(self, model, weights=True):
        return lean.lean_reason(model, weights)

    def lean_logits(self, model, tokens, positions, key_mask=None, q_start=None, cache=None, slots=None, last=None):
        return lean.lean_logits(model, tokens, positions, key_mask, q_start, cache, slots, last)

    def tp_reason(self, model, size):
        return tp.tp_reason(model, size)

    def tp_shard_spec(self, info):
        return tp.tp_shard_spec(info)

    def tp_prepare(self, model, info):
        tp.tp_prepare(model, info)

    def tp_finish(self, model, info, state, report):
        return tp.tp_finish(model, info, state, report)
