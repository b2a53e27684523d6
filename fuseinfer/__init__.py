"""fuseinfer: fused CUDA ops for Hugging Face OPT models, applied in place and reversibly.

    report = fuseinfer.patch(model)   # swaps modules, returns a PatchReport
    fuseinfer.unpatch(model)          # restores the original model exactly
"""
from ._ext import cuda_extension_available, extension_status
from .errors import FuseInferError
from .patching import OPS, PatchConfig, PatchReport, patch, patch_report, patch_state, unpatch
from .runtime import generate

__version__ = "0.1.0"

__all__ = [
    "OPS", "FuseInferError", "PatchConfig", "PatchReport", "cuda_extension_available", "extension_status",
    "generate", "patch", "patch_report", "patch_state", "unpatch", "__version__",
]
