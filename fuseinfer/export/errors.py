"""The error the export CLI and runtimes turn into one line: bad model, existing output, missing package."""
from fuseinfer.core.errors import FuseInferError


class ExportError(FuseInferError):
    """Unsupported model, output that exists, missing onnxruntime / TensorRT, stale export: the message says
    what to do instead."""
