"""The lean prefill loop over a patched Llama / Mistral / Qwen2 causal LM: ``decoder_layer`` over (B*S, E)
activations with the fused ops called straight into the extension on CUDA (``fuseinfer._C``; elsewhere the op
wrappers and their references), no mask built, the rotary tables computed once for all layers, the LM head for one
position only. ``runtime/prefill.py`` (modes, length buckets, CUDA graphs) reaches it through the family interface
(``LlamaFamily.prefill_reason`` / ``lean_logits``); ``LlamaFamily.lean_hidden`` runs the same loop for the final
hidden states of every position (and, on request, each layer's k / v as transformers' DynamicCache holds them).

One strategy, :class:`LeanOps`, runs the ops of the patched modules (``modules.py``) in their order: fused residual +
RMSNorm (``add_rms_norm``), the fused q/k/v GEMM with the rotary and the split (and the static cache's write):
``linear_rope_append`` (one kernel at prefill on sm_90 with ``FUSEINFER_QKV_GEMM=1``), or for other quantized
weights and FP8 caches the GEMM and ``qkv_rope`` / ``qkv_rope_append``, attention, o_proj with the residual in its
epilogue, the fused gate/up GEMM with ``silu_mul`` as its activation (a GEMM then ``silu_mul``; one GEMV at
decode-sized inputs), down_proj with the residual. Each linear is
the fp16/bf16 GEMM or, for a model quantized with ``Int8WeightOnly``, the int8 weight-only one (W8A16), as the module
holding it says.

The rotary tables come from the model's own rotary module (every scaling transformers implements is in them);
``dynamic`` and ``longrope`` read the longest position on the host at each call, so those models are refused (as
fast decode refuses them). Nothing here reads the GPU from the host: the runtime captures the loop in CUDA graphs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fuseinfer.core.extension import extension
from fuseinfer.core.state import patch_state
from fuseinfer.layers.linear import Int8WeightOnlyLinear
from fuseinfer.models.common import checked_plan, lean_call_reason, lean_plan
from fuseinfer.models.llama.decode import _DYNAMIC_ROPE
from fuseinfer.models.llama.layer import decoder_layer
from fuseinfer.models.llama.modules import ARCHS, FUSED, GATE_UP, QKV, head_dim_of, qkv_operands
from fuseinfer.ops import (add_rms_norm, attention, linear_epilogue, linear_rope_append, qkv_rope, qkv_rope_append,
                           w8a16_linear)

CAUSAL_LMS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_LINEARS = (nn.Linear, Int8WeightOnlyLinear)  # what a linear the loop reads may be (fp16/bf16, or W8A16)
# the fused classes the patch swaps in, by role (any architecture's: a model holds its own)
_LAYERS, _ATTNS, _MLPS, _NORMS = ({FUSED[a[i]] for a in ARCHS.values()} for i in range(4))
_PLAIN_NORMS = tuple(a[3] for a in ARCHS.values())  # a decoder layer's own RMSNorms stay plain (the layer fuses them)
# (silu_mul: linear_epilogue's gate/up activation calls it at prefill sizes)
_RAW_OPS = ("add_rms_norm", "linear_epilogue", "qkv_rope", "qkv_rope_append", "linear_rope_append", "silu_mul",
            "attention")


# ---- what the lean loop reads from the model ----

class _Plan:
    """The modules of a patched causal LM the lean loop reads, checked once (see :func:`lean_reason`). Their tensors
    are read at each call, so ``model.to`` and ``param.data = ...`` are seen."""

    def __init__(self, model: nn.Module):
        base = model.model
        cfg = model.config
        self.base, self.lm_head = base, model.lm_head
        self.embed, self.rotary, self.norm = base.embed_tokens, base.rotary_emb, base.norm
        self.layers = tuple(base.layers)
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, head_dim_of(cfg)
        attns = [layer._modules["self_attn"] for layer in self.layers]
        mlps = [layer._modules["mlp"] for layer in self.layers]
        # the modules the patched forward calls (whose hooks it would run): checked at each call. Those it reads
        # tensors from instead of calling (q_proj, o_proj, the layers' RMSNorms, ...) were checked by patch, and
        # hooks added to them later are not seen by the patched forward either (modules.py).
        self.called = (model.model, self.embed, self.rotary, self.norm, self.lm_head, *self.layers, *attns, *mlps)
        # (a module's _modules, a child's name, the child): every module the loop reads, checked to still be there
        # at each call (a module swapped in after patch, e.g. an adapter, is run by the patched forward)
        kids = [(model._modules, "lm_head"), (model._modules, "model"), (base._modules, "embed_tokens"),
                (base._modules, "rotary_emb"), (base._modules, "norm"),
                *((base.layers._modules, key) for key in base.layers._modules)]
        for layer, attn, mlp in zip(self.layers, attns, mlps):
            kids += [(layer._modules, n) for n in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")]
            kids += [(attn._modules, n) for n in (*QKV.parts, "o_proj", QKV.name) if n in attn._modules]
            kids += [(mlp._modules, n) for n in (*GATE_UP.parts, "down_proj", GATE_UP.name) if n in mlp._modules]
        self.children = tuple((mods, name, mods[name]) for mods, name in kids)
        self.layer_list = base.layers._modules  # (a layer appended after patch: the patched forward runs it)
        # the fp16/bf16 fused weights: (module, the fused weight's and bias's __dict__ keys, ((a part's parameters,
        # its linked weight, its linked bias, its first row), ...)): the parts must still hold the Parameters linked
        # to the fused rows at each call
        # (``param.data = t`` unlinks them: the patched modules then run the parts' own GEMMs)
        links = []
        for module, group in [(a, QKV) for a in attns] + [(m, GATE_UP) for m in mlps]:
            if group.name in module._modules:  # quantized as one int8 linear (its parts: slices of it)
                continue
            linked, row, parts = module.__dict__[group.params], 0, []
            for j, name in enumerate(group.parts):
                proj = module._modules[name]
                parts.append((proj._parameters, linked[2 * j], linked[2 * j + 1], row))
                row += proj.out_features
            links.append((module, group.weight, group.bias, tuple(parts)))
        self.links = tuple(links)


def _structure_reason(model: nn.Module) -> str | None:
    """Why the lean loop cannot stand in for ``model``'s patched modules (checked once per patch), or None."""
    from fuseinfer.core.config import OPS
    from fuseinfer.core.quant_config import Int8WeightOnly
    from fuseinfer.layers import attention_backend

    state = patch_state(model)
    if state is None or set(state.config.ops) != set(OPS) or state.config.filter_fn is not None:
        return "the lean prefill needs a model patched with every op and no filter_fn: call fuseinfer.patch(model)"
    quant = state.config.quant
    if quant is not None and not isinstance(quant, Int8WeightOnly):
        return (f"a {type(quant).__name__} model runs its patched modules; the lean prefill takes fp16/bf16/fp32 and "
                "Int8WeightOnly models")
    if model.__class__.__name__ not in CAUSAL_LMS:  # (__class__: a weak proxy's is its referent's)
        return f"the lean prefill needs one of {', '.join(CAUSAL_LMS)}, got {model.__class__.__name__}"
    backends = {n for m in model.modules() for n in m.__dict__.get(attention_backend.ATTR, {}).values()}
    if backends - {"fuseinfer"}:  # (what patch resolved the config's backend to, per phase)
        return f"attention_backend={state.config.attention_backend!r} runs in the patched modules"
    base = model.model
    rope = getattr(base.rotary_emb, "rope_type", None) or \
        (getattr(model.config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope in _DYNAMIC_ROPE or "dynamic" in rope:  # (transformers updates any "dynamic" type per call)
        return (f"rope_type {rope!r} rescales its tables from the longest position seen (a host read per call), "
                "which the lean prefill's CUDA graphs cannot take")
    if type(base.norm) not in _NORMS:
        return "the final RMSNorm is not patched"
    if type(base.embed_tokens) is not nn.Embedding or type(model.lm_head) not in _LINEARS:
        return "the input embedding or the LM head is not a plain nn.Embedding / nn.Linear (or int8 linear)"
    for i, layer in enumerate(base.layers):
        attn, mlp = layer._modules.get("self_attn"), layer._modules.get("mlp")
        if not (type(layer) in _LAYERS and {"layer_norm", "linear"} <= layer._fuseinfer_ops
                and type(attn) in _ATTNS and {"qkv", "linear", "attention"} <= attn._fuseinfer_ops
                and type(mlp) in _MLPS and "linear" in mlp._fuseinfer_ops
                and all(type(layer._modules.get(n)) in _PLAIN_NORMS
                        for n in ("input_layernorm", "post_attention_layernorm"))
                and type(attn._modules.get("o_proj")) in _LINEARS and type(mlp._modules.get("down_proj")) in _LINEARS):
            return f"layer {i} is not fully fused (patch skipped part of it: see the report)"
        if attn.layer_idx != i:
            return f"layer {i}'s attention has layer_idx {attn.layer_idx} (its cache layer): the layers were reordered"
        for module, group in ((attn, QKV), (mlp, GATE_UP)):
            quantized = type(module._modules.get(group.name)) is Int8WeightOnlyLinear
            if not quantized and module.__dict__.get(group.weight) is None:
                return f"layer {i}: its {'/'.join(group.parts)} weights are not fused"
            if not quantized and not module.__dict__[group.weight].is_contiguous():
                return f"layer {i}: the fused {'/'.join(group.parts)} weight is not contiguous"
    # the extension takes contiguous tensors only
    if not all(t.is_contiguous() for t in (*model.parameters(), *model.buffers())):
        return "a parameter or buffer is not contiguous"
    return None


def _plan(model: nn.Module) -> tuple[_Plan | None, str | None]:
    layers = getattr(getattr(model, "model", None), "layers", None)
    return lean_plan(model, layers, _structure_reason, _Plan)


def lean_reason(model: nn.Module, weights: bool = True) -> str | None:
    """None when the lean loop computes what the patched modules would for this call, else why not. Checked at
    every call: training mode, autocast to another dtype, hooks on a module the patched forward calls (the loop
    calls none); with ``weights``, that every module the loop reads is still in its place and each fused weight's
    parts still its rows (else the patched modules run something else); once per patch: the structure
    (:func:`_structure_reason`)."""
    plan, why = _plan(model)
    if why is not None:
        return why
    why = lean_call_reason(model, plan.called, plan.embed.weight)
    if why is not None:
        return why
    if weights and not _intact(plan):
        return ("a module or weight the lean loop reads was replaced after patch (e.g. ``param.data = t`` on a q/k/v "
                "or gate/up projection, or a module swapped in): the patched modules run it")
    return None


def _intact(plan: _Plan) -> bool:
    """Every module the plan read is still in its place, and every fused weight's parts are still the Parameters
    linked to its rows (``modules._linked``, written out for speed: it runs at each lean call)."""
    if len(plan.layer_list) != len(plan.layers):
        return False
    for mods, name, module in plan.children:
        if mods.get(name) is not module:
            return False
    for module, weight, bias, parts in plan.links:
        w, b = module.__dict__[weight], module.__dict__[bias]
        wp, wstep = w.data_ptr(), w.stride(0) * w.element_size()
        for params, lw, lb, row in parts:
            if params["weight"] is not lw or params["bias"] is not lb or lw.data_ptr() != wp + row * wstep:
                return False
            if b is not None and lb.data_ptr() != b.data_ptr() + row * b.element_size():
                return False
    return True


# ---- the strategy ----

def _kernels(like: torch.Tensor):
    """The extension's ops for tensors like ``like`` (``core.extension.extension``), or None off CUDA."""
    return extension(like.device) if like.is_cuda else None


class LeanOps:
    """The patched modules' ops over (B*S, E) activations: straight into the extension (``direct``: CUDA, the
    extension loaded for the device with every op the loop calls, fp16/bf16, a head dim the attention kernel takes),
    else the op wrappers (references on CPU), which choose exactly as the patched modules' calls do. Each linear is
    an ``nn.Linear`` (``linear_epilogue``) or an ``Int8WeightOnlyLinear`` (``w8a16_linear``). One per forward;
    ``ctx``: (B, S, cos, sin, key_mask, q_start, cache, slots, kv_out)."""

    def __init__(self, like: torch.Tensor, heads: int, kv_heads: int, head_dim: int):
        from fuseinfer.ops.attention import KERNEL_DTYPES, KERNEL_GQA, KERNEL_HEAD_DIMS

        ext = _kernels(like)
        self.direct = (ext is not None and like.dtype in KERNEL_DTYPES and head_dim in KERNEL_HEAD_DIMS
                       and (KERNEL_GQA or heads == kv_heads) and all(hasattr(ext, n) for n in _RAW_OPS))
        if self.direct:  # the calls the wrappers make in eager CUDA mode, minus their Python checks
            self.rms = ext.add_rms_norm  # (x, residual, weight, eps, store_sum) -> (y, s)
            self.gemm = ext.linear_epilogue  # (x (M, K) contiguous, w, b, residual (M, N) or None, activation)
            self.rope = ext.qkv_rope
            self.rope_append = ext.qkv_rope_append
            self.rope_linear = ext.linear_rope_append
            self.attend = ext.attention
            # (an extension built without the int8 ops: the wrapper, which falls back to the reference as well)
            self.int8 = ext.w8a16_linear if hasattr(ext, "w8a16_linear") else w8a16_linear
        else:
            self.rms, self.gemm, self.rope, self.rope_append = add_rms_norm, linear_epilogue, qkv_rope, qkv_rope_append
            self.rope_linear = linear_rope_append
            self.attend, self.int8 = attention, w8a16_linear
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

    def norm(self, x, norm, residual=None):
        y, s = self.rms(x, residual, norm._parameters["weight"], norm.variance_epsilon, residual is not None)
        return y, (x if residual is None else s)

    def lin(self, x, lin: nn.Module, residual=None, activation: str = "none") -> torch.Tensor:
        """act(x @ W.T + bias + residual) for ``lin`` (nn.Linear or Int8WeightOnlyLinear); x (M, K) -> (M, N)."""
        p = lin._parameters
        if "qweight" in lin._buffers:  # Int8WeightOnlyLinear (its bias a Parameter or, for a fused one, a buffer)
            b = lin._buffers
            bias = p["bias"] if "bias" in p else b.get("bias")
            return self.int8(x, b["qweight"], b["scale"], bias, residual, activation)
        return self.gemm(x, p["weight"], p["bias"], residual, activation)

    def fused(self, module: nn.Module, group, x, activation: str = "none") -> torch.Tensor:
        """act(the fused GEMM of ``group`` (q/k/v or gate/up) of ``module``): x (M, E) -> (M, sum N_i), or (M, F)
        for gate/up with ``"silu_mul"``."""
        quant = module._modules.get(group.name)
        if quant is not None:
            return self.lin(x, quant, None, activation)
        d = module.__dict__
        return self.gemm(x, d[group.weight], d[group.bias], None, activation)

    def linear(self, x, lin, residual=None):
        return self.lin(x, lin, residual)

    def gated_mlp(self, mlp, x):
        return self.fused(mlp, GATE_UP, x, "silu_mul")  # (M, F): silu(gate) * up

    def attention(self, i, attn, x, ctx):
        """Layer ``i``'s attention of x (B*S, E) -> (B*S, H*D). With a cache the rotated k and v go to its ``slots``
        and attention reads the whole cache; without, attention reads this prompt's k/v (appended to ``kv_out``
        when it is a list)."""
        b, s, cos, sin, key_mask, q_start, cache, slots, kv_out = ctx
        if cache is not None and getattr(cache, "kv_scales", None) is not None:  # an FP8 cache (the op wrappers)
            k, v, kv_scale = cache.keys[i], cache.values[i], cache.kv_scales[i]  # (B, Hkv, T, D) e4m3, (2, Hkv)
            qkv = self.fused(attn, QKV, x).view(b, s, -1)  # (B, S, (H + 2 Hkv) D)
            q = qkv_rope_append(qkv, cos, sin, self.heads, self.kv_heads, k, v, slots, kv_scale, cache.calibrate)
            return attention(q, k, v, key_mask, q_start, attn.scaling, kv_scale).view(b * s, -1)
        operands = qkv_operands(attn)
        if operands is not None:  # fp16 / bf16 or int8 weight-only: projection, rotary, split (and cache write), one op
            if cache is not None:
                k, v = cache.keys[i], cache.values[i]  # (B, Hkv, T, D)
            else:  # written as (B, Hkv, S, D): slots are 0 .. S - 1 (ctx)
                k, v = (x.new_empty(b, self.kv_heads, s, self.head_dim) for _ in range(2))
            q = self.rope_linear(x.view(b, s, -1), *operands, cos, sin, self.heads, self.kv_heads, k, v,
                                 slots)  # (B, H, S, D)
        elif cache is not None:
            k, v = cache.keys[i], cache.values[i]  # (B, Hkv, T, D)
            qkv = self.fused(attn, QKV, x).view(b, s, -1)  # (B, S, (H + 2 Hkv) D)
            q = self.rope_append(qkv, cos, sin, self.heads, self.kv_heads, k, v, slots)  # (B, H, S, D)
        else:
            qkv = self.fused(attn, QKV, x).view(b, s, -1)  # (B, S, (H + 2 Hkv) D)
            q, k, v = self.rope(qkv, cos, sin, self.heads, self.kv_heads)  # (B, H, S, D), (B, Hkv, S, D) x 2
        if cache is None and kv_out is not None:
            kv_out.append((k, v))
        return self.attend(q, k, v, key_mask, q_start, attn.scaling).view(b * s, -1)  # (B, S, H, D) -> (B*S, H*D)


# ---- the loop ----

def _run(plan: _Plan, tokens, positions, key_mask, q_start, cache, slots, kv_out) -> tuple[torch.Tensor, LeanOps]:
    """The decoder layers over tokens, positions (B, S) int64: (the last layer's output (B, S, E), the strategy)."""
    b, s = tokens.shape
    h = F.embedding(tokens, plan.embed.weight).view(b * s, -1)  # (B*S, E)
    # the rotary tables of the positions, in h's dtype: the rotary module's own computation (every rope scaling
    # transformers implements), made once for all layers; (B, S, D), contiguous for the kernels
    cos, sin = plan.rotary(h, positions)
    cos, sin = cos.expand(b, s, -1).contiguous(), sin.expand(b, s, -1).contiguous()
    ops = LeanOps(h, plan.heads, plan.kv_heads, plan.head_dim)
    if cache is None:  # the q/k/v op writes k, v (B, Hkv, S, D) of each layer at these slots
        slots = torch.arange(s, device=h.device)
    ctx = (b, s, cos, sin, key_mask, q_start, cache, slots, kv_out)
    for i, layer in enumerate(plan.layers):
        h = decoder_layer(ops, i, layer, h, ctx)
    return h.view(b, s, -1), ops


def _final_norm(plan: _Plan, ops: LeanOps, h: torch.Tensor) -> torch.Tensor:
    """The final RMSNorm of h (..., E) (contiguous)."""
    return ops.rms(h, None, plan.norm._parameters["weight"], plan.norm.variance_epsilon, False)[0]


@torch.no_grad()
def lean_logits(model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, key_mask=None, q_start=None,
                cache=None, slots=None, last=None) -> torch.Tensor:
    """``LlamaFamily.lean_logits`` (see ``ModelFamily.lean_logits``): fp32 logits (B, V) at position ``last`` ((1,)
    int64 on the device; None: the last one). Check :func:`lean_reason` first."""
    plan = checked_plan(_plan(model))
    h, ops = _run(plan, tokens, positions, key_mask, q_start, cache, slots, None)
    b = h.shape[0]
    h = h[:, -1] if last is None else h.index_select(1, last).view(b, -1)  # (B, E)
    h = _final_norm(plan, ops, h.contiguous())
    head = plan.lm_head
    if type(head) is nn.Linear:  # (as the patched forward runs the head: transformers' nn.Linear)
        return F.linear(h, head.weight, head.bias).float()
    return ops.lin(h, head).float()  # an int8 LM head (include_lm_head=True)


@torch.no_grad()
def lean_hidden(model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, key_mask=None,
                kv_out=None) -> torch.Tensor:
    """``LlamaFamily.lean_hidden``: the final hidden states after the final RMSNorm, (B, S, E) in the model's dtype,
    for every position, without a cache (key_mask: (B, S) bool or None). ``kv_out``: None, or a list to which each
    layer appends its (k, v), each (B, Hkv, S, D) in the model's dtype as transformers' DynamicCache holds them (k
    rotated). Check :func:`lean_reason` first."""
    plan = checked_plan(_plan(model))
    h, ops = _run(plan, tokens, positions, key_mask, None, None, None, kv_out)
    return _final_norm(plan, ops, h)
