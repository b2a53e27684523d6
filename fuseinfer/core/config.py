"""The shared types of patching: what to patch (:class:`PatchConfig`), how the patched model runs
(:class:`RuntimeConfig`, which a PatchConfig carries) and what was done (:class:`PatchReport`, :class:`Swap`), with
the op names and the attention implementation's name.

Kept apart from the engine (``patching``) so that the model families (``patches/``), the runtime and the feature
packages import them without importing the engine, and nothing imports in a cycle.
"""
from __future__ import annotations

import collections
import pickle
from dataclasses import dataclass, field, fields
from typing import Callable

import torch
from torch import nn

from fuseinfer.core import knobs
from fuseinfer.core.extension import extension_status
from fuseinfer.core.errors import FuseInferError
from fuseinfer.core.quant_config import QuantConfig

OPS = ("layer_norm", "linear", "qkv", "attention")
ATTN_NAME = "fuseinfer"  # the attention implementation patch registers with transformers (patches/hf_attention.py)
REFERENCES_ONLY = ("no fuseinfer CUDA kernel runs for this model (it is on the CPU, or the extension is not built "
                   "for this GPU): every op runs its PyTorch reference, which is correct but slower than the unpatched "
                   "model; for speed, put the model on a CUDA GPU with the extension built "
                   "(pip install --no-build-isolation -e .)")
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# what runs the attention op (patches/attention_backend.py, docs/attention_backends.md)
ATTENTION_BACKENDS = ("auto", "fuseinfer", "flash_attn", "sdpa")
DECODE_KERNELS = ("auto", "on", "off")  # RuntimeConfig.decode_kernel
PREFILL_MODES = ("auto", "graph", "lean", "module")  # RuntimeConfig.prefill (docs/prefill.md)
KV_CACHE_DTYPES = ("auto", "fp8")  # RuntimeConfig.kv_cache (docs/quantization.md)


def _from_knob(name: str, convert=lambda value: value):
    """A field whose default is the knob ``name`` (its built-in default when unset), read when the config is
    built and turned into the field's type by ``convert``; a bad value is the knob's error (it names the knob)."""
    read = knobs.get_int if name == "FUSEINFER_DECODE_GRAPH_STEPS" else knobs.get
    return field(default_factory=lambda: convert(read(name)), metadata={"knob": name})


def _switch(value: str) -> bool:  # a "0" / "1" knob
    return value == "1"


def _decode_kernel(value: str) -> str:  # FUSEINFER_DECODE_KERNEL's auto / 1 / 0
    return {"1": "on", "0": "off"}.get(value, value)


@dataclass(frozen=True)
class RuntimeConfig:
    """How a patched model runs (fast decode and its prefill), carried by ``PatchConfig(runtime=...)``.

    Each field left out takes the value of its ``FUSEINFER_*`` environment variable when the config is built (the
    variable is a default only; docs/env.md), else the built-in default below; a field given here wins.

    decode_kernel: fast decode's step as one persistent kernel: ``auto`` where measured faster (OPT: 1-2 rows; int8
      weight-only models up to hidden size 2048; the Llama family: nowhere, per op was faster at every batch),
      ``on`` wherever it applies, ``off`` never (the per-op step).
    cuda_graphs: fast decode replays its step (and ``prefill='auto'`` / ``'graph'`` its prefill) as CUDA graphs;
      False runs them eagerly.
    graph_steps: decode steps in fast decode's longer CUDA graph (1: one step per replay).
    prefill: fast decode's prefill and the patched model's own forward (docs/prefill.md): ``auto`` (CUDA graphs
      per prompt-length bucket up to a measured size, else the lean layer loop), ``graph`` (graphs wherever they
      apply), ``lean`` (the loop, no graphs) or ``module`` (the patched modules).
    tp_graphs: a tensor-parallel model's decode step is captured as CUDA graphs (False: eager, e.g. when an NCCL
      all-reduce cannot be captured).
    kv_cache: fast decode's static KV cache: ``auto`` (the model's dtype) or ``fp8`` (keys and values as float8
      e4m3 with an fp32 scale per layer and key/value head, set at each prompt's prefill; any weight scheme; the
      one-kernel decode step reads it with fp16/bf16 weights, 8-bit-weight models decode per op;
      docs/quantization.md).
    """

    decode_kernel: str = _from_knob("FUSEINFER_DECODE_KERNEL", _decode_kernel)
    cuda_graphs: bool = _from_knob("FUSEINFER_CUDA_GRAPHS", _switch)
    graph_steps: int = _from_knob("FUSEINFER_DECODE_GRAPH_STEPS")
    prefill: str = _from_knob("FUSEINFER_PREFILL")
    tp_graphs: bool = _from_knob("FUSEINFER_TP_GRAPHS", _switch)
    kv_cache: str = _from_knob("FUSEINFER_KV_CACHE")

    def __post_init__(self):
        for name, choices in (("decode_kernel", DECODE_KERNELS), ("prefill", PREFILL_MODES),
                              ("kv_cache", KV_CACHE_DTYPES)):
            if getattr(self, name) not in choices:
                raise FuseInferError(f"RuntimeConfig.{name} must be one of {', '.join(choices)}, got "
                                     f"{getattr(self, name)!r}")
        for name in ("cuda_graphs", "tp_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise FuseInferError(f"RuntimeConfig.{name} must be True or False, got {getattr(self, name)!r}")
        steps = self.graph_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise FuseInferError(f"RuntimeConfig.graph_steps must be an integer >= 1, got {steps!r}")

    @staticmethod
    def knob_of(name: str) -> str:
        """The ``FUSEINFER_*`` variable that gives field ``name`` its default."""
        return next(f.metadata["knob"] for f in fields(RuntimeConfig) if f.name == name)


@dataclass(frozen=True)
class PatchConfig:
    """What to patch.

    ops: which fusions to apply, any of ``OPS``:
      ``layer_norm`` (residual add + LayerNorm), ``linear`` (GEMM with bias / ReLU / residual epilogues),
      ``qkv`` (q, k, v projections as one GEMM), ``attention`` (the ``"fuseinfer"`` attention implementation).
    filter_fn: ``(module, qualified_name) -> bool``, called for each candidate module (decoder layers, attention
      modules and the decoder's final LayerNorm); only those for which it returns True are swapped (torchao's
      ``filter_fn`` idea).
    attention_backend: what runs the ``attention`` op, one of ``ATTENTION_BACKENDS``: ``fuseinfer`` (our kernel),
      ``flash_attn`` (the flash-attn-4 package, ``pip install fuseinfer[flash-attn]``, where its API covers the call;
      else our kernel), ``sdpa`` (torch SDPA with a boolean mask), ``auto`` (our kernel, except the (phase, head dim)
      classes where a committed benchmark measured the package faster); see docs/attention_backends.md.
    quant: a quantization config (``fuseinfer.Int8WeightOnly()``, ``fuseinfer.SmoothQuantW8A8(...)``), or None.
    runtime: how the patched model runs (:class:`RuntimeConfig`: decode kernel, CUDA graphs, prefill path); default
      ``RuntimeConfig()``, built with the PatchConfig (so from the ``FUSEINFER_*`` variables set then).
    """

    ops: tuple[str, ...] = OPS
    filter_fn: Callable[[nn.Module, str], bool] | None = None
    attention_backend: str = "auto"
    quant: QuantConfig | None = None
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def __post_init__(self):
        if isinstance(self.ops, str):
            object.__setattr__(self, "ops", (self.ops,))
        if not isinstance(self.ops, (tuple, list, set, frozenset)):
            raise FuseInferError(f"PatchConfig.ops must be a tuple of op names from {list(OPS)}, got {self.ops!r}")
        unknown = [op for op in self.ops if op not in OPS]
        if unknown:
            raise FuseInferError(f"unknown op name(s) {unknown} in PatchConfig.ops; choose from {list(OPS)}")
        if self.filter_fn is not None and not callable(self.filter_fn):
            raise FuseInferError(f"PatchConfig.filter_fn must be a callable (module, name) -> bool, got "
                                 f"{self.filter_fn!r}; e.g. filter_fn=lambda module, name: 'layers.0.' not in name")
        if self.quant is not None and not isinstance(self.quant, QuantConfig):
            raise FuseInferError(f"PatchConfig.quant must be a quantization config such as fuseinfer.Int8WeightOnly(), "
                                 f"got {self.quant!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise FuseInferError(f"unknown PatchConfig.attention_backend {self.attention_backend!r}; choose from "
                                 f"{list(ATTENTION_BACKENDS)}, e.g. PatchConfig(attention_backend='flash_attn')")
        if not isinstance(self.runtime, RuntimeConfig):
            raise FuseInferError(f"PatchConfig.runtime must be a fuseinfer.RuntimeConfig, got {self.runtime!r}; e.g. "
                                 "PatchConfig(runtime=fuseinfer.RuntimeConfig(prefill='lean'))")

    def selects(self, module: nn.Module, name: str) -> bool:
        return self.filter_fn is None or bool(self.filter_fn(module, name))

    def __deepcopy__(self, memo):  # immutable: a deep copy of a patched model shares it
        return self

    def __reduce__(self):
        """Pickling (``torch.save`` of a patched model, which records its config) keeps ``filter_fn`` where it
        pickles; a lambda or local function does not, and is replaced by a stand-in that says so if called."""
        fn = self.filter_fn
        try:
            pickle.dumps(fn)
        except Exception:  # (pickle raises several types: PicklingError, AttributeError, TypeError)
            fn = _UnpickledFilter(repr(fn))
        return PatchConfig, (tuple(self.ops), fn, self.attention_backend, self.quant, self.runtime)


class _UnpickledFilter:
    """Stands in for a ``filter_fn`` that could not be pickled with its patched model (the swaps it chose are in
    the pickle; nothing calls it after loading)."""

    def __init__(self, what: str):
        self.what = what

    def __call__(self, module, name):
        raise FuseInferError(f"this PatchConfig was unpickled without its filter_fn {self.what}, which could not "
                             "be pickled; build a new PatchConfig to patch with it")


@dataclass
class Swap:
    """One module swapped: its name, the class it became, and the backend each of its ops runs on."""

    name: str
    old_class: str
    new_class: str
    ops: dict[str, str]  # op -> "cuda" | "reference"


@dataclass
class PatchReport:
    """What ``patch`` did: the swaps, what it skipped and why, and where the kernels run."""

    model_type: str
    swaps: list[Swap] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (name or op, reason)
    attn_implementation: tuple[str, str] | None = None  # (before, after)
    quant: object = None  # what PatchConfig.quant did (fuseinfer.quant.weight_only.QuantReport), or None
    placement: dict[str, str] = field(default_factory=dict)  # module -> device (accelerate) or tensor parallel
    attention_backends: dict[str, str] = field(default_factory=dict)  # phase (prefill/decode) -> what runs it
    extension: str = field(default_factory=extension_status)

    @property
    def backends(self) -> dict[str, set[str]]:
        """op -> the set of backends it runs on across all swaps."""
        out: dict[str, set[str]] = {}
        for swap in self.swaps:
            for op, backend in swap.ops.items():
                out.setdefault(op, set()).add(backend)
        return out

    def __str__(self) -> str:
        lines = [f"fuseinfer patch report ({self.model_type}; CUDA extension: {self.extension})"]
        if self.attn_implementation:
            lines.append(f"  attention implementation: {self.attn_implementation[0]!r} -> "
                         f"{self.attn_implementation[1]!r}")
        for phase, backend in self.attention_backends.items():
            lines.append(f"  attention {phase}: {backend}")
        lines.append(f"  swapped {len(self.swaps)} module(s):")
        width = max((len(s.name) for s in self.swaps), default=0)
        for s in self.swaps:
            ops = ", ".join(f"{op}={backend}" for op, backend in s.ops.items())
            lines.append(f"    {s.name:<{width}}  {s.old_class} -> {s.new_class}  [{ops}]")
        for what, why in self.skipped:
            lines.append(f"  skipped {what}: {why}")
        if self.quant is not None:
            lines.append(str(self.quant))
        if "tensor_parallel" in self.placement:
            lines.append(f"  tensor parallel: {self.placement['tensor_parallel']}")
        elif self.placement:
            counts = collections.Counter(self.placement.values())
            lines.append("  placement (accelerate): " + ", ".join(f"{n} module(s) on {dev}"
                                                                  for dev, n in sorted(counts.items())))
        if self.references_only:
            lines.append(f"  note: {REFERENCES_ONLY}")
        return "\n".join(lines)

    @property
    def references_only(self) -> bool:
        """Whether no swapped op runs a CUDA kernel (a CPU model, or no usable extension)."""
        return bool(self.swaps) and all(b != "cuda" for backends in self.backends.values() for b in backends)
