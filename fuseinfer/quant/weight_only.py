"""W8A16 (``Int8WeightOnly``): replace the linears of the modules ``patch`` swapped by int8 ones, and undo it.

Runs after the model family's swaps (``patching.patch``). Plan first (which linears, every check), then change: a
config that selects nothing raises before anything is touched (the engine then undoes the family's swaps). Per
linear: ``quantize_per_channel`` (``fuseinfer/ops/quant.py``: CUDA kernel on GPU) gives int8 (N, K) and one fp32
scale per row; the ``nn.Linear`` is replaced in its parent by an :class:`Int8WeightOnlyLinear` holding them and the
original bias Parameter. A fused weight (the family's ``fused_weights``: the q/k/v ``qkv_weight``, (3E, E), built by
the family's patch; gate/up where a family fuses them) becomes one int8 (N, E) + (N,) scales in the module's child of
the fused weight's name (``qkv_proj``); its parts (the q/k/v projections) become :class:`QKVSlice` views of it. The
replaced fp16 weights are freed as each is done (peak: the model plus one weight's temporaries), after a copy to host
memory when ``keep_original="cpu"``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from fuseinfer import models
from fuseinfer.core.errors import FuseInferError
from fuseinfer.ops import quantize_per_channel
from fuseinfer.layers.linear import Int8WeightOnlyLinear, QKVSlice, QuantizedLinear


@dataclass
class QuantEntry:
    """One quantized weight: its name, shape, and bytes before / after (int8 + fp32 scales; a tied LM head keeps
    its original as the input embedding, so its 'before' is 0: quantizing it adds bytes)."""

    name: str
    shape: tuple[int, int]
    bytes_before: int
    bytes_after: int


@dataclass
class QuantReport:
    """What quantization did; ``PatchReport.quant``."""

    scheme: str
    entries: list[QuantEntry] = field(default_factory=list)
    kept_original: str | None = None

    @property
    def bytes_saved(self) -> int:
        return sum(e.bytes_before - e.bytes_after for e in self.entries)

    def __str__(self) -> str:
        keep = "originals kept on the CPU (unpatch restores them)" if self.kept_original else \
            "originals freed (unpatch refuses)"
        lines = [f"  quantized {len(self.entries)} weight(s) ({self.scheme}): {_size(self.bytes_saved)} saved; {keep}"]
        width = max((len(e.name) for e in self.entries), default=0)
        for e in self.entries:
            lines.append(f"    {e.name:<{width}}  {e.shape[0]}x{e.shape[1]}  {_size(e.bytes_before)} -> "
                         f"{_size(e.bytes_after)}")
        return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if abs(n) >= 2**20 else f"{n / 2**10:.1f} KiB"


@dataclass
class _Target:
    name: str  # qualified name of the linear, or of the module + "." + the fused weight's name (e.g. ".qkv_proj")
    parent: nn.Module
    attr: str  # the linear's attribute on parent; "" for a fused weight (e.g. q/k/v; parent holds it)
    tied: bool = False  # the weight is also another module's (LM head tied to the embeddings)
    fused: object = None  # the family's FusedWeight of a fused target


def _targets(model: nn.Module, config, report) -> list[_Target]:
    """The linears to quantize: those of the modules the family swapped (``report.swaps``, chosen by the
    PatchConfig's ops and filter_fn) and, with include_lm_head, the LM head."""
    out = []
    fam = models.family_of(model)
    for swap in report.swaps:
        module = model.get_submodule(swap.name)
        fused = fam.fused_weights(module)  # (the q/k/v of an attention, ...: each one tensor)
        for f in fused:
            out.append(_Target(f"{swap.name}.{f.name}".lstrip("."), module, "", fused=f))
        parts = {n for f in fused for n in f.parts}
        for attr, child in module.named_children():
            if type(child) is nn.Linear and attr not in parts:
                out.append(_Target(f"{swap.name}.{attr}".lstrip("."), module, attr))
    if config.include_lm_head:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if type(head) is not nn.Linear:
            raise FuseInferError(f"include_lm_head=True but this model's LM head is "
                                 f"{'missing' if head is None else type(head).__name__}, not an nn.Linear "
                                 "(a model without an LM head, e.g. OPTModel: use include_lm_head=False)")
        parent_name, _, attr = next(n for n, m in model.named_modules() if m is head).rpartition(".")
        embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        tied = embed is not None and embed.weight is head.weight
        out.append(_Target(f"{parent_name}.{attr}".lstrip("."), model.get_submodule(parent_name), attr, tied))
    return out


def _placeholder(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor standing in for a freed weight (same dtype and device)."""
    return torch.empty(0, dtype=t.dtype, device=t.device)


def _quantize(weight: torch.Tensor, empty: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) -> int8 (N, K), fp32 scales (N,); uninitialized tensors of those shapes when ``empty``."""
    if empty:
        return (torch.empty(weight.shape, dtype=torch.int8, device=weight.device),
                torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device))
    with torch.no_grad():
        q, scale = quantize_per_channel(weight)  # (N, K) int8, (N, 1) fp32
    return q, scale.reshape(-1)


def _kept(weight: torch.Tensor, keep: str | None) -> torch.Tensor | None:
    """A bit-exact host copy of ``weight`` (keep_original="cpu"), else None."""
    return weight.detach().to("cpu", copy=True) if keep == "cpu" else None


@dataclass
class WeightOnlyState:
    """What ``unpatch`` needs: per quantized linear (parent, attr, the original module, its kept weight or None);
    per fused q/k/v (attention, the original q/k/v modules, the kept (3E, E) weight or None)."""

    config: object
    linears: list = field(default_factory=list)  # (parent, attr, original nn.Linear, kept weight | None, tied)
    qkvs: list = field(default_factory=list)  # (module, its parts' nn.Linears, kept fused weight | None, FusedWeight)

    def check_undo(self) -> None:
        if self.config.keep_original is None:
            raise FuseInferError(
                f"this model was quantized ({self.config.scheme}) with keep_original=None, so its original weights "
                "are gone and unpatch cannot restore them: reload the model (e.g. from_pretrained), or patch with "
                f"{type(self.config).__name__}(keep_original='cpu') to be able to unpatch")

    def undo(self, model: nn.Module) -> None:
        """Put the original modules and weights back, bit for bit (FuseInferError first if they were not kept)."""
        self.check_undo()
        fam = models.family_of(model)
        for parent, attr, original, kept, tied in reversed(self.linears):
            current = parent._modules[attr]
            if not tied:
                original.weight.data = kept.to(current.qweight.device)
            setattr(parent, attr, original)
        for attn, projs, kept, fused in reversed(self.qkvs):
            qkv = attn._modules.pop(fused.name)
            attn.__dict__[fused.weight] = kept.to(qkv.qweight.device)
            attn.__dict__[fused.bias] = qkv.bias
            for name, proj in zip(fused.parts, projs):
                setattr(attn, name, proj)
            fam.relink_fused(attn, fused)  # the projections' weights and biases become views of the buffers again


def quantize_weight_only(model: nn.Module, config, report) -> WeightOnlyState:
    """Quantize the linears of the swapped modules of ``model`` (see the module docstring); returns the state."""
    targets = _targets(model, config, report)
    if not targets:
        raise FuseInferError(
            "nothing to quantize: the PatchConfig's ops and filter_fn left no decoder linear patched (see the patch "
            "report's skipped modules); select at least one decoder layer or attention module, or use "
            "include_lm_head=True")
    empty = config._empty
    keep = None if empty else config.keep_original
    qreport = QuantReport(config.scheme, kept_original=keep)
    state = WeightOnlyState(config)
    for t in targets:
        if t.attr:  # one nn.Linear
            lin = t.parent._modules[t.attr]
            w = lin.weight
            before = 0 if t.tied else w.numel() * w.element_size()  # (before its data is freed below)
            q, scale = _quantize(w, empty)
            new = Int8WeightOnlyLinear(q, scale, lin.bias)
            state.linears.append((t.parent, t.attr, lin, _kept(w, keep), t.tied))
            setattr(t.parent, t.attr, new)
            if not t.tied:
                lin.weight.data = _placeholder(w)  # frees it (the kept copy, if any, is in the state)
        else:  # a fused weight (e.g. the q/k/v of an attention module)
            attn, f = t.parent, t.fused
            w, bias = attn.__dict__[f.weight], attn.__dict__[f.bias]  # (N, E) (q/k/v: (3E, E)), (N,) or None
            q, scale = _quantize(w, empty)
            qkv = Int8WeightOnlyLinear(q, scale, bias)
            projs = tuple(attn._modules[n] for n in f.parts)
            state.qkvs.append((attn, projs, _kept(w, keep), f))
            setattr(attn, f.name, qkv)
            start = 0
            for name, proj in zip(f.parts, projs):  # (row counts may differ: grouped-query k / v)
                setattr(attn, name, QKVSlice(qkv, 0, proj.out_features, start))
                start += proj.out_features
                proj.weight.data = _placeholder(w)  # (views of the fused buffer: all must go to free it)
                if proj.bias is not None:
                    proj.bias.data = _placeholder(w)
            attn.__dict__[f.weight] = None
            attn.__dict__[f.bias] = None
            attn.__dict__[f.params] = (None,) * (2 * len(f.parts))  # what the link check compares the slices' with
            before = w.numel() * w.element_size()
        qreport.entries.append(QuantEntry(t.name, tuple(q.shape), before, q.numel() + 4 * scale.numel()))
    report.quant = qreport
    return state


def quantized_scheme(model: nn.Module) -> str | None:
    """The scheme of the quantized linears in ``model`` (e.g. 'int8_weight_only'), or None if it has none."""
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            return "int8_weight_only" if isinstance(m, Int8WeightOnlyLinear) else type(m).__name__
    return None
