"""fuseinfer: fused CUDA ops for Hugging Face decoder models (OPT; Llama, Mistral, Qwen2), applied in place and
reversibly.

    report = fuseinfer.patch(model)   # swaps modules, returns a PatchReport
    fuseinfer.unpatch(model)          # restores the original model exactly
    fuseinfer.patch(model, fuseinfer.PatchConfig(quant=fuseinfer.Int8WeightOnly()))  # int8 weights (W8A16)
"""
from fuseinfer.core.extension import cuda_extension_available, extension_status
from fuseinfer.core.config import OPS, PatchConfig, PatchReport, RuntimeConfig
from fuseinfer.core.errors import FuseInferError
from fuseinfer.patching import patch, unpatch
from fuseinfer.quant import Float8, Int8WeightOnly, QuantConfig, SmoothQuantW8A8, load_quantized, save_quantized
from fuseinfer.runtime import generate
from fuseinfer.runtime.prefill import prefill
from fuseinfer.core.state import patch_report, patch_state
from fuseinfer.core.version import __version__

from fuseinfer.quant.hf_quantizer import register as _register_quantizer  # noqa: E402  (quant_method "fuseinfer")

_register_quantizer()

__all__ = [
    "OPS", "Float8", "FuseInferError", "Int8WeightOnly", "PatchConfig", "PatchReport", "QuantConfig", "RuntimeConfig",
    "SmoothQuantW8A8", "cuda_extension_available", "extension_status", "generate", "load_quantized", "patch",
    "patch_report", "patch_state", "prefill", "save_quantized", "unpatch", "__version__",
]
