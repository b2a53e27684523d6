"""Quantization configs: what ``PatchConfig(quant=...)`` takes (torchao's config-object style).

``QuantConfig`` is the common base. The configs are plain data: ``quant/apply.py`` maps each one to the code that
quantizes, which the patch engine calls once, after the model family's swaps (and ``state.undo(model)`` in
``unpatch`` before the family's undo).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from fuseinfer.core.errors import FuseInferError

KEEP_ORIGINAL = (None, "cpu")


def check_alpha(alpha) -> float:
    """SmoothQuant's migration strength: a number in [0, 1]."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= float(alpha) <= 1.0 \
            or math.isnan(float(alpha)):
        raise FuseInferError(f"SmoothQuant alpha must be a number in [0, 1] (0.5 is the paper's choice for OPT), "
                             f"got {alpha!r}")
    return float(alpha)


@dataclass(frozen=True)
class QuantConfig:
    """Base of the quantization schemes (each registered in ``quant/apply.py``).

    include_lm_head: also quantize the LM head (off by default: OPT ties it to the input embeddings, which stay in
      the model's dtype, so quantizing it adds an int8 copy instead of saving memory; it still halves the bytes a
      decode step reads for it).
    keep_original: ``None`` (default) frees the original weights, so ``unpatch`` cannot restore them and refuses;
      ``"cpu"`` keeps a bit-exact copy of every replaced weight in host memory (2 bytes per fp16 weight quantized:
      2.6 GB for OPT-1.3b) so that ``unpatch`` restores the model exactly.
    """

    include_lm_head: bool = False
    keep_original: str | None = None
    # internal: build the quantized layout with empty int8 / scale tensors instead of quantizing (load_quantized and
    # random_init fill them; the engine then accepts a model on the meta device)
    _empty: bool = field(default=False, repr=False, compare=False)

    scheme = ""  # the name checkpoints record

    def __post_init__(self):
        if not isinstance(self.include_lm_head, bool):
            raise FuseInferError(f"include_lm_head must be True or False, got {self.include_lm_head!r}")
        if self.keep_original not in KEEP_ORIGINAL:
            raise FuseInferError(f"keep_original must be None (free the originals; unpatch then refuses) or 'cpu' "
                                 f"(keep a copy in host memory so unpatch restores them), got {self.keep_original!r}")

    def describe(self) -> dict:
        """What a checkpoint's config.json records about the scheme."""
        return {"scheme": self.scheme, "include_lm_head": self.include_lm_head}


@dataclass(frozen=True)
class Int8WeightOnly(QuantConfig):
    """W8A16: decoder linears (q/k/v fused, the attention output and MLP projections; the LM head with
    ``include_lm_head``) stored as int8 (N, K) with one fp32 scale per output channel, symmetric (``scale =
    max|w_row| / 127``, ``q = round(w / scale)`` clamped to [-127, 127], rounding half to even as ``torch.round``);
    activations stay in the model's dtype. Decode (<= 16 tokens) runs a GEMV that streams the int8 weights; prefill
    dequantizes each weight to the model's dtype and runs the fp16/bf16 GEMM (``fuseinfer/ops/w8a16_linear.py``)."""

    scheme = "int8_weight_only"

    def describe(self) -> dict:
        return {**super().describe(), "bits": 8, "symmetric": True, "granularity": "per_output_channel",
                "scale_dtype": "float32", "rounding": "half_to_even", "weight_layout": "int8 (N, K), scale (N,)",
                "qkv": "fused (3E, E) when patch fuses q/k/v"}


@dataclass(frozen=True)
class SmoothQuantW8A8(QuantConfig):
    """W8A8 with SmoothQuant (Xiao et al. 2022; ``fuseinfer/quant/smoothquant.py``): the decoder linears (q/k/v, the
    attention output and MLP projections) get int8 weights (per output channel, symmetric) and int8 activations (per
    token, dynamic), after the activation outliers are moved into the weights by the smoothing factors ``s_j =
    max|X_j|^alpha / max|W[:, j]|^(1 - alpha)`` (folded into the LayerNorms / producing linears).

    alpha: migration strength in [0, 1] (0.5, the paper's choice for OPT; 0 = no smoothing, naive W8A8).
    calibration: the activation maxima: a ``CalibrationStats`` (``smoothquant.calibrate``), a path to saved stats
      (``*.safetensors``), a calibration text file or a folder holding wiki.valid.raw; None: wiki.valid.raw where
      ``fuseinfer.core.data`` finds it ($FUSEINFER_DATA_DIR, the shared assets folder, ``datasets``). Text is
      calibrated on the model at ``patch`` time (``samples`` windows of ``seq_len`` tokens).
    tokenizer: the tokenizer for calibration text; None loads the model's own (``config.name_or_path``).
    fc2_input: ``"dynamic"`` (default: fc2's input, the MLP activation's output, quantized per token at run time)
      or ``"static"``: one calibrated per-tensor scale per layer for it (``amax / 127`` over the calibration
      windows, after smoothing), so that the MLP's first GEMM writes fc2's int8 input from its epilogue at prefill
      (ReLU first; 1 byte per element instead of 2, no quantization pass); values above the calibrated range
      saturate.
    out_proj_input: the same choice for the attention output projection's input: ``"static"`` makes the attention
      kernel write out_proj's int8 input from its epilogue at prefill (no fp16 attention output, no quantization
      pass).
    """

    alpha: float = 0.5
    calibration: object = None
    samples: int = 128
    seq_len: int = 512
    tokenizer: object = field(default=None, repr=False, compare=False)
    fc2_input: str = "dynamic"
    out_proj_input: str = "dynamic"

    scheme = "smoothquant_w8a8"

    def __post_init__(self):
        super().__post_init__()
        check_alpha(self.alpha)
        _check_calibration(self)
        _check_static_inputs(self, STATIC_INPUT_FIELDS)
        if self.include_lm_head:
            raise FuseInferError("SmoothQuantW8A8 quantizes the decoder linears only (the LM head's input is the "
                                 "final LayerNorm's, not calibrated): use include_lm_head=False")

    def describe(self) -> dict:
        return {**super().describe(), "bits": 8, "alpha": self.alpha, "weights": "int8 per output channel, symmetric",
                "activations": "int8 per token, dynamic, symmetric" + _static_described(self, 127),
                "fc2_input": self.fc2_input, "out_proj_input": self.out_proj_input,
                "qkv": "fused (3E, E) when patch fuses q/k/v"}


def _check_calibration(config) -> None:
    """The calibration fields of a smoothing scheme (SmoothQuantW8A8, Float8): samples, seq_len, calibration."""
    what = type(config).__name__
    for name in ("samples", "seq_len"):
        v = getattr(config, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "samples" else 2):
            raise FuseInferError(f"{what} {name} must be an integer >= {1 if name == 'samples' else 2}, got {v!r}")
    # (CalibrationStats lives in the quantization package, a layer above: checked by name)
    stats = type(config.calibration).__name__ == "CalibrationStats"
    if config.calibration is not None and not (isinstance(config.calibration, (str, os.PathLike)) or stats):
        raise FuseInferError(f"{what} calibration= must be None (the WikiText-2 validation split), a text file / "
                             f"folder / saved-stats path, or a CalibrationStats, got "
                             f"{type(config.calibration).__name__}")


STATIC_INPUT_MODES = ("dynamic", "static")  # the choices of the STATIC_INPUT_FIELDS (Float8, SmoothQuantW8A8)
STATIC_INPUT_FIELDS = ("fc2_input", "out_proj_input")


def _static_described(config, qmax: int) -> str:
    """The describe() note of a scheme's static inputs ("" when every input is dynamic)."""
    return "".join(f"; {what} input per tensor, static (calibrated), scale = amax / {qmax}"
                   for what, mode in (("out_proj's", config.out_proj_input), ("fc2's", config.fc2_input))
                   if mode == "static")


def _check_static_inputs(config, fields: tuple[str, ...]) -> None:
    """Each of ``fields`` one of STATIC_INPUT_MODES, else one clear error."""
    for name in fields:
        if getattr(config, name) not in STATIC_INPUT_MODES:
            raise FuseInferError(f"{type(config).__name__} {name} must be one of {STATIC_INPUT_MODES} (per-token "
                                 f"scales at run time, or one calibrated scale per layer), got "
                                 f"{getattr(config, name)!r}")


@dataclass(frozen=True)
class Float8(QuantConfig):
    """FP8 W8A8 (e4m3, ``fuseinfer/quant/fp8.py``): the decoder linears (q/k/v, the attention output and MLP
    projections) get float8_e4m3fn weights with one fp32 scale per output channel (``scale = max|w_row| / 448``)
    and float8_e4m3fn activations quantized per token at run time (dynamic, ``scale = max|x_row| / 448``). OPT
    models.

    alpha: None (default: no smoothing, no calibration) or SmoothQuant's migration strength in [0, 1], which
      smooths the activation outliers into the weights first, exactly as ``SmoothQuantW8A8`` does (same
      calibration sources: ``calibration``, ``samples`` windows of ``seq_len`` tokens, ``tokenizer``).
    fc2_input: ``"dynamic"`` (default: fc2's input, the MLP activation's output, quantized per token at run time,
      as every other linear's) or ``"static"``: one per-tensor scale per layer for it, calibrated (``amax / 448``
      over the calibration windows, the same sources as ``alpha``), so that the MLP's first GEMM writes fc2's e4m3
      input straight from its epilogue (1 byte per element instead of 2, and no separate quantization pass); values
      above the calibrated range saturate at +-448 * scale.
    out_proj_input: the same choice for the attention output projection's input (the attention's output):
      ``"static"`` makes the attention kernel write it in e4m3 from its epilogue at prefill (one calibrated scale
      per layer; no fp16 attention output and no quantization pass).
    """

    alpha: float | None = None
    calibration: object = None
    samples: int = 128
    seq_len: int = 512
    tokenizer: object = field(default=None, repr=False, compare=False)
    fc2_input: str = "dynamic"
    out_proj_input: str = "dynamic"

    scheme = "float8"

    def __post_init__(self):
        super().__post_init__()
        if self.alpha is not None:
            check_alpha(self.alpha)
        _check_calibration(self)
        _check_static_inputs(self, STATIC_INPUT_FIELDS)
        if self.include_lm_head:
            raise FuseInferError("Float8 quantizes the decoder linears only for now (OPT ties the LM head to the "
                                 "input embeddings): use include_lm_head=False")

    def describe(self) -> dict:
        return {**super().describe(), "bits": 8, "alpha": self.alpha, "format": "float8_e4m3fn",
                "weights": "e4m3 per output channel, scale = amax / 448",
                "activations": "e4m3 per token, dynamic, scale = amax / 448" + _static_described(self, 448),
                "fc2_input": self.fc2_input, "out_proj_input": self.out_proj_input,
                "qkv": "fused (3E, E) when patch fuses q/k/v"}


# config class -> the function that applies it: quantize(config, model, report) -> undo state. The quantization
# package registers its schemes when it is imported (``import fuseinfer`` imports it), so the engine, a layer below
# it, applies a scheme without importing the package that implements it.
_APPLIERS: dict = {}


def register_scheme(config_cls: type, apply) -> None:
    """Make ``apply(config, model, report)`` the quantizer of ``config_cls`` configs."""
    _APPLIERS[config_cls] = apply


def apply_scheme(config: "QuantConfig", model, report):
    """Quantize a model its family has just patched with ``config``'s registered scheme."""
    apply = _APPLIERS.get(type(config))
    if apply is None:
        raise FuseInferError(f"no quantizer for {type(config).__name__}; choose from "
                             f"{', '.join(sorted(c.__name__ for c in _APPLIERS)) or 'none (import fuseinfer.quant)'}")
    return apply(config, model, report)
