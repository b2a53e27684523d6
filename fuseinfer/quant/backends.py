"""The quantized fuseinfer backends (``fuseinfer-w8a16``, ``fuseinfer-w8a8``, ``fuseinfer-w8a8-static``,
``fuseinfer-fp8``, ``fuseinfer-fp8-static``; registered by the eval CLI, found by the profiler): fuseinfer's backend
with int8 weight-only quantization (``PatchConfig(quant=Int8WeightOnly())``), SmoothQuant W8A8 (and
``SmoothQuantW8A8(fc2_input="static", out_proj_input="static")``) or FP8 W8A8 (``Float8()``, and
``Float8(fc2_input="static", out_proj_input="static")``), plus the bytes of their
weights: the eval's decode GB/s column counts the quantized model's bytes (``weight_bytes_per_token`` below, which
the eval uses for these rows), so it compares with the copy bandwidth as fp16's does."""
from __future__ import annotations

from fuseinfer.core.config import PatchConfig
from fuseinfer.core.quant_config import STATIC_INPUT_FIELDS, Float8, Int8WeightOnly, SmoothQuantW8A8
from fuseinfer.harness.backends import Backend, FuseInferBackend
from fuseinfer.ops.w8a8_linear import w8a8_gemm_note
from fuseinfer.quant.fp8 import fp8_note
from fuseinfer.patching import patch
from fuseinfer.runtime import release


STATIC_INPUTS = dict.fromkeys(STATIC_INPUT_FIELDS, "static")  # the "-static" backends' config fields


def weight_bytes_per_token(model) -> int:
    """Bytes of the tensors one decode step reads: every parameter and buffer once (shared ones once), all but the
    position table (one row of it is read) -- the eval's ModelStats rule, counted on the quantized model."""
    from fuseinfer.models import family_of

    seen, total = set(), 0
    skip = {t.data_ptr() for t in family_of(model).row_read_tensors(model)}
    for t in list(model.parameters()) + list(model.buffers()):
        if t.numel() == 0 or t.data_ptr() in seen or t.data_ptr() in skip:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


class FuseInferW8A16Backend(FuseInferBackend):
    """fuseinfer with int8 weights (per-output-channel fp32 scales), fp16 activations; W8A16 decode GEMV."""

    name = "fuseinfer-w8a16"
    summary = "fuseinfer.patch + Int8WeightOnly: int8 weights, W8A16 kernels; static cache + CUDA-graph decode"

    def quant_config(self):
        return Int8WeightOnly()

    def prepare(self):
        self.report = patch(self.model, PatchConfig(quant=self.quant_config()))
        self.decode = "not run"
        self.weight_bytes = weight_bytes_per_token(self.model)

    def close(self):
        """Release the runtime's cache and graphs and drop the model; no unpatch (the fp16 weights were freed, so
        unpatch refuses, and nothing needs the original model back)."""
        if self.model is not None:
            release(self.model)
        Backend.close(self)

    def details(self):
        quant = self.report.quant
        return {**super().details(), "quant_scheme": quant.scheme, "quantized_weights": len(quant.entries),
                "quant_bytes_saved": quant.bytes_saved, "weight_bytes_per_token": self.weight_bytes,
                "weight_bytes_per_token_fp": self.stats.weight_bytes_per_token}


class FuseInferW8A8Backend(FuseInferW8A16Backend):
    """fuseinfer with SmoothQuant W8A8 (alpha 0.5): int8 weights and per-token int8 activations.

    Calibration (the options ``calibration_data`` / ``calibration_samples``, the eval's ``--calibration-data`` /
    ``--calibration-samples``; unset, the knobs FUSEINFER_CALIBRATION_DATA / FUSEINFER_CALIBRATION_SAMPLES): a text
    file or a folder holding wiki.valid.raw (default: wiki.valid.raw in the option ``data_dir``, else where
    ``fuseinfer.core.data`` finds it: $FUSEINFER_DATA_DIR, the shared folder, ``datasets``), tokenized with the
    model's own tokenizer, ``samples`` windows of 512 tokens; or saved
    statistics (``.safetensors``). A ``random:`` model has no tokenizer (and its weights no meaning): it is
    calibrated on seeded random token ids instead, which the row's ``calibration_source`` says. The calibration
    time is measured apart from the load time and reported in details() (``calibration_seconds``)."""

    name = "fuseinfer-w8a8"
    summary = "fuseinfer.patch + SmoothQuantW8A8: int8 weights and activations (SmoothQuant alpha 0.5)"
    SEQ_LEN = 512

    def quant_config(self, calibration=None, samples: int | None = None):
        from fuseinfer.core import knobs

        options = self.options
        if samples is None:
            samples = options.calibration_samples or knobs.get_int("FUSEINFER_CALIBRATION_SAMPLES")
        if calibration is None:
            calibration = options.calibration_data or knobs.get("FUSEINFER_CALIBRATION_DATA") or options.data_dir
        return SmoothQuantW8A8(calibration=calibration, samples=samples)

    def prepare(self):
        import time

        import torch

        from fuseinfer.quant.smoothquant import calibrate

        config, self.calibration_seconds = self.quant_config(), None
        given = config.calibration
        if self.source.random_weights and not (isinstance(given, str) and given.endswith(".safetensors")):
            seq = min(self.SEQ_LEN, self.model.config.max_position_embeddings)
            gen = torch.Generator().manual_seed(self.seed)
            ids = torch.randint(0, self.model.config.vocab_size, (1, config.samples * seq), generator=gen)
            t0 = time.perf_counter()
            with torch.no_grad():
                stats = calibrate(self.model, ids=ids, samples=config.samples, seq_len=seq)
            self.calibration_seconds = time.perf_counter() - t0
            stats.source = f"random token ids (seed {self.seed}): a random-weight model has no tokenizer"
            config = self.quant_config(calibration=stats, samples=config.samples)
        self.report = patch(self.model, PatchConfig(quant=config))
        self.decode = "not run"
        self.weight_bytes = weight_bytes_per_token(self.model)

    def details(self):
        quant = self.report.quant
        seconds = self.calibration_seconds if self.calibration_seconds is not None else quant.calibration_seconds
        from fuseinfer.runtime.prefill import lean_reason, mode

        why = None if self.model is None else lean_reason(self.model)
        # the path fast decode's prefill takes (what the prefill column timed): the lean loop, as a CUDA graph per
        # prompt-length bucket where the model's RuntimeConfig.prefill allows, or the patched modules and why
        choice = mode(self.model)
        if choice == "module":
            path = "patched modules (RuntimeConfig(prefill='module'))"
        else:
            path = (f"lean loop (RuntimeConfig(prefill={choice!r}): graphs on CUDA up to the auto limit)"
                    if why is None else f"patched modules ({why})")
        param = None if self.model is None else next(self.model.parameters(), None)
        gemm = quant.gemm if param is None else w8a8_gemm_note(param.device, self.model.dtype)
        return {**super().details(), "prefill_path": path, "w8a8_gemm": gemm,
                "quant_alpha": quant.smoothing.alpha if quant.smoothing else None,
                "calibration_source": quant.calibration_source, "calibration_samples": quant.calibration_samples,
                "calibration_seconds": round(seconds, 3)}


class FuseInferW8A8StaticBackend(FuseInferW8A8Backend):
    """fuseinfer with SmoothQuant W8A8 and static (calibrated) per-tensor scales for the inputs no LayerNorm
    quantizes (``SmoothQuantW8A8(fc2_input="static", out_proj_input="static")``): the attention kernel writes
    out_proj's int8 input and the MLP's first GEMM fc2's, each from its epilogue. Calibrated as the
    ``fuseinfer-w8a8`` row is."""

    name = "fuseinfer-w8a8-static"
    summary = ("fuseinfer.patch + SmoothQuantW8A8(fc2_input='static', out_proj_input='static'): int8 weights and "
               "activations, out_proj's and fc2's inputs with calibrated per-tensor scales, written by the attention "
               "kernel's and the first MLP GEMM's epilogues")

    def quant_config(self, calibration=None, samples: int | None = None):
        w8a8 = super().quant_config(calibration, samples)
        return SmoothQuantW8A8(calibration=w8a8.calibration, samples=w8a8.samples, **STATIC_INPUTS)

    def details(self):
        return {**super().details(), **STATIC_INPUTS}


class FuseInferFP8Backend(FuseInferW8A16Backend):
    """fuseinfer with FP8 W8A8 (``Float8()``): e4m3 weights per output channel and e4m3 activations per token, no
    smoothing (no calibration); ``torch._scaled_mm`` on GPUs of compute capability >= 8.9."""

    name = "fuseinfer-fp8"
    summary = "fuseinfer.patch + Float8: e4m3 weights and activations (torch._scaled_mm on sm_89+)"

    def quant_config(self):
        return Float8()

    def details(self):
        return {**super().details(), "fp8_gemm": _fp8_gemm(self)}


class FuseInferFP8StaticBackend(FuseInferW8A8Backend):
    """fuseinfer with FP8 W8A8 and static (calibrated) per-tensor scales for the inputs no LayerNorm quantizes
    (``Float8(fc2_input="static", out_proj_input="static")``): the attention kernel writes out_proj's e4m3 input
    and the MLP's first GEMM fc2's, each from its epilogue. Calibrated as the ``fuseinfer-w8a8`` row is (the same
    options and knobs; a ``random:`` model on seeded random token ids); no smoothing."""

    name = "fuseinfer-fp8-static"
    summary = ("fuseinfer.patch + Float8(fc2_input='static', out_proj_input='static'): e4m3 weights and "
               "activations, out_proj's and fc2's inputs with calibrated per-tensor scales, written by the attention "
               "kernel's and the first MLP GEMM's epilogues")

    def quant_config(self, calibration=None, samples: int | None = None):
        w8a8 = super().quant_config(calibration, samples)
        return Float8(calibration=w8a8.calibration, samples=w8a8.samples, **STATIC_INPUTS)

    def details(self):
        details = super().details()
        details.pop("w8a8_gemm", None)
        return {**details, "fp8_gemm": _fp8_gemm(self), **STATIC_INPUTS}


def _fp8_gemm(backend) -> str:
    """The FP8 backends' ``fp8_gemm`` detail: the GEMM and prefill path on the model's device (the patch report's
    note when the model is gone)."""
    param = None if backend.model is None else next(backend.model.parameters(), None)
    return backend.report.quant.gemm if param is None else fp8_note(param.device, backend.model.dtype)


BACKENDS = (FuseInferW8A16Backend, FuseInferW8A8Backend, FuseInferW8A8StaticBackend, FuseInferFP8Backend,
            FuseInferFP8StaticBackend)
