"""SmoothQuant W8A8 (``SmoothQuantW8A8``) through ``patch``: calibrate, smooth, swap the linears, and undo it.

Runs after the model family's swaps (``patching.patch``), in this order, every check before the first change:

1. the calibration statistics: given (``CalibrationStats`` or a saved ``.safetensors``), or measured now with
   ``smoothquant.calibrate`` on calibration text. The fused forwards read the linears' weights instead of calling
   them, so the calibration hooks would see nothing; a no-op global module forward hook is registered meanwhile,
   under which every fused module runs its original forward, calling each ``nn.Linear`` (the q/k/v weights are
   views of the fused (3E, E) buffer, so the numbers are the same);
2. ``smoothquant.smooth`` (checks the statistics against the model first; only the groups the model can take, as
   ``smoothing_plan`` says); smoothing writes the q/k/v rows in place, so the (3E, E) buffer follows;
3. the linears of the swapped modules become :class:`~fuseinfer.quant.smoothquant.W8A8Linear` (int8 weights per
   output channel, activations quantized per token at run time), which ``fused_linear`` dispatches; the fused q/k/v
   becomes one (3E, E) W8A8Linear ``qkv_proj`` of the attention module, with :class:`W8A8QKVSlice` views in the
   places of its q/k/v projections (the family's ``qkv_names``).

``keep_original="cpu"`` keeps host copies of every tensor smoothing or quantization replaces (the LayerNorms', the
linears'), so ``unpatch`` restores the model bit for bit; otherwise ``unpatch`` refuses.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from fuseinfer.core.errors import FuseInferError
from fuseinfer.ops.w8a8_linear import w8a8_gemm_note
from fuseinfer.ops.quant import quantize_int8_ref, quantize_per_token
from fuseinfer.layers.linear import QuantizedLinear
from fuseinfer.quant.smoothquant import (
    CalibrationStats,
    SmoothReport,
    W8A8Linear,
    calibrate,
    model_family,
    smooth,
    smoothing_plan,
    w8a8_forward,
)
from fuseinfer.quant.weight_only import QuantEntry, QuantReport, WeightOnlyState, _placeholder, _targets


@dataclass
class W8A8Report(QuantReport):
    """``PatchReport.quant`` for SmoothQuant W8A8: the weights (as QuantReport), the smoothing, the calibration."""

    smoothing: SmoothReport | None = None
    calibration_source: str = ""
    calibration_samples: int = 0
    calibration_seconds: float = 0.0  # 0 when the statistics were given
    gemm: str = ""  # the GEMM the W8A8 linears run (ops.int8_gemm.w8a8_gemm_note), "" when not known yet


    def __str__(self) -> str:
        how = f"measured in {self.calibration_seconds:.2f} s" if self.calibration_seconds else "given"
        lines = [super().__str__()]
        if self.calibration_source:  # (none for a scheme without smoothing: Float8 with alpha=None)
            lines.append(f"  calibration: {self.calibration_samples} sample(s) from {self.calibration_source} ({how})")
        if self.smoothing is not None:
            lines += ["  " + line for line in self.smoothing.summary().splitlines()]
        if self.gemm:
            lines.append(f"  {self.gemm}")
        return "\n".join(lines)


class W8A8QKVSlice(nn.Module):
    """A q/k/v projection of an attention module whose q/k/v are one (3E, E) W8A8Linear (``qkv_proj``): rows
    [index * E, (index + 1) * E) of it, for the original forward (training mode, global hooks). No tensor of its
    own; ``weight`` / ``bias`` registered as None (see ``quant.linear.QKVSlice``)."""

    def __init__(self, qkv: W8A8Linear, index: int, embed_dim: int):
        super().__init__()
        object.__setattr__(self, "_qkv", qkv)  # a sibling, not a child
        self.index, self.embed_dim = index, embed_dim
        self.register_parameter("weight", None)
        self.register_parameter("bias", None)

    def forward(self, x):  # (..., E) -> (..., E)
        rows = slice(self.index * self.embed_dim, (self.index + 1) * self.embed_dim)
        q = self._qkv
        xq, xs = quantize_per_token(x)  # (..., E) int8, (..., 1) fp32
        bias = None if q.bias is None else q.bias[rows].to(x.dtype)
        return w8a8_forward(xq, xs, q.weight_q[rows], q.weight_scale[rows], bias, None, "none", x.dtype)

    def extra_repr(self) -> str:
        return f"rows {self.index * self.embed_dim}:{(self.index + 1) * self.embed_dim} of the W8A8 qkv_proj"


@contextlib.contextmanager
def _original_forwards():
    """Every fused module runs its original forward (calling its nn.Linear children) while a global module hook is
    registered; this one does nothing."""
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    try:
        yield
    finally:
        handle.remove()


def _tokenizer(model, config):
    if config.tokenizer is not None:
        return config.tokenizer
    path = getattr(getattr(model, "config", None), "name_or_path", "")
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise FuseInferError(f"calibration text needs the model's tokenizer, which could not be loaded from "
                             f"{path!r} ({type(exc).__name__}): pass SmoothQuantW8A8(tokenizer=...) or "
                             "calibration=CalibrationStats") from None


def _stats(model, config) -> tuple[CalibrationStats, float]:
    """(statistics, seconds spent calibrating; 0 when given)."""
    cal = config.calibration
    if isinstance(cal, CalibrationStats):
        return cal, 0.0
    if cal is not None and Path(cal).suffix == ".safetensors":
        return CalibrationStats.load(cal), 0.0
    from fuseinfer.quant.smoothquant import calibration_text

    calibration_text(cal)  # no calibration data: the error naming calibration=, before the tokenizer is loaded
    tok = _tokenizer(model, config)
    t0 = time.perf_counter()
    with _original_forwards(), torch.no_grad():
        stats = calibrate(model, tok, cal, samples=config.samples, seq_len=config.seq_len)
    return stats, time.perf_counter() - t0


def _kept(t: torch.Tensor | None, keep) -> torch.Tensor | None:
    return None if t is None or keep != "cpu" else t.detach().to("cpu", copy=True)


@dataclass
class W8A8State(WeightOnlyState):
    """WeightOnlyState's linears and q/k/v, plus the LayerNorm parameters smoothing changed: (param, kept copy)."""

    params: list = field(default_factory=list)

    def undo(self, model: nn.Module) -> None:
        self.check_undo()
        fam = model_family(model)
        for param, kept in self.params:  # every Parameter smoothing or quantization changed
            param.data = kept.to(param.device)
        for parent, attr, original, _, _ in reversed(self.linears):
            setattr(parent, attr, original)
        for attn, projs, _ in reversed(self.qkvs):
            attn._modules.pop("qkv_proj")
            q, k, v = projs
            bias = None if q.bias is None else torch.cat([q.bias, k.bias, v.bias])  # (3E,)
            attn.__dict__["qkv_weight"] = torch.cat([q.weight, k.weight, v.weight])
            attn.__dict__["qkv_bias"] = bias
            for name, proj in zip(fam.qkv_names, projs):
                setattr(attn, name, proj)
            fam.relink_qkv(attn)  # the projections' weights and biases become views of the buffers again


def _quantize(w: torch.Tensor, bias: torch.Tensor | None, empty: bool = False) -> W8A8Linear:
    """(N, K) weight -> W8A8Linear; with ``empty``, uninitialized tensors of its layout on w's device (what
    ``load_quantized`` fills from a checkpoint; w may be on the meta device)."""
    if empty:
        n, k = w.shape
        return W8A8Linear(torch.empty(n, k, dtype=torch.int8, device=w.device),
                          torch.empty(n, 1, dtype=torch.float32, device=w.device),
                          None if bias is None else torch.empty_like(bias))
    with torch.no_grad():
        q, scale = quantize_int8_ref(w.detach(), -1)  # (N, K) int8, (N, 1) fp32
    return W8A8Linear(q, scale, None if bias is None else bias.detach().clone())


@dataclass(frozen=True)
class Flavor:
    """What a scheme with per-token dynamic activations swaps in (the int8 W8A8 one here; FP8's in
    ``quant/fp8.py``): ``build(w, bias, empty)`` -> the quantized linear (``weight_q``, ``weight_scale`` (N, 1)),
    the q/k/v slice class and the note naming the GEMM it runs (``gemm_note(device, dtype)``)."""

    build: Callable
    slice_cls: type
    gemm_note: Callable


def quantize_w8a8(model: nn.Module, config, report, flavor: Flavor | None = None) -> W8A8State:
    """SmoothQuant W8A8 of the swapped modules' linears (see the module docstring); returns the state. ``flavor``
    (default: int8) picks the quantized linear; a config whose ``alpha`` is None is neither calibrated nor
    smoothed."""
    flavor = INT8 if flavor is None else flavor
    what = type(config).__name__
    for n, m in model.named_modules():
        if isinstance(m, (QuantizedLinear, W8A8QKVSlice)):
            raise FuseInferError(f"this model is already quantized ({n} is a {type(m).__name__}): load the "
                                 f"unquantized model to quantize it with {what}")
    fam = model_family(model, what)
    targets = _targets(model, config, report)
    if not targets:
        raise FuseInferError("nothing to quantize: the PatchConfig's ops and filter_fn left no decoder linear "
                             "patched; select at least one decoder layer or attention module")
    static = static_inputs(config, fam)
    if config._empty:  # the layout of a saved W8A8 model (checkpoint.load_quantized): no calibration, no smoothing
        return _empty_layout(model, config, targets, report, fam.qkv_names, flavor, static)
    keep = config.keep_original
    smoothing_on = config.alpha is not None
    stats, seconds = _stats(model, config) if smoothing_on or static else (None, 0.0)
    # every Parameter smoothing or quantization changes (LayerNorms, producing linears, quantized linears; the
    # q/k/v ones are views of the (3E, E) buffer, rebuilt from them on undo), kept before the first change
    kept_params = {}
    if keep == "cpu":
        modules = dict(model.named_modules())
        groups = smoothing_plan(model)[0] if smoothing_on else []
        owners = [modules[g.source] for g in groups] + [modules[n] for g in groups for n in g.targets]
        owners += [t.parent._modules[t.attr] for t in targets if t.attr]
        owners += [t.parent._modules[n] for t in targets if not t.attr for n in fam.qkv_names]
        for m in owners:
            for p in (m.weight, m.bias):
                if p is not None and id(p) not in kept_params:
                    kept_params[id(p)] = (p, _kept(p, keep))
    smoothing = smooth(model, stats, config.alpha) if smoothing_on else None
    qreport = W8A8Report(config.scheme, kept_original=keep, smoothing=smoothing,
                         calibration_source=stats.source if stats else "", calibration_samples=stats.samples
                         if stats else 0, calibration_seconds=seconds)
    state = W8A8State(config, params=list(kept_params.values()))
    for t in targets:
        w, bias = _target_weight(t)  # (N, K); q/k/v: (3E, E), smoothed in place through the q/k/v views
        new = flavor.build(w, bias)
        before = w.numel() * w.element_size()
        _swap_in(state, t, new, w, fam.qkv_names, flavor.slice_cls)
        if t.attr in static:
            new.set_input_amax(_input_amax(stats, smoothing, t.name))
        after = new.weight_q.numel() + 4 * new.weight_scale.numel()  # (1-byte weights: int8 or e4m3)
        qreport.entries.append(QuantEntry(t.name, tuple(new.weight_q.shape), before, after))
    qreport.gemm = flavor.gemm_note(w.device, w.dtype)
    report.quant = qreport
    return state


def _input_amax(stats: CalibrationStats, smoothing: SmoothReport | None, name: str) -> float:
    """max|x| over every channel of linear ``name``'s input in the calibration windows, as the quantized model sees
    it: smoothing divides input channel j by s_j (the factors of the group ``name`` is the first target of)."""
    if name not in stats.act_max:
        raise FuseInferError(f"the calibration statistics have no entry for {name}, whose input gets a static scale: "
                             "they come from another model; calibrate this one")
    amax = stats.act_max[name].float()  # (K,)
    factors = None if smoothing is None else smoothing.factors.get(name)
    if factors is not None:
        amax = amax / factors.float().to(amax.device)
    return float(amax.max()) if amax.numel() else 0.0


def _target_weight(t) -> tuple:
    """The weight and bias a target quantizes: a linear's, or an attention's fused q/k/v buffers."""
    if t.attr:
        lin = t.parent._modules[t.attr]
        return lin.weight, lin.bias
    return t.parent.qkv_weight, t.parent.qkv_bias


def _swap_in(state: W8A8State, t, new, w: torch.Tensor, qkv_names: tuple[str, ...],
             slice_cls: type = W8A8QKVSlice) -> None:
    """Put ``new`` in the target's place, remembered in ``state`` for unpatch: a linear, or the fused q/k/v of an
    attention (its projections ``qkv_names`` become slices of ``new``); the replaced tensors become placeholders."""
    if t.attr:
        lin = t.parent._modules[t.attr]
        state.linears.append((t.parent, t.attr, lin, None, False))
        setattr(t.parent, t.attr, new)
        lin.weight.data = _placeholder(w)
        return
    attn = t.parent
    projs = tuple(attn._modules[n] for n in qkv_names)
    state.qkvs.append((attn, projs, None))
    attn.qkv_proj = new
    embed = w.shape[0] // 3
    for i, (name, proj) in enumerate(zip(qkv_names, projs)):
        setattr(attn, name, slice_cls(new, i, embed))
        proj.weight.data = _placeholder(w)
        if proj.bias is not None:
            proj.bias.data = _placeholder(w)
    attn.__dict__["qkv_weight"] = None
    attn.__dict__["qkv_bias"] = None
    attn._fuseinfer_qkv_params = (None,) * 6


def _empty_layout(model: nn.Module, config, targets, report, qkv_names: tuple[str, ...], flavor: Flavor,
                  static: tuple[str, ...] = ()) -> W8A8State:
    """Swap in W8A8Linears with uninitialized tensors (and the q/k/v slices) as ``quantize_w8a8`` would, without
    calibrating or smoothing: a checkpoint's tensors (the smoothed LayerNorms and biases among them) are loaded
    into them next. The originals are freed (unpatch refuses)."""
    saved = SAVED.get(config.scheme, config.scheme)
    qreport = W8A8Report(config.scheme, kept_original=None, calibration_source=f"a saved {saved} checkpoint")
    state = W8A8State(config)
    for t in targets:
        w, bias = _target_weight(t)
        new = flavor.build(w, bias, empty=True)
        if t.attr in static:  # (the checkpoint holds the calibrated scale)
            new.input_scale = torch.empty(1, dtype=torch.float32, device=w.device)
        before = w.numel() * w.element_size()
        _swap_in(state, t, new, w, qkv_names, flavor.slice_cls)
        qreport.entries.append(QuantEntry(t.name, tuple(new.weight_q.shape), before,
                                          new.weight_q.numel() + 4 * new.weight_scale.numel()))
    report.quant = qreport
    return state


def static_inputs(config, family) -> tuple[str, ...]:
    """The linears that get a calibrated static input scale: with ``fc2_input="static"``, the MLP's output
    projection (the family's ``mlp_out`` modules), whose input is the activation's output; with
    ``out_proj_input="static"`` the attention's output projection (``attn_out``), whose input is the attention's."""
    kinds = {kind for kind, field in (("mlp_out", "fc2_input"), ("attn_out", "out_proj_input"))
             if getattr(config, field, "dynamic") == "static"}
    return tuple(name for name, kind in family.module_kinds().items() if kind in kinds)


SAVED = {"smoothquant_w8a8": "W8A8", "float8": "FP8"}  # (the patch report's name of a loaded scheme)
INT8 = Flavor(_quantize, W8A8QKVSlice, w8a8_gemm_note)
