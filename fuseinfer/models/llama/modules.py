"""Patch rules for the Llama architecture: Hugging Face Llama, Mistral and Qwen2 (their causal LMs and base models).

Swaps, by changing the class of the existing modules to subclasses (as the OPT family does, so hooks, parameters and
``isinstance`` checks stay as they are):

* the decoder layer -> ``Fused<Arch>DecoderLayer``: :func:`~fuseinfer.models.llama.layer.decoder_layer` over
  :class:`ModuleOps`: residual add + RMSNorm in one kernel (``add_rms_norm``), the residual adds of the attention and
  the MLP in the o_proj / down_proj GEMM epilogues;
* the attention -> ``Fused<Arch>Attention``: q/k/v as one GEMM over a ((H + 2 Hkv) D, E) tensor whose rows the q/k/v
  weights (and Qwen2's biases) are views of, so no memory is added and ``state_dict`` keeps their names; the split,
  the rotary embedding (the model's own cos / sin tables) and, over fuseinfer's static cache, the cache write: one op
  with the GEMM (``linear_rope_append``: one kernel at decode, the GEMV; at prefill the GEMM and one pass, or with
  ``FUSEINFER_QKV_GEMM=1`` on sm_90 one GEMM with all of it in its epilogue), or for other quantized weights, FP8
  caches and inputs that need gradients their GEMM and one pass (``qkv_rope`` / ``qkv_rope_append``); transformers'
  caches (DynamicCache, StaticCache) through their ``update``; attention through the registered ``"fuseinfer"``
  implementation (grouped-query k / v as they are); o_proj (+ residual) fused;
* the MLP -> ``Fused<Arch>MLP``: gate and up as one (2F, E) GEMM (the two weights views of it) with ``silu_mul`` as
  its activation (in the decode GEMV's epilogue; a GEMM and then ``silu_mul`` for prefill), then down_proj
  (+ residual) fused;
* the final RMSNorm -> ``Fused<Arch>RMSNorm`` (the ``add_rms_norm`` kernel);
* the base model (``LlamaModel`` ...) -> ``Locked<Arch>Model``: the same forward, holding the model's lock, so that
  ``patch`` / ``unpatch`` in another thread wait for a running forward;
* ``config._attn_implementation`` -> ``"fuseinfer"`` on a copy of the config (as for OPT).

What stays unswapped, and why, follows the rules every family shares (``models/common.py``): training mode, autocast
to another dtype and global module hooks run the original forwards; a module whose fused forward would bypass a
hooked or non-plain submodule (an adapter) is skipped and reported; a ``filter_fn`` picks the candidates. Mistral with
a sliding window shorter than its context, and Qwen2 with sliding-window layers, are refused: fuseinfer's attention
has no window.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel, LlamaRMSNorm, apply_rotary_pos_emb,
)
from transformers.models.mistral.modeling_mistral import (
    MistralAttention, MistralDecoderLayer, MistralMLP, MistralModel, MistralRMSNorm,
)
from transformers.models.qwen2.modeling_qwen2 import (
    Qwen2Attention, Qwen2DecoderLayer, Qwen2MLP, Qwen2Model, Qwen2RMSNorm,
)

from fuseinfer.core import placement
from fuseinfer.core.config import PatchConfig, PatchReport, Swap
from fuseinfer.core.errors import FuseInferError
from fuseinfer.core.quant_config import SmoothQuantW8A8
from fuseinfer.core.state import LOCK_ATTR, lock_holder
from fuseinfer.layers import hf_attention
from fuseinfer.layers.linear import Int8WeightOnlyLinear, fused_linear
from fuseinfer.ops import add_rms_norm, linear_epilogue, linear_rope_append, qkv_rope, qkv_rope_append, silu_mul
from fuseinfer.ops.norm_linear import rms_norm_linear, rms_norm_linear_rope_append
from fuseinfer.ops.attention import KERNEL_GQA, repeat_kv
from fuseinfer.models.base import FusedWeight
from fuseinfer.models.llama.layer import decoder_layer
from fuseinfer.models.llama.quant import SMOOTHQUANT_REFUSAL
from fuseinfer.models.common import (
    cache_slots,
    fold_rows,
    install_attention,
    lock_models,
    own_storage_hook,
    PendingNorm,
    plain_call,
    restore_attention,
    static_cache,
    unlock_models,
    PendingAttention as _PendingAttention,
    has_hooks as _has_hooks,
    op_backends as _backends,
    original_forward as _original_forward,
    own_qkv_storage as _own_qkv_storage,
)

# (decoder layer, attention, MLP, RMSNorm, base model) of each architecture
ARCHS = {
    "llama": (LlamaDecoderLayer, LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaModel),
    "mistral": (MistralDecoderLayer, MistralAttention, MistralMLP, MistralRMSNorm, MistralModel),
    "qwen2": (Qwen2DecoderLayer, Qwen2Attention, Qwen2MLP, Qwen2RMSNorm, Qwen2Model),
}


# Whether a decoder layer folds its RMSNorms into the GEMV after each (input_layernorm into q/k/v + rotary + cache
# write, post_attention_layernorm into gate/up + silu_mul; ``ops/norm_linear.py``): at decode one kernel fewer per norm,
# the GEMV normalising the rows in its prologue. Read at each layer call (a benchmark flips it to time both in one
# process); where the fused op does not apply (prefill, quantized or FP8-cache paths, an unpatched or hooked
# attention / MLP) the norm runs first as before, so the values are the same either way. On: Llama-3.2-1B batch-1
# decode 0.983 -> 0.925 ms/token (H200, both in one process).
FOLD_NORMS = True
# ... at up to this many rows (tokens) a call: every block of the GEMV stages and normalises all the rows, which
# costs more than the norm kernel it saves as the rows grow. Llama-3.2-1B per-op decode, ms/token folded / not (H200,
# one process): 1 row 0.954 / 1.009, 2 rows 0.972 / 1.020, 4 rows 1.014 / 1.045, 8 rows 1.120 / 1.097.
FOLD_MAX_ROWS = 4

# The fused weights: row concatenations of a module's linears in plain attributes of its ``__dict__`` (outside the
# parameter and buffer registries, so ``state_dict`` lists what the unpatched model lists); ``name``: the one int8
# linear the weight-only quantizer puts in their place
QKV = FusedWeight("qkv_proj", "qkv_weight", "qkv_bias", ("q_proj", "k_proj", "v_proj"), "_fuseinfer_qkv_params")
GATE_UP = FusedWeight("gate_up_proj", "gate_up_weight", "gate_up_bias", ("gate_proj", "up_proj"),
                      "_fuseinfer_gate_up_params")


# ---------------------------------------------------------------------------------------------- fused weights

def _params(module: nn.Module, group: FusedWeight) -> tuple:
    """The parts' weights and biases as stored (``_parameters``: where functional_call swaps tensors in)."""
    mods = module._modules
    return tuple(mods[name]._parameters[p] for name in group.parts for p in ("weight", "bias"))


def fuse(module: nn.Module, group: FusedWeight) -> None:
    """Concatenate the parts' weights (and biases) into one tensor and make the parts views of it."""
    projs = [module._modules[n] for n in group.parts]
    module.__dict__[group.weight] = torch.cat([p.weight.detach() for p in projs])  # (sum N_i, E)
    biased = projs[0].bias is not None
    module.__dict__[group.bias] = torch.cat([p.bias.detach() for p in projs]) if biased else None
    link(module, group)


def link(module: nn.Module, group: FusedWeight) -> None:
    """Point the parts' Parameters (the same objects, so optimizers and hooks keep them) at their rows of the fused
    tensors, and remember those objects."""
    w, b = module.__dict__[group.weight], module.__dict__[group.bias]
    start = 0
    for name in group.parts:
        proj = module._modules[name]
        rows = proj.out_features
        proj.weight.data = w[start:start + rows]
        if b is not None:
            proj.bias.data = b[start:start + rows]
        start += rows
    module.__dict__[group.params] = _params(module, group)


def unfuse(module: nn.Module, group: FusedWeight) -> None:
    """Give every part storage of its own again and drop the fused tensors."""
    for name in group.parts:
        proj = module._modules[name]
        proj.weight.data = proj.weight.detach().clone()
        if proj.bias is not None:
            proj.bias.data = proj.bias.detach().clone()
    for key in (group.weight, group.bias, group.params):
        module.__dict__.pop(key, None)


def _linked(module: nn.Module, group: FusedWeight) -> bool:
    """Whether the fused GEMM serves this forward: the weight-only quantizer put its int8 linear in place, or the
    parts hold the Parameters linked to the fused tensor, still its rows (``param.data = t`` keeps the Parameter,
    not the view; data pointers checked in eager mode only), and none needs a gradient (autograd does not connect
    the fused tensor to them)."""
    if group.name in module._modules:
        return True
    params = _params(module, group)
    if any(a is not b for a, b in zip(params, module.__dict__.get(group.params, ()))) or \
            group.params not in module.__dict__:
        return False
    if torch.is_grad_enabled() and any(p is not None and p.requires_grad for p in params):
        return False
    if torch.compiler.is_compiling():
        return True
    w, b = module.__dict__[group.weight], module.__dict__[group.bias]
    offset = 0
    for name in group.parts:
        proj = module._modules[name]
        if proj.weight.data_ptr() != w.data_ptr() + offset * w.stride(0) * w.element_size():
            return False
        if b is not None and proj.bias.data_ptr() != b.data_ptr() + offset * b.element_size():
            return False
        offset += proj.out_features
    return True


def _fused_group_linear(module: nn.Module, group: FusedWeight, x: torch.Tensor,
                        activation: str = "none") -> torch.Tensor:
    """act(x (..., E) @ the fused weight) -> (..., sum N_i), or (..., F) for ``"silu_mul"`` (gate/up): the quantized
    linear where there is one (one that cannot fuse silu_mul, ``Int8WeightOnlyLinear`` can, runs it after)."""
    quant = module._modules.get(group.name)
    if quant is not None:
        if activation == "silu_mul" and not isinstance(quant, Int8WeightOnlyLinear):
            return silu_mul(quant.fused(x))
        return quant.fused(x, None, activation)
    return linear_epilogue(x, module.__dict__[group.weight], module.__dict__[group.bias], None, activation)


class _FusedWeights:
    """Mixin of the modules holding fused tensors: ``model.to`` / ``.half()`` convert them (plain attributes) and
    the parts become views of the converted tensors again; a deep copy or unpickled copy relinks its own."""

    _groups: tuple = ()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for g in self._groups:
            if self.__dict__.get(g.weight) is not None:
                with torch.no_grad():
                    for key in (g.weight, g.bias):
                        if self.__dict__.get(key) is not None:
                            self.__dict__[key] = fn(self.__dict__[key])
                link(self, g)
        return self

    def __setstate__(self, state):
        super().__setstate__(state)
        for g in self._groups:
            if self.__dict__.get(g.weight) is not None:
                link(self, g)


# ---------------------------------------------------------------------------------------------- fused modules

def qkv_operands(attn: nn.Module):
    """(weight, scale, bias) of the fused q/k/v projection for ``linear_rope_append``: the fp16/bf16/fp32 fused weight
    (scale None) or the int8 weight-only one; None for another quantized linear (it runs its own GEMM)."""
    quant = attn._modules.get(QKV.name)
    if quant is None:
        return attn.__dict__[QKV.weight], None, attn.__dict__[QKV.bias]
    if type(quant) is Int8WeightOnlyLinear:
        return quant.qweight, quant.scale, quant.bias
    return None


class _FusedAttention(_FusedWeights):
    """The attention with fused q/k/v + rotary (+ static-cache write), fuseinfer's attention and a fused o_proj."""

    _groups = (QKV,)
    _fuseinfer_ops: frozenset = frozenset()

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                residual=None, prenorm=None, **kwargs):
        """residual: added to the output in o_proj's epilogue (the decoder layer's stream). prenorm: an RMSNorm module
        whose output the projections take (hidden_states un-normalised; :data:`FOLD_NORMS`), folded into the q/k/v
        GEMV where that runs ``linear_rope_append`` over fp16 / bf16 weights, else applied first."""
        if prenorm is not None and not self._folds_norm(hidden_states, past_key_values):
            hidden_states, prenorm = _apply_norm(hidden_states, prenorm), None
        if _original_forward(self, hidden_states):
            out, weights = super().forward(hidden_states, position_embeddings, attention_mask, past_key_values,
                                           **kwargs)
            return (out if residual is None else residual + out), weights
        ops = self._fuseinfer_ops
        b, s, _ = hidden_states.shape
        cfg, d = self.config, self.head_dim
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        cos, sin = position_embeddings  # (B or 1, S, D)
        if "qkv" in ops and _linked(self, QKV):
            cos, sin = cos.expand(b, s, d), sin.expand(b, s, d)
            operands = qkv_operands(self)
            scales = getattr(past_key_values, "kv_scales", None)  # (an FP8 cache's, else None)
            if static_cache(past_key_values) and operands is not None and scales is None:
                # (the GEMV's epilogue writes caches of the model's dtype; an FP8 cache takes the pass below)
                # projection, rotary, split and cache write: one GEMV at decode, the GEMM and one pass else
                i = self.layer_idx
                keys, values = past_key_values.keys[i], past_key_values.values[i]
                slots = cache_slots(past_key_values, hidden_states.device)
                if prenorm is not None:  # (operands: the fp16 / bf16 weight, no scale; _folds_norm)
                    q = rms_norm_linear_rope_append(hidden_states, prenorm.weight, prenorm.variance_epsilon,
                                                    operands[0], operands[2], cos, sin, heads, kv_heads, keys, values,
                                                    slots)  # (B, H, S, D)
                else:
                    q = linear_rope_append(hidden_states, *operands, cos, sin, heads, kv_heads, keys, values,
                                           slots)  # (B, H, S, D)
                k, v = keys, values  # (B, Hkv, T, D)
            elif static_cache(past_key_values):  # rotary, split and cache write in one pass
                qkv = fused_linear(self, hidden_states)  # (B, S, (H + 2 Hkv) D); quantized weights
                i = self.layer_idx
                keys, values = past_key_values.keys[i], past_key_values.values[i]
                slots = cache_slots(past_key_values, qkv.device)
                q = qkv_rope_append(qkv, cos, sin, heads, kv_heads, keys, values, slots,
                                    None if scales is None else scales[i],
                                    getattr(past_key_values, "calibrate", False))  # (B, H, S, D)
                k, v = keys, values  # (B, Hkv, T, D)
            else:
                # (linear_rope_append has no autograd formula: its k, v are written into inputs)
                grad = torch.is_grad_enabled() and any(t.requires_grad for t in (hidden_states, cos, sin))
                if operands is not None and not grad:  # projection, rotary and split in one op: k, v (B, Hkv, S, D)
                    k, v = (hidden_states.new_empty(b, kv_heads, s, d) for _ in range(2))
                    slots = torch.arange(s, device=hidden_states.device)
                    q = linear_rope_append(hidden_states, *operands, cos, sin, heads, kv_heads, k, v, slots)
                else:  # other quantized weights, or gradients: the GEMM, then the rotary pass
                    qkv = fused_linear(self, hidden_states)  # (B, S, (H + 2 Hkv) D)
                    q, k, v = qkv_rope(qkv, cos, sin, heads, kv_heads)  # (B, H, S, D), (B, Hkv, S, D) x 2
                if past_key_values is not None:
                    k, v = past_key_values.update(k, v, self.layer_idx)
        else:
            q, k, v = (proj(hidden_states).view(b, s, -1, d).transpose(1, 2)
                       for proj in (self.q_proj, self.k_proj, self.v_proj))
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            if past_key_values is not None:
                k, v = past_key_values.update(k, v, self.layer_idx)
        impl = cfg._attn_implementation
        if impl == hf_attention.NAME and (kwargs.get("output_attentions") or hf_attention.weights_requested(self)):
            # the weights were asked for, which the kernel does not form: eager over k / v repeated to H heads
            k, v = repeat_kv(q, k, v)
            attn, weights = hf_attention.eager_attention_with_weights(self, q, k, v, attention_mask, self.scaling)
        elif impl == hf_attention.NAME:
            attn, weights = hf_attention.fuseinfer_attention_forward(self, q, k, v, attention_mask,
                                                                     scaling=self.scaling)
        else:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
            from transformers.models.llama.modeling_llama import eager_attention_forward

            fn = ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_attention_forward)
            kwargs.pop("output_attentions", None)
            attn, weights = fn(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        attn = attn.reshape(b, s, -1)  # (B, S, H D)
        if "linear" in ops:
            return fused_linear(self.o_proj, attn, residual), weights
        out = self.o_proj(attn)
        return (out if residual is None else residual + out), weights

    def _folds_norm(self, hidden_states, past_key_values) -> bool:
        """Whether forward takes the ``linear_rope_append`` branch with fp16 / bf16 weights (the one that folds a
        prenorm)."""
        if _original_forward(self, hidden_states) or "qkv" not in self._fuseinfer_ops or not _linked(self, QKV):
            return False
        operands = qkv_operands(self)
        return static_cache(past_key_values) and getattr(past_key_values, "kv_scales", None) is None and \
            operands is not None and operands[1] is None


class _FusedMLP(_FusedWeights):
    """The gated MLP with gate / up as one GEMM, ``silu_mul``, and down_proj (+ residual) fused."""

    _groups = (GATE_UP,)
    _fuseinfer_ops: frozenset = frozenset()

    def forward(self, x, residual=None, prenorm=None):
        """prenorm: an RMSNorm module whose output the MLP takes (x un-normalised; :data:`FOLD_NORMS`), folded into
        the gate/up GEMV over the fp16 / bf16 fused weight, else applied first."""
        if prenorm is not None and (_original_forward(self, x) or not _linked(self, GATE_UP)
                                    or GATE_UP.name in self._modules):
            x, prenorm = _apply_norm(x, prenorm), None
        if _original_forward(self, x):
            out = super().forward(x)
            return out if residual is None else residual + out
        if prenorm is not None:  # (..., F): silu(gate) * up of the normalised rows
            g = rms_norm_linear(x, prenorm.weight, prenorm.variance_epsilon, self.__dict__[GATE_UP.weight],
                                self.__dict__[GATE_UP.bias], None, "silu_mul")
        elif _linked(self, GATE_UP):
            g = _fused_group_linear(self, GATE_UP, x, "silu_mul")  # (..., F): silu(gate) * up
        else:
            g = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        return fused_linear(self.down_proj, g, residual)


class _FusedRMSNorm:
    """The RMSNorm running the ``add_rms_norm`` kernel (bit-exact with transformers' where ``rsqrt`` agrees)."""

    def forward(self, x):
        if _original_forward(self, x):
            return super().forward(x)
        return add_rms_norm(x, None, self.weight, self.variance_epsilon)[0]


def _apply_norm(x, norm):
    """The RMSNorm a fused layer runs (:meth:`ModuleOps.norm` without a residual): ``add_rms_norm``'s output."""
    return add_rms_norm(x, None, norm.weight, norm.variance_epsilon)[0]


def _folds_norms(layer: nn.Module) -> bool:
    """Whether ``layer`` hands its RMSNorms to its attention and MLP (:data:`FOLD_NORMS`, both fused and plainly
    called)."""
    attn, mlp = layer._modules["self_attn"], layer._modules["mlp"]
    return isinstance(attn, _FusedAttention) and isinstance(mlp, _FusedMLP) and plain_call(attn) and \
        plain_call(mlp)


class _PendingMLP:
    """:meth:`ModuleOps.gated_mlp`'s result: the MLP module's call, made by the down_proj step that follows."""

    __slots__ = ("mlp", "x")

    def __init__(self, mlp, x):
        self.mlp, self.x = mlp, x


class ModuleOps:
    """The patched modules' strategy for :func:`~fuseinfer.models.llama.layer.decoder_layer`, over (B, S, E) with
    transformers' cache and mask (``ctx``: the attention module's keyword arguments). The attention and the MLP run
    as calls of their modules (patched or not, so their hooks and a filter_fn's choice hold); the RMSNorms run
    fused when the layer's ops include ``layer_norm``."""

    __slots__ = ("fused_norm", "fold")

    def __init__(self, layer: nn.Module, h: torch.Tensor):
        self.fused_norm = "layer_norm" in layer._fuseinfer_ops
        self.fold = FOLD_NORMS and fold_rows(h, FOLD_MAX_ROWS) and self.fused_norm and \
            _folds_norms(layer)

    def norm(self, x, norm, residual=None):
        if self.fold and residual is None:  # (the attention / MLP module normalises: PendingNorm)
            return PendingNorm(x, norm), x
        if not self.fused_norm:
            s = x if residual is None else residual + x
            return norm(s), s
        y, s = add_rms_norm(x, residual, norm.weight, norm.variance_epsilon, residual is not None)
        return y, (x if residual is None else s)

    def attention(self, i, attn, x, ctx):
        if type(x) is PendingNorm:
            return _PendingAttention(attn, x.x, {**ctx, "prenorm": x.norm})
        return _PendingAttention(attn, x, ctx)

    def gated_mlp(self, mlp, x):
        return _PendingMLP(mlp, x)

    def linear(self, x, lin, residual=None):
        if type(x) is _PendingAttention:  # o_proj: the attention module's call
            if isinstance(x.attn, _FusedAttention):
                return x.attn(x.x, residual=residual, **x.kwargs)[0]
            out = x.attn(x.x, **x.kwargs)[0]  # left unpatched (filter_fn, hooks)
            return out if residual is None else residual + out
        if type(x) is _PendingMLP:  # down_proj: the MLP module's call
            if type(x.x) is PendingNorm:  # (FOLD_NORMS: a fused MLP, _folds_norms)
                return x.mlp(x.x.x, residual=residual, prenorm=x.x.norm)
            if isinstance(x.mlp, _FusedMLP):
                return x.mlp(x.x, residual=residual)
            out = x.mlp(x.x)
            return out if residual is None else residual + out
        out = lin(x)
        return out if residual is None else residual + out


class _FusedDecoderLayer:
    """The decoder layer as :func:`decoder_layer` over :class:`ModuleOps`."""

    _fuseinfer_ops: frozenset = frozenset()

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, **kwargs):
        if _original_forward(self, hidden_states):
            return super().forward(hidden_states, attention_mask, position_ids, past_key_values, use_cache,
                                   position_embeddings, **kwargs)
        ctx = dict(attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
                   use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
        return decoder_layer(ModuleOps(self, hidden_states), self._modules["self_attn"].layer_idx, self,
                             hidden_states, ctx)


def _locked_forward(base: type):
    @functools.wraps(base.forward)
    def forward(self, *args, **kwargs):
        """The base model's forward holding the patched model's lock (``ModelLock`` in ``__dict__[LOCK_ATTR]``)."""
        holder = self.__dict__.get(LOCK_ATTR)
        if holder is None or torch.compiler.is_compiling():  # (dynamo does not trace a lock)
            return base.forward(self, *args, **kwargs)
        with holder.lock:  # (``base.forward``, not super(): unpatch may have restored the class meanwhile)
            return base.forward(self, *args, **kwargs)

    return forward


def _make_classes() -> dict[type, type]:
    """transformers class -> its fused (or locked) subclass, each a module-level name here (so pickle finds it)."""
    out = {}
    for layer, attn, mlp, norm, model in ARCHS.values():
        for base, mixin, prefix in ((layer, _FusedDecoderLayer, "Fused"), (attn, _FusedAttention, "Fused"),
                                    (mlp, _FusedMLP, "Fused"), (norm, _FusedRMSNorm, "Fused")):
            cls = type(prefix + base.__name__, (mixin, base), {"__module__": __name__, "__doc__": mixin.__doc__})
            out[base] = globals()[cls.__name__] = cls
        cls = type("Locked" + model.__name__, (model,), {"__module__": __name__, "forward": _locked_forward(model),
                                                          "__doc__": _locked_forward.__doc__})
        out[model] = globals()[cls.__name__] = cls
    return out


FUSED = _make_classes()
_ORIGINAL = {v: k for k, v in FUSED.items()}


# ---------------------------------------------------------------------------------------------- patch rules

def sliding_window_refusal(config) -> str | None:
    """Why a model of ``config`` cannot be patched because of its sliding-window attention, or None."""
    window = getattr(config, "sliding_window", None)
    limit = getattr(config, "max_position_embeddings", None)
    if config.model_type == "qwen2":
        if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
            return (f"this Qwen2 model has sliding-window attention layers (use_sliding_window=True, window "
                    f"{window}), which fuseinfer's attention does not implement: load it with "
                    "use_sliding_window=False (the same model for contexts within the window)")
        return None
    if window is not None and (limit is None or window < limit):
        return (f"this {config.model_type} model attends within a sliding window of {window} tokens (shorter than its "
                f"max_position_embeddings={limit}), which fuseinfer's attention does not implement: set "
                "config.sliding_window = None before patching (the same model for contexts of at most "
                f"{window} tokens), and keep contexts within the window")
    return None


_SILU = ("SiLU", "SiLUActivation")  # torch's and transformers' (ACT2FN["silu"]) SiLU modules


def _bypass_reason(module: nn.Module, ops, like: torch.Tensor) -> str | None:
    """Why ``module`` must stay unswapped, or None: placement, mixed dtypes, or a submodule its fused forward reads
    instead of calling that is not a plain hook-free ``nn.Linear`` / RMSNorm (an adapter, a hook)."""
    why = placement.bypass_reason(module)
    if why is not None:
        return why
    dtypes = {p.dtype for p in module.parameters()} - {like.dtype}
    if dtypes:
        return (f"it has {'/'.join(sorted(str(d) for d in dtypes))} parameters in a {like.dtype} model: the fused ops "
                f"take one dtype (e.g. model.to({like.dtype}))")
    kinds: dict = {}
    if isinstance(module, tuple(a[1] for a in ARCHS.values())):
        if _has_hooks(module):  # (the decoder layer would hand it the residual to fuse into o_proj)
            return "the attention module has hooks (the fused one returns its output plus the residual)"
        kinds = {n: nn.Linear for n in (QKV.parts if "qkv" in ops else ()) + (("o_proj",) if "linear" in ops else ())}
    elif isinstance(module, tuple(a[2] for a in ARCHS.values())):
        if _has_hooks(module):
            return "the MLP has hooks (the fused one returns its output plus the residual)"
        act = module._modules.get("act_fn")
        if type(act).__name__ not in _SILU:
            return f"its activation is {type(act).__name__}, not SiLU (silu_mul fuses SiLU only)"
        if _has_hooks(act):
            return "act_fn has hooks (the fused forward does not call it)"
        kinds = {n: nn.Linear for n in ("gate_proj", "up_proj", "down_proj")}
    elif isinstance(module, tuple(a[0] for a in ARCHS.values())) and "layer_norm" in ops:
        norms = tuple(a[3] for a in ARCHS.values())
        kinds = {n: norms for n in ("input_layernorm", "post_attention_layernorm")}
    for n, kind in kinds.items():
        sub = module._modules[n]
        if type(sub) not in (kind if isinstance(kind, tuple) else (kind,)):
            return f"{n} is a {type(sub).__name__}, not a plain one (the fused forward would bypass it)"
        if _has_hooks(sub):
            return f"{n} has hooks (the fused forward does not call it)"
    return None


def check_inputs(model, args, kwargs):
    """Forward pre-hook on the base model: an empty batch or sequence is one clear error instead of a reshape error
    inside a fused op. Shapes only: no device sync, so it stays capturable."""
    x = kwargs.get("input_ids", args[0] if args else None)
    name = "input_ids"
    if x is None:
        x, name = kwargs.get("inputs_embeds"), "inputs_embeds"
    if x is not None and x.dim() >= 2 and (x.shape[0] == 0 or x.shape[1] == 0):
        raise FuseInferError(f"empty input: {name} has shape {tuple(x.shape)}; pass at least one row of at least one "
                             "token")
    return None


class LlamaPatchRules:
    """Patch and unpatch rules for the Llama architecture (``decode.py`` has the fast-decode parts)."""

    def patch(self, model: nn.Module, config: PatchConfig, report: PatchReport) -> dict:
        why = sliding_window_refusal(model.config)
        if why is not None:
            raise FuseInferError(why)
        if isinstance(config.quant, SmoothQuantW8A8):  # (before calibration runs the model)
            raise FuseInferError(SMOOTHQUANT_REFUSAL)
        ops = frozenset(config.ops)
        state = {"classes": [], "fused": [], "config": None, "attn_backends": []}
        like = next(model.parameters())
        layer_ops = ops & {"layer_norm", "linear"}
        attn_ops = ops & {"qkv", "linear", "attention"} - ({"attention"} if model.training else set())
        layers, attns, mlps, norms, bases = (tuple(a[i] for a in ARCHS.values()) for i in range(5))
        plan = []  # (module, name, ops): every filter_fn call and check comes before the first swap
        for name, module in model.named_modules():
            kind = type(module)
            if kind in layers and layer_ops and config.selects(module, name):
                plan.append((module, name, layer_ops))
            elif kind in attns and attn_ops and config.selects(module, name):
                plan.append((module, name, attn_ops))
            elif kind in mlps and "linear" in ops and config.selects(module, name):
                plan.append((module, name, frozenset({"linear"})))
            elif isinstance(module, bases) and type(module.norm) in norms and "layer_norm" in ops:
                norm_name = f"{name}.norm".lstrip(".")
                if config.selects(module.norm, norm_name):
                    plan.append((module.norm, norm_name, frozenset({"layer_norm"})))
        for module, name, module_ops in plan:
            why = _bypass_reason(module, module_ops, like)
            if why is not None:
                report.skipped.append((name, why))
                continue
            if isinstance(module, attns) and "qkv" in module_ops:
                self._fuse(module, QKV, state)
            elif isinstance(module, mlps):
                self._fuse(module, GATE_UP, state)
            self._swap(module, name, module_ops, state, report, like)
        found = [m for m in model.modules() if isinstance(m, bases)] if report.swaps else []
        state["input_checks"] = [m.register_forward_pre_hook(check_inputs, with_kwargs=True) for m in found]
        lock_models([m for m in found if type(m) in bases], lambda m: FUSED[type(m)], lock_holder(model), state)
        if "attention" in ops:
            install_attention(model, config, report, like, head_dim_of(model.config), attns, state)
        if not report.swaps:
            report.skipped.append(("all modules", f"no {model.config.model_type} module matched the config's ops and "
                                                  "filter_fn"))
        return state

    @staticmethod
    def _fuse(module: nn.Module, group: FusedWeight, state: dict) -> None:
        fuse(module, group)
        state["fused"].append((module, group))
        if group is QKV:  # state_dict hands the q/k/v weights out as copies (see the OPT family's hook)
            state.setdefault("qkv_hooks", []).append(module._register_state_dict_hook(_own_qkv_storage))
        else:
            state.setdefault("qkv_hooks", []).append(module._register_state_dict_hook(own_storage_hook(GATE_UP.parts)))

    @staticmethod
    def _swap(module, name, ops, state, report, like):
        cls = FUSED[type(module)]
        state["classes"].append((module, type(module)))
        backends = _backends(module, ops, like)
        cfg = getattr(module, "config", None)
        if backends.get("attention") == "cuda" and not KERNEL_GQA \
                and cfg.num_key_value_heads != cfg.num_attention_heads:
            backends["attention"] = "sdpa (grouped-query k / v: no kernel for them yet)"
        report.swaps.append(Swap(name, type(module).__name__, cls.__name__, backends))
        module.__class__ = cls
        module._fuseinfer_ops = frozenset(ops)
        placement.swap_forward(module, cls, state)

    def unpatch(self, model: nn.Module, state: dict) -> None:
        for module, group in state["fused"]:
            unfuse(module, group)
        for handle in [*state.get("qkv_hooks", ()), *state.get("input_checks", ())]:
            handle.remove()
        placement.restore_forwards(state)
        for module, cls in state["classes"]:
            module.__class__ = cls
            del module._fuseinfer_ops
        unlock_models(state, lambda m: _ORIGINAL[type(m)])
        restore_attention(model, state)


@torch.no_grad()
def init_rotary(model: nn.Module) -> None:
    """Recompute every rotary embedding's ``inv_freq`` / ``original_inv_freq`` (non-persistent buffers: no checkpoint
    holds them) as its ``__init__`` does, on the buffer's device (the CPU for one on the meta device)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for m in model.modules():
        if not (isinstance(m._buffers.get("inv_freq"), torch.Tensor) and hasattr(m, "rope_type")):
            continue
        init = m.compute_default_rope_parameters if m.rope_type == "default" else ROPE_INIT_FUNCTIONS[m.rope_type]
        inv_freq, m.attention_scaling = init(m.config, device=torch.device("cpu"))
        old = m._buffers["inv_freq"]
        dev = torch.device("cpu") if old.is_meta else old.device
        m._buffers["inv_freq"] = inv_freq.to(dev)
        if "original_inv_freq" in m._buffers:
            m._buffers["original_inv_freq"] = inv_freq.clone().to(dev)


def head_dim_of(config) -> int:
    """The attention head dim of a Llama-architecture config (``head_dim`` where set, else hidden / heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


__all__ = ["ARCHS", "FUSED", "GATE_UP", "QKV", "LlamaPatchRules", "ModuleOps", "fuse", "head_dim_of", "init_rotary",
           "link", "sliding_window_refusal", "unfuse"]
