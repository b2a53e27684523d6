"""Tensor parallel for the Llama architecture (Llama, Mistral, Qwen2), Megatron's layout: what is specific to these
families in ``fuseinfer.parallel`` (which reaches it through the family interface: ``LlamaFamily.tp_*``).

* q/k/v and gate/up split by columns (output features), o_proj and down_proj by rows (input features), so each
  block needs one all-reduce: after o_proj and after down_proj. The bias of a row-parallel linear (Llama's
  ``attention_bias`` / ``mlp_bias``), and the residual fused into its epilogue, are added on rank 0 only (other
  ranks hold no such bias), so the all-reduce's sum adds them once.
* grouped-query heads: every rank keeps ``Hkv / tp`` WHOLE key/value heads and the ``H / tp`` query heads that
  read them. Contiguous slices do that: query head h reads key/value head ``h // (H / Hkv)``, and with ``Hkv % tp
  == 0`` rank r's query heads ``[r H/tp, (r+1) H/tp)`` read exactly its key/value heads ``[r Hkv/tp, (r+1)
  Hkv/tp)``. Qwen2's q/k/v biases split with their rows. ``Hkv % tp != 0`` is refused (replicating key/value heads
  instead would duplicate their cache on every rank). The static KV cache of a rank holds its ``Hkv / tp`` heads
  (the runtime divides ``kv_layout``'s heads by the tensor-parallel size, ``runtime/cache.py``).
* embeddings, RMSNorms and the LM head are replicated. The norms are tiny. The embedding table is read one row per
  token. The LM head is read whole each step (Llama-3.1-8B: 128256 x 4096, ~13% of a rank's weight reads per
  decode step at TP=2), but sharding it by vocabulary would add an all-gather of the (B, V) logits to every step
  (every rank samples from the whole vocabulary), and where it is tied to the embeddings (Llama 3.2, small Qwen2.5)
  the embedding lookup would need an all-reduce of its own; left replicated, as OPT's.
* the layer runs ``decoder_layer`` over :class:`TPOps`, a wrapper of the patched modules' strategy that all-reduces
  after the row-parallel linears. The attention modules run as they are on this rank's heads: their ``config``
  reads as a per-rank view (:class:`RankConfig`: ``num_attention_heads`` / ``num_key_value_heads`` of this rank,
  everything else the model's config, live), the projections' ``in_features`` / ``out_features`` are per rank,
  and the fused q/k/v is built by ``patch`` from the rank's rows, ``((H + 2 Hkv) D / tp, E)``.
"""
from __future__ import annotations

import re

import torch.distributed as dist
from torch import nn

from fuseinfer.core.decode_plan import TP_ATTR  # (the TPInfo each decoder layer and attention module holds too)
from fuseinfer.core.errors import FuseInferError
from fuseinfer.models.common import megatron_shard_spec, original_forward as _original_forward
from fuseinfer.models.llama.layer import decoder_layer
from fuseinfer.models.llama.modules import (
    ARCHS, FUSED, ModuleOps, head_dim_of, sliding_window_refusal,
)

_CAUSAL_LMS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_COLUMN = re.compile(r"(^|\.)layers\.\d+\.(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)\.(weight|bias)$")
_ROW = re.compile(r"(^|\.)layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)\.(weight|bias)$")


class TPOps:
    """Strategy wrapper for one layer call: the row-parallel linears (the layer's o_proj and down_proj: every
    ``linear`` call of ``decoder_layer``) get the residual on rank 0 only, then their partial sums are all-reduced in
    place (one collective on the current stream: CUDA-graph capturable); the rest is ``inner``'s."""

    __slots__ = ("inner", "rows", "rank0", "group")

    def __init__(self, inner, layer: nn.Module, info):
        self.inner = inner
        self.rows = (layer._modules["self_attn"]._modules["o_proj"], layer._modules["mlp"]._modules["down_proj"])
        self.rank0, self.group = info.rank == 0, info.group

    def norm(self, x, norm, residual=None):
        return self.inner.norm(x, norm, residual)

    def attention(self, i, attn, x, ctx):
        return self.inner.attention(i, attn, x, ctx)

    def gated_mlp(self, mlp, x):
        return self.inner.gated_mlp(mlp, x)

    def linear(self, x, lin, residual=None):
        if lin is not self.rows[0] and lin is not self.rows[1]:  # (none today: kept exact if the layer grows one)
            return self.inner.linear(x, lin, residual)
        out = self.inner.linear(x, lin, residual if self.rank0 else None)  # (B, S, E) partial sum
        dist.all_reduce(out, group=self.group)
        return out


class RankConfig:
    """What a tensor-parallel attention module reads as its ``config``: this rank's ``num_attention_heads`` and
    ``num_key_value_heads`` (and the model's ``head_dim``, which ``hidden / heads`` would no longer give); every other
    attribute read from, and written to, the model's config object the module holds (so ``patch`` switching the
    attention implementation, and ``unpatch`` switching it back, reach it)."""

    __slots__ = ("base", "num_attention_heads", "num_key_value_heads", "head_dim")

    def __init__(self, base, size: int):
        set_ = object.__setattr__
        set_(self, "base", base)
        set_(self, "num_attention_heads", base.num_attention_heads // size)
        set_(self, "num_key_value_heads", base.num_key_value_heads // size)
        set_(self, "head_dim", head_dim_of(base))

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "base"), name)

    def __setattr__(self, name, value):
        if name in RankConfig.__slots__:
            raise FuseInferError(f"{name} of a tensor-parallel attention module is fixed by the split: set it on the "
                                 "model's config before tensor_parallel")
        setattr(self.base, name, value)

    def __repr__(self):
        return (f"RankConfig(heads={self.num_attention_heads}, kv_heads={self.num_key_value_heads}, "
                f"of {self.base!r})")


class _TPAttention:
    """Mixin of the tensor-parallel attention modules: ``config`` reads as :class:`RankConfig` of the config object
    in ``__dict__`` (where ``patch`` / ``unpatch`` look for it, and replace it)."""

    @property
    def config(self):
        return RankConfig(self.__dict__["config"], self.__dict__[TP_ATTR].size)

    @config.setter
    def config(self, value):
        self.__dict__["config"] = value


def _eval_only(module: nn.Module, x) -> None:
    if _original_forward(module, x):
        raise FuseInferError("a tensor-parallel Llama-architecture layer runs in eval mode, without autocast to "
                             "another dtype and without global module hooks (those run the original forward, which "
                             "has no all-reduce after o_proj and down_proj): call model.eval() and run in the "
                             "model's dtype")


class _TPDecoderLayer:
    """Mixin of the tensor-parallel decoder layers: ``decoder_layer`` over :class:`TPOps` wrapping the patched
    modules' strategy (over whichever of its modules ``patch`` fused; none after ``unpatch``)."""

    _fuseinfer_ops: frozenset = frozenset()

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, **kwargs):
        _eval_only(self, hidden_states)
        ctx = dict(attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
                   use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
        ops = TPOps(ModuleOps(self, hidden_states), self, self.__dict__[TP_ATTR])
        return decoder_layer(ops, self._modules["self_attn"].layer_idx, self, hidden_states, ctx)


def _make_classes() -> dict[type, type]:
    """The class each decoder layer / attention module takes under tensor parallel (fused by ``patch`` or not) ->
    its TP subclass, each a module-level name here (so pickle finds it)."""
    out = {}
    for layer, attn, *_ in ARCHS.values():
        for base, mixin in ((layer, _TPDecoderLayer), (FUSED[layer], _TPDecoderLayer), (attn, _TPAttention),
                            (FUSED[attn], _TPAttention)):
            cls = type("TP" + base.__name__, (mixin, base), {"__module__": __name__, "__doc__": mixin.__doc__})
            out[base] = globals()[cls.__name__] = cls
    return out


TP_CLASSES = _make_classes()


def tp_reason(model: nn.Module, size: int) -> str | None:
    """Why ``model`` cannot be split over ``size`` ranks, or None."""
    if type(model).__name__ not in _CAUSAL_LMS:
        return f"tensor_parallel takes a causal LM ({', '.join(_CAUSAL_LMS)}), got {type(model).__name__}"
    cfg = model.config
    why = sliding_window_refusal(cfg)
    if why is not None:
        return why
    heads, kv_heads, ffn = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    sizes = [d for d in range(1, kv_heads + 1) if kv_heads % d == 0 and ffn % d == 0]
    if kv_heads % size:
        return (f"num_key_value_heads={kv_heads} is not divisible by the tensor-parallel size {size}: each rank keeps "
                f"whole key/value heads (and the {heads // kv_heads} query heads reading each); use a tp size from "
                f"{sizes}")
    if ffn % size:
        return (f"intermediate_size={ffn} is not divisible by the tensor-parallel size {size}: the MLP's units are "
                f"split evenly; use a tp size from {sizes}")
    return None


def tp_shard_spec(info):
    """name -> how this rank keeps that tensor: (dim, rank, size), None (replicated) or "drop" (not on this rank)."""
    return megatron_shard_spec(info, _COLUMN, _ROW)


def tp_prepare(model: nn.Module, info) -> None:
    """After the shards are placed, before ``patch``: the linears' feature counts as their shards have them (patch
    fuses q/k/v and gate/up by ``out_features``), and the layers' and attention modules' place in the group (their
    per-rank heads follow from it)."""
    layers, attns = tuple(a[0] for a in ARCHS.values()), tuple(a[1] for a in ARCHS.values())
    for m in model.modules():
        if isinstance(m, nn.Linear) and m.weight is not None:
            m.out_features, m.in_features = m.weight.shape  # (N, K) of this rank's shard
        if isinstance(m, layers + attns):
            m.__dict__[TP_ATTR] = info


def tp_finish(model: nn.Module, info, state: dict, report) -> str:
    """After ``patch``: every decoder layer and attention module becomes tensor-parallel (fused or not; ``unpatch``
    leaves the unfused ones, ``state`` being the patch's); returns what the report says of the split."""
    for m in model.modules():
        cls = TP_CLASSES.get(type(m))
        if cls is not None:
            m.__class__ = cls
    state["classes"] = [(m, TP_CLASSES.get(cls, cls)) for m, cls in state["classes"]]
    for swap in report.swaps:
        if any(swap.new_class == base.__name__ for base in TP_CLASSES):
            swap.new_class = "TP" + swap.new_class
    cfg = model.config
    return (f"{cfg.num_attention_heads // info.size} query and {cfg.num_key_value_heads // info.size} key/value heads "
            f"and {cfg.intermediate_size // info.size} MLP units per rank, embeddings and LM head replicated")
