"""The lean prefill loop over a patched OPTForCausalLM: ``decoder_layer`` over (B*S, E) activations with the
fused ops called straight into the extension on CUDA (``fuseinfer._C``; elsewhere the op wrappers and their
references), no mask built, the LM head for one position only (``lean_logits``), or the final hidden states of every
position (``lean_hidden``, for the patched model's own forward: ``runtime/forward.py``). ``runtime/prefill.py``
(modes, length buckets, CUDA graphs) reaches it through the family interface (``OPTFamily.prefill_reason`` /
``lean_logits`` / ``lean_hidden``).

Four strategies: :class:`LeanOps` (fp16/bf16), :class:`Int8LeanOps` (int8 weight-only linears, and W8A8 / FP8
linears at decode-sized inputs on CUDA, which run the int8 / e4m3 weight GEMV as the patched modules do),
:class:`W8A8LeanOps` (SmoothQuant: pre-LN, ``add_layer_norm_quant`` feeds q/k/v and fc1 int8 activations;
attention's and fc1's outputs are quantized per token for out_proj and fc2; post-LN, the LayerNorm output is the
residual stream, quantized apart) and :class:`Fp8LeanOps` (``Float8``: the same with e4m3 activations,
``add_layer_norm_quant_fp8`` and ``quantize_fp8_per_token``, and the FP8 GEMM). With ``fc2_input="static"`` fc1's
GEMM writes fc2's 8-bit input itself (``w8a8_linear_int8out`` / ``fp8_linear_fp8out``); with
``out_proj_input="static"`` the attention kernel writes out_proj's (``attention_int8out`` / ``attention_fp8out``).
They run the same ops in the same order as the patched modules.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fuseinfer.core.extension import extension
from fuseinfer.core.state import patch_state
from fuseinfer.layers.linear import decode_rows, writes_static_input
from fuseinfer.models.common import checked_plan, lean_call_reason, lean_plan
from fuseinfer.models.opt.layer import decoder_layer
from fuseinfer.ops import add_layer_norm, attention, w8a16_linear, linear_epilogue
from fuseinfer.ops.attention_8bit_out import attention_fp8out, attention_int8out
from fuseinfer.ops.fp8_gemv import fp8_weight_linear
from fuseinfer.ops.fp8_linear import FP8_DTYPE, fp8_linear, quantize_fp8_per_token
from fuseinfer.ops.linear_8bit_out import fp8_linear_fp8out, w8a8_linear_int8out
from fuseinfer.ops.kv_cache import kv_cache_append, kv_cache_append_fp8
from fuseinfer.ops.layer_norm_quant import add_layer_norm_quant, add_layer_norm_quant_fp8
from fuseinfer.ops.quant import quantize_per_token
from fuseinfer.ops.w8a8_linear import w8a8_backend, w8a8_linear


# ---- what the lean loop reads from the model ----

class _Plan:
    """The modules of a patched OPTForCausalLM the lean loop calls, checked once (see :func:`lean_reason`)."""

    def __init__(self, model: nn.Module):
        dec = model.model.decoder
        self.dec, self.lm_head = dec, model.lm_head
        self.pre_ln = bool(model.config.do_layer_norm_before)
        # the layers (their tensors are read at each call, so ``model.to`` and ``param.data = ...`` are seen)
        self.layers = tuple(dec.layers)
        attns = tuple(layer.self_attn for layer in self.layers)
        # the modules the patched forward calls (whose hooks it would run): the lean loop checks theirs at each
        # call; those it reads parameters from instead of calling (fc1, q_proj, ...) patch checked, and hooks added
        # to them later are not seen by the patched forward either (modules.py). Not the model itself (see _plan).
        dec_calls = [dec.embed_tokens, dec.embed_positions, dec.project_in, dec.project_out, dec.final_layer_norm]
        self.called = tuple(m for m in (model.model, dec, model.lm_head, *dec_calls,
                                        *(m for layer in dec.layers for m in (layer, layer.self_attn)))
                            if m is not None)
        # 8-bit models (SmoothQuant W8A8, FP8, or weight-only W8A16): every decoder linear quantized (q/k/v fused as
        # ``qkv_proj``), checked by _structure_reason; the lean loop reads their int8 weights, scales and biases at
        # each call
        self.quant = quant_kind(model)
        self.linears = ()
        self.fc2_after = {}
        if self.quant is not None:
            # the quantized linears per layer, (qkv_proj, out_proj, fc1, fc2): _linears_intact checks they are still
            # the modules' children at each call
            self.qkv = ()
            self.linears = tuple((attn._modules["qkv_proj"], attn._modules["out_proj"], layer._modules["fc1"],
                                  layer._modules["fc2"]) for layer, attn in zip(self.layers, attns))
            # q_proj / k_proj / v_proj: the quantizer's slices of qkv_proj; a projection swapped in after patch
            # makes the modules run three projections (modules._qkv_fused), so the lean loop must not run qkv_proj
            self.slices = tuple(tuple(attn._modules[n] for n in ("q_proj", "k_proj", "v_proj")) for attn in attns)
            # the sm90 kernel takes K % 16 == 0 and N % 8 == 0 (OPT's sizes all do); else the op wrapper dispatches
            self.w8a8_aligned = self.quant == "w8a8" and all(
                lin.weight_q.shape[1] % 16 == 0 and lin.weight_q.shape[0] % 8 == 0
                for lins in self.linears for lin in lins)
            # W8A8 / FP8: id(fc1) -> fc2, for the fc2s with a static input scale (fc2_input="static"; checked at
            # each call)
            self.fc2_after = {id(fc1): fc2 for _, _, fc1, fc2 in self.linears} if self.quant != "w8a16" else {}
        else:
            # the layers' q/k/v: (attention, its projections' linked parameters, the weight rows' byte step)
            self.qkv = tuple((attn, attn._fuseinfer_qkv_params,
                              attn.qkv_weight.numel() // 3 * attn.qkv_weight.element_size()) for attn in attns)
        self.heads = model.config.num_attention_heads
        self.head_dim = model.config.hidden_size // self.heads
        self.layer_count = len(dec.layers)


def quant_kind(model: nn.Module) -> str | None:
    """'w8a8' (SmoothQuantW8A8), 'fp8' (Float8), 'w8a16' (Int8WeightOnly) or None (not quantized) for a patched
    model."""
    from fuseinfer.core.quant_config import Float8, Int8WeightOnly, SmoothQuantW8A8

    state = patch_state(model)
    quant = None if state is None else state.config.quant
    if isinstance(quant, SmoothQuantW8A8):
        return "w8a8"
    if isinstance(quant, Float8):
        return "fp8"
    return "w8a16" if isinstance(quant, Int8WeightOnly) else None


def _int8_layer_reason(layer: nn.Module, kind: str) -> str | None:
    """Why a patched layer's linears are not all 8-bit linears of ``kind`` the lean loop can call (q/k/v fused as
    ``qkv_proj``), or None."""
    from fuseinfer.layers.linear import Int8WeightOnlyLinear, int8_input, quantized_input

    attn = layer.self_attn
    parts = {"q/k/v": attn._modules.get("qkv_proj"), "out_proj": attn._modules.get("out_proj"),
             "fc1": layer._modules.get("fc1"), "fc2": layer._modules.get("fc2")}
    if kind == "w8a8":
        lins = {n: int8_input(m) for n, m in parts.items()}
    elif kind == "fp8":  # (the linears that take per-token e4m3 activations: Float8Linear)
        lins = {n: lin if getattr(lin := quantized_input(m), "quantized_input", None) == "e4m3" else None
                for n, m in parts.items()}
    else:
        lins = {n: m if type(m) is Int8WeightOnlyLinear else None for n, m in parts.items()}
    missing = [n for n, lin in lins.items() if lin is None]
    if missing:
        return f"{', '.join(missing)} not {kind.upper()}-quantized"
    if not all(t.is_contiguous() for lin in lins.values() for t in lin.buffers()):
        return "an 8-bit weight or scale is not contiguous"
    return None


def _structure_reason(model: nn.Module) -> str | None:
    """Why the lean loop cannot stand in for ``model``'s patched modules (checked once per model), or None."""
    from fuseinfer.core.config import OPS
    from fuseinfer.layers import attention_backend
    from fuseinfer.models.opt.modules import FusedLayerNorm, FusedOPTAttention, FusedOPTDecoderLayer

    state = patch_state(model)
    if state is None or set(state.config.ops) != set(OPS) or state.config.filter_fn is not None:
        return "the lean prefill needs a model patched with every op and no filter_fn: call fuseinfer.patch(model)"
    kind = quant_kind(model)
    if state.config.quant is not None and kind is None:
        return (f"a {type(state.config.quant).__name__} model runs its patched modules (their int8 linears); "
                "the lean prefill takes fp16/bf16, Int8WeightOnly, SmoothQuantW8A8 and Float8 models")
    backends = {n for m in model.modules() for n in m.__dict__.get(attention_backend.ATTR, {}).values()}
    if backends - {"fuseinfer"}:  # (what patch resolved the config's backend to, per phase)
        return f"attention_backend={state.config.attention_backend!r} runs in the patched modules"
    if model.__class__.__name__ != "OPTForCausalLM":  # (__class__: a weak proxy's is its referent's)
        return f"the lean prefill needs an OPTForCausalLM, got {model.__class__.__name__}"
    dec = model.model.decoder
    if dec.final_layer_norm is not None and type(dec.final_layer_norm) is not FusedLayerNorm:
        return "the final LayerNorm is not patched"
    if type(model.lm_head) is not nn.Linear or any(
            m is not None and type(m) is not nn.Linear for m in (dec.project_in, dec.project_out)):
        return "the LM head or an embedding projection is not a plain nn.Linear"
    for i, layer in enumerate(dec.layers):
        attn = layer.self_attn
        if not (type(layer) is FusedOPTDecoderLayer and {"layer_norm", "linear"} <= layer._fuseinfer_ops
                and type(attn) is FusedOPTAttention and {"qkv", "linear", "attention"} <= attn._fuseinfer_ops
                and (kind is not None or getattr(attn, "qkv_weight", None) is not None)):
            return f"layer {i} is not fully fused (patch skipped part of it: see the report)"
        why = _int8_layer_reason(layer, kind) if kind is not None else None
        if why is not None:
            return f"layer {i}: {why}"
    if not all(t.is_contiguous() for t in model.parameters()):  # the extension takes contiguous weights only
        return "a parameter is not contiguous"
    return None


def _plan(model: nn.Module) -> tuple[_Plan | None, str | None]:
    """The model's plan, or None and why not (``models.common.lean_plan``: kept with the patch, rebuilt if the
    layer list is replaced). ``model`` may be a weak proxy (a session's)."""
    layers = getattr(getattr(getattr(model, "model", None), "decoder", None), "layers", None)
    return lean_plan(model, layers, _structure_reason, _Plan)


def lean_reason(model: nn.Module, weights: bool = True) -> str | None:
    """None when the lean loop computes what the patched modules would for this call, else why not. Checked at
    every call: training mode, autocast to another dtype, hooks on a module the patched forward calls (the loop
    calls none); with ``weights``, that each q/k/v projection still holds its rows of the fused (3E, E) buffer
    (``param.data = t`` unlinks them: the patched modules then run three GEMMs); once per patch: the structure
    (:func:`_structure_reason`)."""
    plan, why = _plan(model)
    if why is not None:
        return why
    why = lean_call_reason(model, plan.called, plan.lm_head.weight)
    if why is not None:
        return why
    if weights and plan.quant is not None and not _linears_intact(plan):
        return "an int8 linear was replaced after patch (the lean loop would not call it)"
    if weights and plan.quant is None and not _qkv_intact(plan):
        return "a q/k/v projection's weight was replaced after patch (the fused q/k/v GEMM would not see it)"
    return None


def _qkv_intact(plan: _Plan) -> bool:
    """``modules._qkv_linked`` for every layer, written out for speed (it runs at each lean call)."""
    for attn, linked, step in plan.qkv:
        mods = attn._modules
        q, k, v = mods["q_proj"]._parameters, mods["k_proj"]._parameters, mods["v_proj"]._parameters
        if not (q["weight"] is linked[0] and q["bias"] is linked[1] and k["weight"] is linked[2]
                and k["bias"] is linked[3] and v["weight"] is linked[4] and v["bias"] is linked[5]):
            return False
        w = attn.__dict__["qkv_weight"].data_ptr()
        if linked[0].data_ptr() != w or linked[2].data_ptr() != w + step or linked[4].data_ptr() != w + 2 * step:
            return False
        bias = attn.__dict__["qkv_bias"]
        if bias is not None:
            b, bstep = bias.data_ptr(), bias.numel() // 3 * bias.element_size()
            if linked[1].data_ptr() != b or linked[3].data_ptr() != b + bstep or linked[5].data_ptr() != b + 2 * bstep:
                return False
    return True


def _linears_intact(plan: _Plan) -> bool:
    """Every layer's int8 linears and q/k/v slices are still the ones the plan recorded (a module swapped in after
    patch is not)."""
    for layer, (qkv, out, fc1, fc2), (q, k, v) in zip(plan.layers, plan.linears, plan.slices):
        mods = layer._modules
        amods = mods["self_attn"]._modules
        if amods["qkv_proj"] is not qkv or amods["out_proj"] is not out or mods["fc1"] is not fc1 \
                or mods["fc2"] is not fc2 or amods["q_proj"] is not q or amods["k_proj"] is not k \
                or amods["v_proj"] is not v:
            return False
    return True



# ---- the strategies ----

class LeanOps:
    """fp16/bf16 strategy over (B*S, E): straight into the extension (``direct``: CUDA, the extension loaded for
    the device, fp16/bf16, a head dim the attention kernel takes), else the op wrappers (references on CPU), which
    choose exactly as the patched modules' calls do. One per forward; ``ctx``: (B, S, key_mask, q_start, cache,
    slots)."""

    kv_out = None  # a list each layer's attention appends its (k, v) (B, H, S, D) to (lean_hidden), or None

    def __init__(self, like: torch.Tensor, heads: int, head_dim: int):
        from fuseinfer.ops.attention import KERNEL_DTYPES, KERNEL_HEAD_DIMS

        ext = extension(like.device) if like.is_cuda else None
        self.direct = ext is not None and like.dtype in KERNEL_DTYPES and head_dim in KERNEL_HEAD_DIMS
        if self.direct:  # the calls _ext.route makes in eager CUDA mode, minus the wrappers' Python checks
            self.ln = lambda x, r, w, b, eps: ext.add_layer_norm(x, r, w, b, eps, False)[0]
            self.gemm = ext.linear_epilogue  # (x (M, K) contiguous, w, b, residual (M, N) or None, activation)
            self.attend = ext.attention
            self.append = ext.kv_cache_append
        else:
            self.ln = lambda x, r, w, b, eps: add_layer_norm(x, r, w, b, eps)[0]
            self.gemm = linear_epilogue
            self.attend = attention
            self.append = kv_cache_append
        self.dtype, self.heads, self.head_dim = like.dtype, heads, head_dim

    def norm(self, x, ln, residual=None):
        p = ln._parameters
        return self.ln(x, residual, p.get("weight"), p.get("bias"), ln.eps), (x if residual is None else None)

    def lin(self, x, lin: nn.Module, residual, activation: str) -> torch.Tensor:
        """act(x @ W.T + bias + residual) for ``lin``'s tensors, read at each call (so ``model.to`` and
        ``param.data = ...`` are seen); x (M, K) -> (M, N)."""
        p = lin._parameters
        return self.gemm(x, p["weight"], p["bias"], residual, activation)

    def qkv(self, attn: nn.Module, x) -> torch.Tensor:
        """The fused q/k/v GEMM: x (M, E) -> (M, 3E)."""
        d = attn.__dict__
        return self.gemm(x, d["qkv_weight"], d["qkv_bias"], None, "none")

    def linear(self, x, lin, residual=None, activation=None):
        if activation is None:
            return self.lin(x, lin, residual, "none")
        if activation.__class__.__name__ == "ReLU":  # (in the GEMM's epilogue)
            return self.lin(x, lin, residual, "relu")
        y = activation(self.lin(x, lin, None, "none"))
        return y if residual is None else residual + y

    def attention(self, i, attn, x, ctx):
        """Layer ``i``'s attention of x (B*S, E) -> (B*S, E). With a cache k/v go to its ``slots`` and attention
        reads the whole cache; without, attention reads this prompt's k/v."""
        b, s, key_mask, q_start, cache, slots = ctx
        heads, d = self.heads, self.head_dim
        q, k, v = self.qkv(attn, x).view(b, s, 3, heads, d).unbind(2)  # 3 x (B, S, H, D)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, S, D)
        if self.kv_out is not None:  # (lean_hidden's caller builds transformers' cache from them)
            self.kv_out.append((k, v))
        if cache is not None and getattr(cache, "kv_scales", None) is not None:  # an FP8 cache (the op wrappers)
            kv_scale = cache.kv_scales[i]  # (2, H)
            kv_cache_append_fp8(cache.keys[i], cache.values[i], k, v, slots, kv_scale, cache.calibrate)
            return attention(q, cache.keys[i], cache.values[i], key_mask, q_start, attn.scaling,
                             kv_scale).view(b * s, heads * d)
        if cache is not None:
            self.append(cache.keys[i], cache.values[i], k, v, slots)
            k, v = cache.keys[i], cache.values[i]  # (B, H, T, D)
        return self.attend_out(attn, q, k, v, key_mask, q_start)

    def attend_out(self, attn, q, k, v, key_mask, q_start):
        """The attention of q (B, H, S, D) over k, v (B, H, T, D) as out_proj's input: (B*S, E)."""
        b, _, s, _ = q.shape
        return self.attend(q, k, v, key_mask, q_start, attn.scaling).view(b * s, -1)


class Int8LeanOps(LeanOps):
    """LeanOps whose linears have 8-bit weights and fp16/bf16 activations (W8A16, and W8A8 / FP8 linears at
    decode-sized inputs): ``w8a16_linear`` straight into the extension where the fused ops are, else the op wrapper;
    e4m3 weights (FP8) ``fp8_weight_linear``, as ``Float8Linear.fused`` runs it there."""

    def __init__(self, like: torch.Tensor, heads: int, head_dim: int):
        super().__init__(like, heads, head_dim)
        ext = extension(like.device) if self.direct else None
        # (an extension built without the int8 ops: the wrapper, which falls back to the reference as well)
        self.int8 = ext.w8a16_linear if ext is not None and hasattr(ext, "w8a16_linear") else w8a16_linear

    def lin(self, x, lin, residual, activation: str) -> torch.Tensor:
        b = lin._buffers
        if "qweight" in b:  # Int8WeightOnlyLinear (its bias a Parameter or, for the fused q/k/v, a buffer)
            bias = lin._parameters["bias"] if "bias" in lin._parameters else b.get("bias")
            return self.int8(x, b["qweight"], b["scale"], bias, residual, activation)
        bias = b["bias"]  # W8A8Linear / Float8Linear: (N, 1) scales
        bias = None if bias is None else bias.to(self.dtype)
        if b["weight_q"].dtype == FP8_DTYPE:  # Float8Linear: the e4m3 weight GEMV
            return fp8_weight_linear(x, b["weight_q"], b["weight_scale"].view(-1), bias, residual, activation)
        return self.int8(x, b["weight_q"], b["weight_scale"].view(-1), bias, residual, activation)

    def qkv(self, attn, x):
        return self.lin(x, attn._modules["qkv_proj"], None, "none")


class W8A8LeanOps(LeanOps):
    """LeanOps plus the W8A8 ones: a LayerNorm that feeds a GEMM (pre-LN: ``norm`` without a residual) quantizes
    per token in the same pass, any other GEMM input is quantized per token, and every GEMM is the int8 one with its
    epilogue. Straight into the extension where the sm90 kernel serves every linear (``direct`` and
    ``w8a8_backend`` is ``cutlass-sm90``, the plan's shapes aligned), else the op wrappers (references on CPU,
    ``torch._int_mm`` + rescale on other GPUs), which choose as the patched W8A8 modules' calls do."""

    def __init__(self, like: torch.Tensor, heads: int, head_dim: int, aligned: bool, fc2_after: dict | None = None):
        super().__init__(like, heads, head_dim)
        ext = extension(like.device) if like.is_cuda else None
        kernel = self.direct and aligned and w8a8_backend(like.device, like.dtype) == "cutlass-sm90"
        if self.direct:  # (x contiguous (M, E)) -> (q int8 (M, E), scale fp32 (M, 1))
            self.ln_quant = lambda x, r, w, b, eps: ext.add_layer_norm_quant(x, r, w, b, eps, False)[:2]
            self.quant = ext.quantize_int8_rows  # (M, K) contiguous -> (q (M, K), scale (M,))
        else:
            self.ln_quant = lambda x, r, w, b, eps: add_layer_norm_quant(x, r, w, b, eps)[:2]
            self.quant = quantize_per_token
        self.w8a8 = self._kernel if kernel else self._wrapper
        self.attend_8bit = attention_int8out
        self.linear_8bit = w8a8_linear_int8out
        self.fc2_after = fc2_after or {}  # id(fc1) -> fc2 (the plan's)
        self._ext = ext

    def linear(self, x, lin, residual=None, activation=None):
        """As LeanOps.linear, except fc1 feeding an fc2 with a static input scale (``fc2_input="static"``): fc1's
        epilogue writes fc2's 8-bit input with that scale (ReLU first), handed on as (x_q, x_scale) like a
        quantizing LayerNorm's output."""
        nxt = self.fc2_after.get(id(lin))
        if not writes_static_input(lin, nxt) or residual is not None or not (
                activation is None or activation.__class__.__name__ == "ReLU"):
            return super().linear(x, lin, residual, activation)
        xq, xs = x if type(x) is tuple else self.quant(x)  # (M, K), (M,) or (M, 1)
        b = lin._buffers
        bias = b["bias"]
        bias = None if bias is None else bias.to(self.dtype)
        y = self.linear_8bit(xq, xs.view(-1, 1), b["weight_q"], b["weight_scale"], bias, nxt._buffers["input_scale"],
                             "none" if activation is None else "relu")  # (M, F) 8-bit
        return y, nxt.static_scales(y)

    def norm(self, x, ln, residual=None):
        if residual is not None:  # post-LN: the output is the residual stream
            return super().norm(x, ln, residual)
        p = ln._parameters
        return self.ln_quant(x, None, p.get("weight"), p.get("bias"), ln.eps), x  # (x_q, x_scale)

    def lin(self, x, lin, residual, activation: str) -> torch.Tensor:
        """x: (x_q, x_scale) from ``norm`` (or from the attention or fc1 writing 8 bits), or (M, K) activations
        quantized here: with the linear's static input scale where it holds one, as the module's own call quantizes
        them, else per token."""
        if type(x) is not tuple:
            x = lin.quantize_input(x) if lin._buffers.get("input_scale") is not None else self.quant(x)
        xq, xs = x
        return self.w8a8(xq, xs, lin, residual, activation)

    def attend_out(self, attn, q, k, v, key_mask, q_start):
        """LeanOps.attend_out, except for an out_proj with a static input scale (``out_proj_input="static"``): the
        attention kernel writes out_proj's 8-bit input with that scale, handed on as (x_q (B*S, E), x_scale)."""
        out_proj = attn._modules["out_proj"]
        scale = out_proj._buffers.get("input_scale")
        if scale is None:
            return super().attend_out(attn, q, k, v, key_mask, q_start)
        b, _, s, _ = q.shape
        y = self.attend_8bit(q, k, v, key_mask, q_start, attn.scaling, scale).view(b * s, -1)  # (B*S, E) 8-bit
        return y, out_proj.static_scales(y)

    def qkv(self, attn, x):
        return self.lin(x, attn._modules["qkv_proj"], None, "none")

    def _kernel(self, xq, xs, lin, residual, activation: str) -> torch.Tensor:
        """xq (M, K) int8, xs M fp32 per-token scales (or one static value) -> (M, N):
        ``torch.ops.fuseinfer_C.w8a8_linear`` (the CUTLASS sm90 kernel), without the wrapper's checks (the plan
        checked the shapes; every tensor here is contiguous)."""
        b = lin._buffers
        bias = b["bias"]
        out = torch.empty(xq.shape[0], b["weight_q"].shape[0], dtype=self.dtype, device=xq.device)  # (M, N)
        self._ext.w8a8_linear(xq, xs.view(-1), b["weight_q"], b["weight_scale"].view(-1),
                              None if bias is None else bias.to(self.dtype), residual, activation == "relu", out)
        return out

    def _wrapper(self, xq, xs, lin, residual, activation: str) -> torch.Tensor:
        b = lin._buffers
        bias = b["bias"]
        return w8a8_linear(xq, xs.view(-1, 1), b["weight_q"], b["weight_scale"],
                           None if bias is None else bias.to(self.dtype), residual, activation, self.dtype)


class Fp8LeanOps(W8A8LeanOps):
    """W8A8LeanOps in e4m3 (``Float8``): a pre-LN LayerNorm that feeds a GEMM runs as ``add_layer_norm_quant_fp8``,
    any other GEMM input (attention's output, fc1's) is quantized per token by ``quantize_fp8_per_token`` (one
    kernel on CUDA), and every GEMM is ``fp8_linear`` with the bias, residual and ReLU in its epilogue: the op
    wrappers, the calls ``Float8Linear`` and the patched modules make (the CUTLASS sm90 GEMM, ``torch._scaled_mm``
    or the reference, as the wrapper chooses)."""

    def __init__(self, like: torch.Tensor, heads: int, head_dim: int, fc2_after: dict | None = None):
        LeanOps.__init__(self, like, heads, head_dim)
        self.ln_quant = lambda x, r, w, b, eps: add_layer_norm_quant_fp8(x, r, w, b, eps)[:2]  # (M, E) e4m3, (M, 1)
        self.quant = quantize_fp8_per_token  # (M, K) -> (q (M, K) e4m3, scale (M, 1))
        self.w8a8 = self._fp8
        self.attend_8bit = attention_fp8out
        self.linear_8bit = fp8_linear_fp8out
        self.fc2_after = fc2_after or {}  # id(fc1) -> fc2 (the plan's)

    def _fp8(self, xq, xs, lin, residual, activation: str) -> torch.Tensor:
        """xq (M, K) e4m3, xs (M, 1) fp32 (or one static value) -> (M, N) in the model's dtype."""
        b = lin._buffers
        bias = b["bias"]
        return fp8_linear(xq, xs, b["weight_q"], b["weight_scale"], None if bias is None else bias.to(self.dtype),
                          residual, activation, self.dtype)


# ---- the loop ----

def _embed(plan: _Plan, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """tokens, positions (B, S) int64 -> (B*S, E), as OPTDecoder embeds them (positions: OPT's, -1 on padding)."""
    dec = plan.dec
    h = F.embedding(tokens, dec.embed_tokens.weight)  # (B, S, E_word)
    if dec.project_in is not None:
        h = F.linear(h, dec.project_in.weight)
    pe = dec.embed_positions
    h = h + F.embedding(positions + pe.offset, pe.weight)  # (B, S, E)
    return h.view(-1, h.shape[-1])


def _final(plan: _Plan, ops: LeanOps, h: torch.Tensor) -> torch.Tensor:
    """h (N, E) -> what the LM head reads (N, E_word): the final LayerNorm and project_out, as OPTDecoder ends."""
    dec = plan.dec
    if dec.final_layer_norm is not None:
        ln = dec.final_layer_norm
        h = ops.ln(h.contiguous(), None, ln._parameters.get("weight"), ln._parameters.get("bias"), ln.eps)
    if dec.project_out is not None:
        h = F.linear(h, dec.project_out.weight)
    return h


def _head(plan: _Plan, ops: LeanOps, h: torch.Tensor) -> torch.Tensor:
    """h (B, E) at the positions whose next token is wanted -> fp32 logits (B, V)."""
    return F.linear(_final(plan, ops, h), plan.lm_head.weight, plan.lm_head.bias).float()


def _layers(plan: _Plan, tokens, positions, key_mask, q_start, cache, slots, kv_out=None):
    """The embeddings and every decoder layer: (the strategy, h (B*S, E)). kv_out: see :func:`lean_hidden`."""
    b, s = tokens.shape
    h = _embed(plan, tokens, positions)  # (B*S, E)
    like = plan.lm_head.weight
    if plan.quant == "w8a8" and not decode_rows(h):
        ops = W8A8LeanOps(like, plan.heads, plan.head_dim, plan.w8a8_aligned, plan.fc2_after)
    elif plan.quant == "fp8" and not decode_rows(h):
        ops = Fp8LeanOps(like, plan.heads, plan.head_dim, plan.fc2_after)
    elif plan.quant is not None:  # W8A16, or W8A8 / FP8 at decode-sized inputs on CUDA (the GEMV, as the modules)
        ops = Int8LeanOps(like, plan.heads, plan.head_dim)
    else:
        ops = LeanOps(like, plan.heads, plan.head_dim)
    ops.kv_out = kv_out
    ctx, pre_ln = (b, s, key_mask, q_start, cache, slots), plan.pre_ln
    for i, layer in enumerate(plan.layers):
        h = decoder_layer(ops, i, layer, h, ctx, pre_ln)
    return ops, h


def _run(plan: _Plan, tokens, positions, key_mask, q_start, cache, slots, last=None) -> torch.Tensor:
    """The lean loop: fp32 logits (B, V) at position ``last`` ((1,) int64 on the device; None: the last one)."""
    b, s = tokens.shape
    ops, h = _layers(plan, tokens, positions, key_mask, q_start, cache, slots)
    h = h.view(b, s, -1)
    h = h[:, -1] if last is None else h.index_select(1, last).view(b, -1)  # (B, E)
    return _head(plan, ops, h)


@torch.no_grad()
def lean_logits(model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, key_mask=None, q_start=None,
                cache=None, slots=None, last=None) -> torch.Tensor:
    """``OPTFamily.lean_logits``: the lean loop over a patched OPTForCausalLM (check :func:`lean_reason` first)."""
    return _run(checked_plan(_plan(model)), tokens, positions, key_mask, q_start, cache, slots, last)


@torch.no_grad()
def lean_hidden(model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, key_mask=None,
                kv_out=None) -> torch.Tensor:
    """``OPTFamily.lean_hidden``: the lean loop without a cache, (B, S, E_word) in the model's dtype: what
    ``OPTModel``'s last_hidden_state is (after the final LayerNorm and project_out) at every position. tokens,
    positions: (B, S) int64 (OPT's positions, -1 on padding); key_mask (B, S) bool or None. kv_out: None, or a
    list to which each layer appends its (k, v), each (B, H, S, D) views, unscaled, as transformers' cache holds
    them."""
    plan = checked_plan(_plan(model))
    b, s = tokens.shape
    ops, h = _layers(plan, tokens, positions, key_mask, None, None, None, kv_out)
    return _final(plan, ops, h).view(b, s, -1)
