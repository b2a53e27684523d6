"""fuseinfer: fused CUDA ops for Hugging Face OPT models, applied in place and reversibly.

    report = fuseinfer.patch(model)   # swaps modules, returns a PatchReport
    fuseinfer.unpatch(model)          # restores the original model exactly
"""
from ._ext import cuda_extension_available, extension_status
from .config import OPS, PatchConfig, PatchReport
from .errors import FuseInferError
from .patching import patch, unpatch
from .runtime import generate
from .runtime.prefill import prefill
from .state import patch_report, patch_state

__version__ = "0.2.0"

__all__ = [
    "OPS", "FuseInferError", "PatchConfig", "PatchReport", "cuda_extension_available", "extension_status",
    "generate", "patch", "patch_report", "prefill", "patch_state", "unpatch", "__version__",
]
