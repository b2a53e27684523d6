"""Quantization for fuseinfer: configs for ``PatchConfig(quant=...)``, quantized modules, checkpoints.

    fuseinfer.patch(model, fuseinfer.PatchConfig(quant=fuseinfer.Int8WeightOnly()))   # W8A16
    fuseinfer.patch(model, fuseinfer.PatchConfig(quant=fuseinfer.Float8()))           # FP8 (e4m3) W8A8
    fuseinfer.save_quantized(model, "dir");  model = fuseinfer.load_quantized("dir", device="cuda")

See docs/quantization.md.
"""
from fuseinfer.core.quant_config import Float8, Int8WeightOnly, QuantConfig, SmoothQuantW8A8
from fuseinfer.quant import apply as _apply  # noqa: F401  (registers the schemes with the engine)

__all__ = ["Float8", "Int8WeightOnly", "QuantConfig", "SmoothQuantW8A8", "load_quantized", "save_quantized"]


def save_quantized(model, directory):
    """Write a quantized (patched) model to ``directory``: config.json (with the scheme) + model.safetensors."""
    from fuseinfer.quant.checkpoint import save_quantized as save

    return save(model, directory)


def load_quantized(directory, device=None, model=None, ops=None):
    """Build the model saved by ``save_quantized`` (no re-quantization) on ``device`` (default: the CPU, or the
    given ``model``'s device); see ``fuseinfer.quant.loading``."""
    from fuseinfer.quant.loading import load_quantized as load

    return load(directory, device=device, model=model, ops=ops)
