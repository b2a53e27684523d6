"""SmoothQuant (Xiao et al. 2022): calibration, smoothing, and W8A8 linears.

W8A8 quantises activations per token and weights per output channel, both symmetric int8. Activation outliers
(a few channels whose magnitude is 100x the rest) wreck the per-token scale, so SmoothQuant moves that range into
the weights: for a linear y = x W^T with input channels j, ``x_j / s_j`` and ``W[:, j] * s_j`` give the same y, with

    s_j = max|X_j|^alpha / max|W[:, j]|^(1 - alpha)     (max|X_j| over calibration text, max|W| over the linears
                                                          that read x; clamped to >= 1e-5 as the paper's code does)

The division by s is folded into whatever produces x, so it costs nothing at run time (exact in real arithmetic):
into a LayerNorm's weight and bias, or into the output rows and bias of a linear whose output reaches x unchanged
up to a positive scale per channel (through ReLU, or as the values attention averages). Where it may fold is the
model family's knowledge (``ModelFamily.smoothing_groups``, e.g. ``fuseinfer/models/opt/quant.py``); a group the
model cannot take (a post-LN LayerNorm, whose output is also the residual stream; a non-ReLU activation) is listed
in :class:`SmoothReport` as skipped, with the reason.

Calibration (:func:`calibrate`): forward hooks on the unpatched model record max|x_j| at each linear's input over
``samples`` windows of ``seq_len`` tokens of calibration text, by default ``wiki.valid.raw`` from the WikiText-2
data directory (the validation split, never the test split the perplexity is measured on). The statistics save to
and load from safetensors (:meth:`CalibrationStats.save` / :meth:`CalibrationStats.load`).

Quantised execution: :class:`W8A8Linear` quantises its input per token and calls ``fuseinfer.ops.w8a8_linear`` (the
CUTLASS sm90 kernel on H100, ``torch._int_mm`` + rescale on other GPUs, the exact-integer reference on CPU, which
is the reference path CI measures perplexity with). :func:`w8a8_forward` is the call the fused modules make when
their int8 input comes from ``add_layer_norm_quant``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from fuseinfer.core.errors import FuseInferError
from fuseinfer.core.quant_config import check_alpha  # noqa: F401 (SmoothQuant's own check, kept with the config)
from fuseinfer.ops.w8a8_linear import OUT_DTYPES, w8a8_linear
from fuseinfer.ops.quant import quantize_int8_ref, quantize_int8_static, quantize_per_token
from fuseinfer.ops.w8a16_linear import w8a16_linear
from fuseinfer.layers.linear import ChannelScaledLinear, decode_rows

CALIBRATION_FILE = "wiki.valid.raw"
CALIBRATION_FLAG = "--calibration-data"  # the eval CLI's flag; the Python API's argument is ``calibration=``
DEFAULT_SAMPLES = 128
DEFAULT_SEQ_LEN = 512
MIN_SCALE = 1e-5  # the paper's clamp on max|X|, max|W| and s


# ----------------------------------------------------------------------------------------------------- calibration

@dataclass
class CalibrationStats:
    """Per input channel max|x| at each calibrated linear's input: module name -> (K,) fp32 (the first of the linears
    reading one input, e.g. the q projection's entry, serves the others, which read the same tensor)."""

    act_max: dict[str, torch.Tensor]
    samples: int
    seq_len: int
    source: str
    meta: dict = field(default_factory=dict)

    def save(self, path: str | os.PathLike) -> None:
        """One safetensors file: the maxima as tensors, samples / seq_len / source in its metadata. Written to a
        temporary name and renamed, so a failure leaves nothing half-written."""
        from safetensors.torch import save_file

        from fuseinfer.core.files import atomic_file

        meta = {"format": "fuseinfer-smoothquant-calibration", "version": "1", "samples": str(self.samples),
                "seq_len": str(self.seq_len), "source": self.source, "meta": json.dumps(self.meta)}
        with atomic_file(path, overwrite=True, flag="the calibration file") as tmp:
            save_file({k: v.detach().float().cpu().contiguous() for k, v in self.act_max.items()}, str(tmp), meta)

    @classmethod
    def load(cls, path: str | os.PathLike) -> CalibrationStats:
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise FuseInferError(f"calibration file {path} not found: calibrate first (fuseinfer.quant.smoothquant."
                                 f"calibrate(...).save(path)) or pass calibration text instead")
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != "fuseinfer-smoothquant-calibration":
                raise FuseInferError(f"{path} is not a fuseinfer SmoothQuant calibration file (no format marker)")
            act_max = {k: f.get_tensor(k) for k in f.keys()}
        return cls(act_max, int(meta["samples"]), int(meta["seq_len"]), meta["source"], json.loads(meta["meta"]))


def calibration_text(calibration: str | os.PathLike | None = None, data_dir: str | os.PathLike | None = None
                     ) -> tuple[str, str]:
    """(text, source): ``calibration`` a text file, or a folder holding wiki.valid.raw; else the WikiText-2
    validation split where :mod:`fuseinfer.core.data` finds it (``data_dir``, $FUSEINFER_DATA_DIR, the shared assets
    folder, ``datasets``). The rows are joined as the evaluation joins the test rows; never the test split."""
    from fuseinfer.core import data

    if calibration is None:
        try:
            found = data.load_text("valid", data_dir)
        except FuseInferError as exc:
            raise FuseInferError(f"no calibration data: pass {CALIBRATION_FLAG} (Python: calibration=) a text file "
                                 f"or a folder with {CALIBRATION_FILE}, or make the WikiText-2 validation split "
                                 f"findable ({exc})") from None
        return found.text, found.source
    path = Path(calibration).expanduser()
    if path.is_dir():
        path = path / CALIBRATION_FILE
    if not path.is_file():
        raise FuseInferError(f"calibration text {path} not found: pass {CALIBRATION_FLAG} (Python: calibration=) a "
                             f"text file or a folder with {CALIBRATION_FILE}")
    if path.name == data.split_file("test"):
        raise FuseInferError(f"{path} is the test split, which the perplexity is measured on: calibrate on "
                             f"{CALIBRATION_FILE} (the validation split) or other text")
    return "\n\n".join(data.rows_from_file(path)), str(path.resolve())


def calibration_samples(ids: torch.Tensor, samples: int, seq_len: int, source: str = "calibration text"
                        ) -> list[torch.Tensor]:
    """``samples`` windows (1, seq_len) of ids (1, T), evenly spread over the text, non-overlapping; fewer when the
    text holds fewer (a text shorter than one window is an error)."""
    if samples < 1 or seq_len < 2:
        raise FuseInferError(f"calibration needs samples >= 1 and seq_len >= 2, got {samples} and {seq_len}")
    total = ids.shape[1]
    if total < seq_len:
        raise FuseInferError(f"{source} has {total} tokens, shorter than one calibration sample of {seq_len}: pass "
                             f"longer text ({CALIBRATION_FLAG}) or a smaller --calibration-seq-len")
    windows = total // seq_len
    starts = [round(i * (windows - 1) / max(samples - 1, 1)) * seq_len for i in range(min(samples, windows))]
    return [ids[:, s:s + seq_len] for s in sorted(set(starts))]


def model_family(model, what: str = "SmoothQuant"):
    """The model family of ``model`` that can take ``what``, or a clear error."""
    from fuseinfer import models

    fam = models.family_of(model)
    if fam is None:
        raise FuseInferError(f"{what} supports {models.supported()} models, got {type(model).__name__}")
    fam.decoder_layers(model)  # (a model of the family without decoder layers: the family's error)
    return fam


def _linear_names(model) -> list[tuple[str, nn.Linear]]:
    """(name, module) of the linears whose input is calibrated: the first target of every smoothing group (whether
    or not this model can take it), in module order."""
    modules = dict(model.named_modules())
    keys = {g.targets[0] for g in model_family(model).smoothing_groups(model)}
    return [(n, m) for n, m in modules.items() if n in keys and isinstance(m, nn.Linear)]


@torch.no_grad()
def calibrate(model, tokenizer=None, calibration=None, *, samples: int = DEFAULT_SAMPLES,
              seq_len: int = DEFAULT_SEQ_LEN, data_dir=None, ids: torch.Tensor | None = None) -> CalibrationStats:
    """max|x_j| at each calibrated linear's input over the calibration windows, through forward hooks on the
    (unpatched) model. Text from ``calibration`` / ``data_dir`` (see :func:`calibration_text`), tokenized once
    with ``tokenizer``, or token ids ``ids`` (1, T) directly. The model is only run, never changed."""
    targets = _linear_names(model)
    if ids is None:
        if tokenizer is None:
            raise FuseInferError("calibrate needs the model's tokenizer (or token ids: ids=)")
        text, source = calibration_text(calibration, data_dir)
        ids = tokenizer(text, return_tensors="pt", verbose=False).input_ids
    else:
        source = "token ids"
    windows = calibration_samples(ids, samples, seq_len, source)
    device = next(model.parameters()).device
    act_max: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(module, inputs):
            x = inputs[0].detach()
            m = x.reshape(-1, x.shape[-1]).abs().amax(0).float()  # (K,)
            act_max[name] = m if name not in act_max else torch.maximum(act_max[name], m)
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in targets]
    try:
        for w in windows:
            model(input_ids=w.to(device))
    finally:
        for h in handles:
            h.remove()
    return CalibrationStats({k: v.cpu() for k, v in act_max.items()}, len(windows), seq_len, source,
                            {"model_type": model.config.model_type,
                             "layers": len(model_family(model).decoder_layers(model)[1])})


# ------------------------------------------------------------------------------------------------------- smoothing

@dataclass
class SmoothGroup:
    """One smoothing: input of ``targets`` (read by all of them) divided by s, folded into ``source``."""

    kind: str            # "layernorm" or "linear_rows"
    source: str          # module name: the LayerNorm, or the linear whose output rows are divided by s
    targets: list[str]   # linears whose input columns are multiplied by s
    stats_key: str       # CalibrationStats entry of that input


@dataclass
class SmoothReport:
    """What :func:`smooth` did: the groups smoothed, those skipped and why, and alpha."""

    alpha: float
    smoothed: list[SmoothGroup]
    skipped: list[tuple[str, str]]  # (input description, reason)
    factors: dict[str, torch.Tensor]  # stats_key -> s (K,)

    def summary(self) -> str:
        lines = [f"SmoothQuant alpha={self.alpha}: {len(self.smoothed)} inputs smoothed"]
        lines += [f"  skipped {what}: {why}" for what, why in self.skipped]
        return "\n".join(lines)


def smoothing_plan(model) -> tuple[list[SmoothGroup], list[tuple[str, str]]]:
    """The smoothing groups of ``model`` (its family's), and the inputs that cannot be smoothed (with the reason)."""
    groups, skipped = [], []
    for g in model_family(model).smoothing_groups(model):
        if g.skipped:
            skipped.append((g.what, g.skipped))
        else:
            groups.append(SmoothGroup(g.kind, g.source, list(g.targets), g.targets[0]))
    return groups, skipped


def smoothing_factors(act_max: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """s (K,) fp32 = max|X_j|^alpha / max|W[:, j]|^(1 - alpha) over the linears ``weights`` (each (N_i, K))."""
    w_max = torch.stack([w.detach().float().abs().amax(0) for w in weights]).amax(0)  # (K,)
    a = act_max.float().to(w_max.device).clamp_min(MIN_SCALE)
    s = a.pow(alpha) / w_max.clamp_min(MIN_SCALE).pow(1 - alpha)
    return s.clamp_min(MIN_SCALE)


@torch.no_grad()
def smooth(model, stats: CalibrationStats, alpha: float = 0.5) -> SmoothReport:
    """Fold the smoothing factors into ``model`` in place (see the module docstring). Every factor is computed and
    checked before the first parameter changes, so a bad input leaves the model untouched."""
    alpha = check_alpha(alpha)
    groups, skipped = smoothing_plan(model)
    modules = dict(model.named_modules())
    missing = sorted({g.stats_key for g in groups} - stats.act_max.keys())
    if missing:
        raise FuseInferError(f"the calibration statistics have no entry for {missing[0]} ({len(missing)} missing): "
                             f"they come from another model; calibrate this one")
    factors = {}
    for g in groups:
        weights = [modules[t].weight for t in g.targets]
        k = weights[0].shape[1]
        if stats.act_max[g.stats_key].shape != (k,):
            raise FuseInferError(f"calibration entry {g.stats_key} has shape {tuple(stats.act_max[g.stats_key].shape)}"
                                 f", the model's input has {k} channels: calibrate this model")
        factors[g.stats_key] = smoothing_factors(stats.act_max[g.stats_key], weights, alpha)
    for g in groups:
        s = factors[g.stats_key]
        src = modules[g.source]
        inv = (1.0 / s).to(src.weight.device)
        if g.kind == "layernorm":
            src.weight.mul_(inv.to(src.weight.dtype))
            if src.bias is not None:
                src.bias.mul_(inv.to(src.bias.dtype))
        else:  # the linear whose output rows feed the targets
            src.weight.mul_(inv.to(src.weight.dtype)[:, None])
            if src.bias is not None:
                src.bias.mul_(inv.to(src.bias.dtype))
        for t in g.targets:
            w = modules[t].weight
            w.mul_(s.to(device=w.device, dtype=w.dtype)[None, :])
    return SmoothReport(alpha, groups, skipped, factors)


# ---------------------------------------------------------------------------------------------- W8A8 execution

def w8a8_forward(x_int8, x_scale, w_int8, w_scale, bias=None, residual=None, activation: str = "none",
                 out_dtype: torch.dtype | None = None):
    """One W8A8 linear on already-quantised activations (the fused modules' call after ``add_layer_norm_quant``):
    ``act(x_int8 @ w_int8.T * x_scale * w_scale + bias + residual)``; out_dtype defaults to the bias's / residual's
    dtype, else fp16."""
    if out_dtype is None:
        ref = residual if residual is not None else bias
        out_dtype = ref.dtype if ref is not None else torch.float16
    return w8a8_linear(x_int8, x_scale, w_int8, w_scale, bias, residual, activation, out_dtype)


class W8A8Linear(ChannelScaledLinear):
    """An nn.Linear with int8 weights (per output channel, symmetric, round half to even) whose input is quantised
    per token at run time (dynamic), or with its static ``input_scale`` (ChannelScaledLinear). ``forward(x)``
    replaces the linear as is; ``fused(x, residual, activation)`` is the call the patched forwards make (the int8
    weight-only branch's ``fused_linear`` protocol), with the residual and ReLU in the GEMM epilogue;
    ``forward_quantized(x_q, x_scale, ...)`` takes activations already quantised by ``add_layer_norm_quant`` (the
    fused LayerNorm path)."""

    takes_int8 = True
    quantized_input = "int8"

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> W8A8Linear:
        q, scale = quantize_int8_ref(linear.weight.detach(), -1)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q, scale, bias)

    def dequantized_weight(self, dtype=torch.float32) -> torch.Tensor:
        return (self.weight_q.float() * self.weight_scale).to(dtype)

    def forward_quantized(self, x_q, x_scale, residual=None, activation: str = "none",
                          out_dtype: torch.dtype = torch.float16) -> torch.Tensor:
        """x_q (..., K) int8, x_scale (..., 1) fp32 -> (..., N) out_dtype."""
        bias = None if self.bias is None else self.bias.to(out_dtype)
        return w8a8_forward(x_q, x_scale, self.weight_q, self.weight_scale, bias, residual, activation, out_dtype)

    def fused(self, x: torch.Tensor, residual: torch.Tensor | None = None, activation: str = "none"):
        """act(x @ W.T + bias + residual) with x quantised per token first; x (..., K) -> (..., N) in x's dtype."""
        if x.dtype not in OUT_DTYPES:
            raise FuseInferError(f"W8A8Linear: input dtype must be one of {OUT_DTYPES}, got {x.dtype}")
        if decode_rows(x):  # decode on CUDA: the W8A16 GEMV on the same int8 weights (quant/linear.py DECODE_ROWS)
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return w8a16_linear(x, self.weight_q, self.weight_scale.view(-1), bias, residual, activation)
        q, s = self.quantize_input(x)  # (..., K) int8, (..., 1) fp32
        return self.forward_quantized(q, s, residual, activation, x.dtype)

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (..., K) fp16/bf16 -> (x_q (..., K) int8, x_scale (..., 1) fp32): with the static ``input_scale`` when
        there is one, else per token (the fuseinfer::quantize_int8 op)."""
        if self.input_scale is not None:
            q = quantize_int8_static(x, self.input_scale)
            return q, self.static_scales(q)
        return quantize_per_token(x)

    def extra_repr(self) -> str:
        how = "static input scale" if self.input_scale is not None else "per-token input scales"
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights and activations ({how})"


def quantize_linears_w8a8(model) -> list[str]:
    """Swap every decoder linear (``ModelFamily.quant_targets``) for a :class:`W8A8Linear`, in place; the names
    swapped. The reference path: the model's own forward runs unchanged (an activation stays a module). Not
    reversible by itself (the fused patch of the quant API keeps the originals)."""
    modules = dict(model.named_modules())
    names = [n for n in model_family(model).quant_targets(model) if isinstance(modules.get(n), nn.Linear)]
    if not names:
        raise FuseInferError("no decoder linears to quantize: is the model already quantized?")
    swaps = []
    for n in names:
        parent_name, _, child = n.rpartition(".")
        parent = model.get_submodule(parent_name)
        swaps.append((parent, child, W8A8Linear.from_linear(getattr(parent, child))))
    for parent, child, new in swaps:  # all built before the first swap
        setattr(parent, child, new)
    return names


def smoothquant_reference(model, stats: CalibrationStats | None, alpha: float = 0.5) -> SmoothReport | None:
    """The CPU reference of SmoothQuant W8A8, in place: smooth with ``stats`` (None: naive W8A8, no smoothing), then
    quantize every decoder linear (int8 weights per channel, activations per token at run time)."""
    report = smooth(model, stats, alpha) if stats is not None else None
    quantize_linears_w8a8(model)
    return report


# ------------------------------------------------------------------------------------------ the outlier test model

@torch.no_grad()
def add_outlier_channels(model, channels: int = 4, factor: float = 300.0, seed: int = 0) -> dict[str, list[int]]:
    """Give a pre-LN model activation outliers without changing its function: ``channels`` channels of the output
    of every LayerNorm that a smoothing group folds into are scaled up by ``factor`` (its weight and bias) and the
    matching input columns of the linears that read it down by ``factor``; fp32 logits stay equal up to rounding.
    Returns the chosen channels per LayerNorm (its qualified name; random, seeded)."""
    groups = [g for g in model_family(model, "add_outlier_channels").smoothing_groups(model) if g.kind == "layernorm"]
    cannot = next((g for g in groups if g.skipped), None)
    if cannot is not None:
        raise FuseInferError(f"add_outlier_channels needs a pre-LN model (the LayerNorm output must not be the "
                             f"residual): {cannot.what}: {cannot.skipped}")
    if factor <= 0:
        raise FuseInferError(f"factor must be > 0, got {factor}")
    modules = dict(model.named_modules())
    g = torch.Generator().manual_seed(seed)
    chosen = {}
    for group in groups:
        ln = modules[group.source]
        idx = torch.randperm(ln.weight.shape[0], generator=g)[:channels].sort().values
        ln.weight[idx] *= factor
        if ln.bias is not None:
            ln.bias[idx] *= factor
        for t in group.targets:
            modules[t].weight[:, idx] /= factor
        chosen[group.source] = idx.tolist()
    return chosen
