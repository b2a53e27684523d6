"""The interface a model family implements so that the engine, the runtime and the feature packages can use it.

A family is the patch rules of one ``config.model_type`` (OPT; Llama, Mistral, Qwen2): which modules it swaps and how
to undo it, and the two pieces fast decode needs: a decode forward over fuseinfer's static KV cache, and optionally a
one-kernel decode step (both families have one: ``fuseinfer::opt_decode_step``, ``fuseinfer::llama_decode_step``).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from torch import nn

from fuseinfer.core.config import PatchConfig, PatchReport
from fuseinfer.core.errors import FuseInferError

# (model, tokens (B, S), positions (B, S), cache, q_start (B,)) -> fp32 logits of the last position (B, V)
DecodeForward = Callable[..., torch.Tensor]
# (tokens (B, 1), positions (B, 1), q_start (B,)) -> fp32 logits (B, V)
DecodeStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Smoothing:
    """One place SmoothQuant may move activation range into weights: the input of ``targets`` (linears that all read
    it; calibrated at ``targets[0]``) is divided by s, folded into ``source``."""

    kind: str                # "layernorm": s folds into its weight and bias; "linear_rows": into the output rows
    source: str              # qualified module name of the LayerNorm or linear that produces the input
    targets: tuple[str, ...]  # qualified names of the linears whose input columns are multiplied by s
    what: str                # the input, for reports: "<layer> q/k/v input"
    skipped: str = ""        # why it cannot be smoothed in this model; "" when it can

@dataclass(frozen=True)
class FusedWeight:
    """One weight ``patch`` concatenated from several linears of a module (e.g. q/k/v): the linears ``parts`` hold
    row views of the plain attributes ``weight`` / ``bias`` of the module's ``__dict__``; ``params`` names the
    attribute holding the Parameters linked to it. Weight-only quantization quantizes it as one tensor, into the
    module's child ``name``."""

    name: str
    weight: str
    bias: str
    parts: tuple[str, ...]
    params: str


# --- ONNX export (fuseinfer.export) ---
class AttentionProjections(NamedTuple):
    """What an export strategy needs of one self-attention module: its q, k, v projections (``nn.Linear``: E ->
    heads * head_dim for q, kv_heads * head_dim for k and v) and the head layout; ``scaling`` multiplies q (or
    Q K^T) before the softmax. ``kv_heads``: grouped-query attention's key/value heads (None: ``num_heads``);
    ``window``: a sliding window (query i sees keys i - window < j <= i; None: every earlier key)."""
    q: nn.Module
    k: nn.Module
    v: nn.Module
    num_heads: int
    head_dim: int
    scaling: float
    kv_heads: int | None = None
    window: int | None = None


@dataclass(frozen=True)
class ExportSpec:
    """The sizes an exported decoder graph's inputs and outputs have (and its manifest records)."""
    layers: int
    heads: int
    head_dim: int
    hidden: int
    vocab: int
    max_positions: int
    pad_token_id: int | None
    position_ids: str  # how the graph computes the position ids (for the manifest's reader)
    kv_heads: int | None = None  # the past / present tensors' heads (grouped-query attention); None: ``heads``

    @property
    def cache_heads(self) -> int:
        """The heads of the past / present tensors (B, cache_heads, P, head_dim)."""
        return self.kv_heads or self.heads


class ModelFamily(ABC):
    """Patch rules and fast-decode hooks of one model family."""

    model_type: str = ""
    architectures: tuple[str, ...] = ()  # the transformers classes the family patches

    @abstractmethod
    def patch(self, model: nn.Module, config: PatchConfig, report: PatchReport) -> dict:
        """Swap ``model``'s modules in place (already checked by the engine), record them in ``report``; returns
        what ``unpatch`` needs."""

    @abstractmethod
    def unpatch(self, model: nn.Module, state: dict) -> None:
        """Undo ``patch`` exactly, given what it returned."""

    @abstractmethod
    def decode_forward(self, model: nn.Module) -> tuple[DecodeForward | None, str | None]:
        """(the per-op decode forward of a patched model, None), or (None, why the model cannot take it)."""

    def decode_step_kernel(self, model: nn.Module, cache) -> tuple[DecodeStep | None, str | None]:
        """(a one-kernel decode step over ``cache``, None), or (None, why not); by default there is none. The step
        carries ``op``, the qualified name of the op it launches (the runtime names its decode path with it)."""
        return None, f"no one-kernel decode step for {self.model_type or type(self).__name__}"

    # ---- what the feature packages (quant, profile, the harness) need of a family; the defaults say it has none

    # an attention module's q/k/v projections, in the row order of the (3E, E) ``qkv_weight`` patch fuses them into
    qkv_names: tuple[str, ...] = ()
    # the config fields that fix the tensors' shapes: a quantized checkpoint loads only into a model agreeing on all
    config_fields: tuple[str, ...] = ("model_type",)

    def _unsupported(self, what: str) -> FuseInferError:
        return FuseInferError(f"{what} is not supported for {self.model_type or type(self).__name__} models")

    def decoder_layers(self, model: nn.Module) -> tuple[str, nn.ModuleList]:
        """(qualified name, the module list) of ``model``'s decoder layers; FuseInferError if it has none."""
        raise self._unsupported("finding the decoder layers")

    def relink_qkv(self, attn: nn.Module) -> None:
        """Make the q/k/v projections (``qkv_names``) of ``attn`` views of its fused ``qkv_weight`` / ``qkv_bias``
        again, after a quantizer put them back."""
        raise self._unsupported("fused q/k/v")

    def fused_weights(self, module: nn.Module) -> tuple[FusedWeight, ...]:
        """The fused weights of a module ``patch`` swapped (each quantizes as one tensor): the q/k/v ``qkv_weight``
        where the module has one, by default."""
        if isinstance(module.__dict__.get("qkv_weight"), torch.Tensor):
            return (FusedWeight("qkv_proj", "qkv_weight", "qkv_bias", self.qkv_names, "_fuseinfer_qkv_params"),)
        return ()

    def relink_fused(self, module: nn.Module, fused: FusedWeight) -> None:
        """Make ``fused.parts`` of ``module`` views of its fused tensors again, after a quantizer put them back."""
        self.relink_qkv(module)

    def quant_targets(self, model: nn.Module) -> list[str]:
        """Qualified names of every decoder linear a quantization scheme replaces, in module order."""
        raise self._unsupported("quantization")

    def smoothing_groups(self, model: nn.Module) -> list[Smoothing]:
        """Every SmoothQuant smoothing of ``model``, those it cannot take included (with ``skipped`` set)."""
        raise self._unsupported("SmoothQuant")

    def init_buffers(self, model: nn.Module) -> None:
        """Recompute the buffers no checkpoint holds (non-persistent, e.g. rotary tables) of a model whose tensors
        were allocated without values (``to_empty``) or are still on the meta device (then on the CPU). None by
        default."""

    def kv_layout(self, config) -> tuple[int, int]:
        """(key/value heads, head dim) of a layer's KV cache: the static caches the runtime allocates have this
        shape per row. Multi-head attention by default; grouped-query families have fewer key/value heads."""
        heads = config.num_attention_heads
        return heads, config.hidden_size // heads

    def intermediate_size(self, config) -> int:
        """The width of the MLP's hidden layer (the profiler's cost models read it)."""
        return config.intermediate_size

    def row_read_tensors(self, model: nn.Module) -> list[torch.Tensor]:
        """Tensors a decode step reads one row of, not whole (a learned position table): the eval's weight-bytes
        per token leaves them out. None by default."""
        return []

    def module_kinds(self) -> dict[str, str]:
        """Module attribute name -> the profiler's kind of range for it: "qkv", "attn_out", "mlp_in", "mlp_out",
        "activation", "projection", "lm_head" (decoder layers, attention modules, LayerNorms and embeddings are
        named by class)."""
        return {}

    def random_configs(self) -> dict[str, dict]:
        """The published configurations behind ``random:<name>``: hub id -> config keyword arguments."""
        return {}

    def config_class(self) -> type:
        """The transformers configuration class of the family."""
        raise self._unsupported("building a configuration")

    def build_config(self, name: str):
        """The configuration of ``random_configs()[name]`` (a hub id)."""
        table = self.random_configs()
        if name not in table:
            raise FuseInferError(f"unknown {self.model_type} configuration {name!r}; choose from {sorted(table)}")
        return self.config_class()(**table[name])

    def empty_model(self, config, dtype: torch.dtype) -> nn.Module:
        """A causal LM of ``config`` with every tensor on the meta device (nothing allocated), in eval mode."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        return model.eval()

    # --- ONNX export (fuseinfer.export) ---
    def export_spec(self, model: nn.Module) -> ExportSpec:
        """The sizes of ``model``'s export graph; raises NotImplementedError (saying why) when ``model`` cannot be
        exported. Cheap: the export checks a model with it before anything else."""
        raise NotImplementedError(f"fuseinfer.export has no graph for {self.model_type or type(self).__name__} "
                                  "models")

    def export_config_fields(self) -> tuple[str, ...]:
        """The configuration fields the export graph depends on (the export's config hash covers these)."""
        raise NotImplementedError(f"fuseinfer.export has no graph for {self.model_type or type(self).__name__} "
                                  "models")

    def export_graph(self, model: nn.Module, ops) -> nn.Module:
        """The module ``torch.onnx.export`` traces: one decoder step of ``model`` over explicit past tensors, each
        step built by the export strategy ``ops`` (see fuseinfer.export.graph). Its ``spec`` attribute is
        ``export_spec(model)``; ``forward(input_ids, attention_mask, num_logits_to_keep, *past)`` returns
        ``(logits, *presents)`` with past / present as (key, value) per layer."""
        raise NotImplementedError(f"fuseinfer.export has no graph for {self.model_type or type(self).__name__} "
                                  "models")

    def ort_matmul_kinds(self) -> dict[str, str]:
        """The profiler's kind names of an exported graph's matrix products, by role: ``qkv`` (the q/k/v
        projections, fused or not), ``out`` (attention output), ``mlp_in`` (to the MLP's features), ``mlp_out``
        (back from them; ends a decoder layer), ``head`` (to the vocabulary); each a kind of the profiler's tables
        (fuseinfer.profile.trace.COARSE)."""
        raise NotImplementedError(f"fuseinfer.export has no graph for {self.model_type or type(self).__name__} "
                                  "models")

    # ---- the runtime's lean prefill and tensor parallel (None / a refusal where a family has neither) ----

    def prefill_reason(self, model: nn.Module, weights: bool = True) -> str | None:
        """None when :meth:`lean_logits` computes what ``model``'s patched modules would for this call, else why
        not (checked at every call; ``weights``: also that the weights are still those patch fused)."""
        return f"no lean prefill for {self.model_type or type(self).__name__}"

    def lean_logits(self, model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, key_mask=None,
                    q_start=None, cache=None, slots=None, last=None) -> torch.Tensor:
        """The lean layer loop (check :meth:`prefill_reason` first): fp32 logits (B, V) at position ``last`` ((1,)
        int64; None: the last). tokens, positions: (B, S) int64. With ``cache`` (a StaticKVCache) k/v go to its
        ``slots`` and attention reads the whole cache with ``key_mask`` (the cache's) and ``q_start`` (B,) int32;
        without, attention reads this prompt's k/v, ``key_mask`` (B, S) bool or None."""
        raise NotImplementedError(self.prefill_reason(model))

    def lean_hidden(self, model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, key_mask=None,
                    kv_out=None) -> torch.Tensor:
        """The lean layer loop without a cache (check :meth:`prefill_reason` first): the final hidden states
        (B, S, E) of every position, after the final norm, in the model's dtype (what the base model's
        ``last_hidden_state`` is). tokens, positions: (B, S) int64 (see :meth:`forward_positions`); key_mask (B, S)
        bool or None. ``kv_out``: None, or a list to which every layer appends its ``(k, v)``, each (B, key/value
        heads, S, head_dim) in the model's dtype exactly as transformers' cache would store them (views allowed)."""
        raise NotImplementedError(self.prefill_reason(model))

    def forward_positions(self, model: nn.Module, input_ids: torch.Tensor,
                          attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The positions (B, S) int64 the model's own forward gives ``input_ids`` (B, S) when called without a
        cache and without ``position_ids`` (the fast forward hands them to :meth:`lean_hidden`). By default
        0 .. S-1 in every row, padding or not (transformers' rotary models)."""
        b, s = input_ids.shape
        return torch.arange(s, device=input_ids.device).expand(b, s)

    def tp_reason(self, model: nn.Module, size: int) -> str | None:
        """Why ``model`` cannot be split over ``size`` tensor-parallel ranks, or None."""
        return f"no tensor-parallel plan for {self.model_type or type(self).__name__}"

    def tp_shard_spec(self, info) -> Callable[[str], object]:
        """``materialize``'s spec for rank ``info.rank`` of ``info.size``: parameter name -> (dim, rank, size),
        None (replicated) or "drop"."""
        raise NotImplementedError

    def tp_prepare(self, model: nn.Module, info) -> None:
        """After the shards are placed, before ``patch``: what the modules must know of the split."""
        raise NotImplementedError

    def tp_finish(self, model: nn.Module, info, state: dict, report: PatchReport) -> str:
        """After ``patch`` (``state``: what it returned): the tensor-parallel modules in place; returns how the
        model is split, for the report."""
        raise NotImplementedError
