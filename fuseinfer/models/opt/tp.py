"""Tensor parallel for OPT, Megatron's layout: what is OPT-specific in ``fuseinfer.parallel`` (which reaches it
through the family interface: ``OPTFamily.tp_*``).

* q/k/v and fc1 split by columns (output features; each rank keeps H/tp heads and ffn/tp hidden units),
  out_proj and fc2 by rows (input features), so each block needs one all-reduce: after out_proj and after fc2.
  The bias of a row-parallel linear, and the residual fused into its epilogue, are added on rank 0 only (other
  ranks hold no such bias), so the all-reduce's sum adds them once.
* embeddings, LayerNorms and the LM head are replicated (the LM head: OPT ties it to the input embeddings, and
  its 50272 x E read is ~1.4% of a decode step's weights per GPU at OPT-66b and TP=2; sharding it by vocabulary
  would add an all-gather of the logits to every step for that).
* the layer runs ``decoder_layer`` over :class:`TPOps`, a wrapper of the patched modules' strategy that all-reduces
  after the row-parallel linears; the attention modules run as they are on this rank's heads (``num_heads`` and the
  projections' widths are per rank; the fused q/k/v buffer is built from the rank's q/k/v rows).
"""
from __future__ import annotations

import re

import torch.distributed as dist
from torch import nn
from transformers.models.opt.modeling_opt import OPTAttention, OPTDecoderLayer

from fuseinfer.core.errors import FuseInferError
from fuseinfer.models.common import megatron_shard_spec, original_forward as _original_forward
from fuseinfer.models.opt.modules import FusedOPTDecoderLayer, ModuleOps

_COLUMN = re.compile(r"(^|\.)layers\.\d+\.(self_attn\.[qkv]_proj|fc1)\.(weight|bias)$")
_ROW = re.compile(r"(^|\.)layers\.\d+\.(self_attn\.out_proj|fc2)\.(weight|bias)$")


class TPOps:
    """Strategy wrapper for one layer call: the row-parallel linears (the layer's out_proj and fc2) get the residual
    on rank 0 only, then their partial sums are all-reduced in place (one collective on the current stream: CUDA-graph
    capturable); the rest is ``inner``'s."""

    __slots__ = ("inner", "rows", "rank0", "group")

    def __init__(self, inner, layer: nn.Module, info):
        self.inner = inner
        self.rows = (layer._modules["self_attn"]._modules["out_proj"], layer._modules["fc2"])
        self.rank0, self.group = info.rank == 0, info.group

    def norm(self, x, ln, residual=None):
        return self.inner.norm(x, ln, residual)

    def attention(self, i, attn, x, ctx):
        return self.inner.attention(i, attn, x, ctx)

    def linear(self, x, lin, residual=None, activation=None):
        if lin is not self.rows[0] and lin is not self.rows[1]:
            return self.inner.linear(x, lin, residual, activation)
        out = self.inner.linear(x, lin, residual if self.rank0 else None, activation)
        dist.all_reduce(out, group=self.group)
        return out


def _eval_only(module: nn.Module, x) -> None:
    if _original_forward(module, x):
        raise FuseInferError("a tensor-parallel OPT layer runs in eval mode, without autocast to another dtype and "
                             "without global module hooks (those run the original forward, which has no all-reduce "
                             "after fc2): call model.eval() and run in the model's dtype")


class TPFusedOPTDecoderLayer(FusedOPTDecoderLayer):
    """FusedOPTDecoderLayer over this rank's heads and ffn units: its strategy wrapped in :class:`TPOps`."""

    def forward(self, hidden_states, *args, **kwargs):
        _eval_only(self, hidden_states)
        return super().forward(hidden_states, *args, **kwargs)

    def _strategy(self, h):
        return TPOps(ModuleOps(self, h), self, self._fuseinfer_tp)


class TPOPTDecoderLayer(OPTDecoderLayer):
    """What ``fuseinfer.unpatch`` leaves of a TPFusedOPTDecoderLayer (or what a layer ``patch`` skipped becomes):
    ``decoder_layer`` over the module strategy with no fused op, wrapped in :class:`TPOps`."""

    _fuseinfer_ops = frozenset()
    _strategy = TPFusedOPTDecoderLayer._strategy

    def forward(self, hidden_states, *args, **kwargs):
        _eval_only(self, hidden_states)
        return FusedOPTDecoderLayer.forward(self, hidden_states, *args, **kwargs)


def tp_reason(model: nn.Module, size: int) -> str | None:
    """Why ``model`` cannot be split over ``size`` ranks, or None."""
    if type(model).__name__ != "OPTForCausalLM":
        return f"tensor_parallel takes an OPTForCausalLM, got {type(model).__name__}"
    cfg = model.config
    for what, n in (("num_attention_heads", cfg.num_attention_heads), ("ffn_dim", cfg.ffn_dim)):
        if n % size:
            sizes = [d for d in range(1, n + 1)
                     if n % d == 0 and cfg.ffn_dim % d == 0 and cfg.num_attention_heads % d == 0]
            return (f"{what}={n} is not divisible by the tensor-parallel size {size}: heads (and ffn units) are split "
                    f"evenly; use a tp size from {sizes}")
    return None


def tp_shard_spec(info):
    """name -> how this rank keeps that tensor: (dim, rank, size), None (replicated) or "drop" (not on this rank)."""
    return megatron_shard_spec(info, _COLUMN, _ROW)


def tp_prepare(model: nn.Module, info) -> None:
    """After the shards are placed, before ``patch``: per-rank head counts, and the layers' place in the group."""
    for m in model.modules():
        if isinstance(m, OPTAttention):
            m.num_heads //= info.size  # this rank's heads (head_dim unchanged)
            m.embed_dim //= info.size  # this rank's q/k/v width (the fused q/k/v buffer is (3 E/tp, E))
        if isinstance(m, OPTDecoderLayer):
            m._fuseinfer_tp = info


def tp_finish(model: nn.Module, info, state: dict, report) -> str:
    """After ``patch``: every decoder layer becomes tensor-parallel (fused or not; ``unpatch`` leaves the unfused
    one, ``state`` being the patch's); returns what the report says of the split."""
    for m in model.modules():
        if type(m) is FusedOPTDecoderLayer:
            m.__class__ = TPFusedOPTDecoderLayer
        elif type(m) is OPTDecoderLayer:
            m.__class__ = TPOPTDecoderLayer
    state["classes"] = [(m, TPOPTDecoderLayer if cls is OPTDecoderLayer else cls) for m, cls in state["classes"]]
    for swap in report.swaps:
        if swap.new_class == "FusedOPTDecoderLayer":
            swap.new_class = "TP" + swap.new_class
    cfg = model.config
    return (f"{cfg.num_attention_heads // info.size} heads and {cfg.ffn_dim // info.size} ffn units per rank, "
            "LM head replicated")
