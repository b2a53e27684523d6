"""Fast prefill for patched models: a lean layer loop, and CUDA graphs of it per prompt-length bucket.

A patched model's forward goes through transformers' module calls, mask building and output plumbing: ~170 op
calls for OPT-1.3b whose host cost (5-6 ms) exceeded the GPU's (about 1 ms at 128 tokens) — issue 41. Two
paths replace it where the model allows (every op patched, no filter_fn, eval mode, no hooks, no autocast to
another dtype; else the patched modules run as before):

* **lean** (:func:`lean_logits`): the same fused ops in the same order as the patched modules, called in one loop
  over (B*S, E) activations: on CUDA straight into the extension (``fuseinfer_C`` ops), elsewhere through the op
  wrappers (their references). No mask is built (the attention op takes the key mask and ``q_start`` as they
  are), the LM head runs for the last position only. Nothing in it reads the GPU from the host, so a caller can
  capture it in a CUDA graph.
* **graph** (:class:`PrefillGraph`): fast decode's prefill (``_Session.begin``) replays, per batch bucket and
  prompt-length bucket (a multiple of ``LENGTH_BUCKET`` tokens), a CUDA graph of the lean loop over the session's
  static cache. A prompt of ``p`` tokens is right-padded to its bucket: the padding's keys land in cache slots
  ``[p, bucket)``, which the causal bound hides until decode overwrites them, and the logits are taken at
  position ``p - 1``. Graphs are captured on a bucket's first use, belong to the session's KV cache (so every
  session of a batch bucket, one per setting, replays the same ones: decode.py), share one memory pool per cache
  and go with it (``fuseinfer.runtime.release``).

SmoothQuant W8A8 models (``PatchConfig(quant=SmoothQuantW8A8(...))``, no filter_fn) take both paths too, with the
ops of the patched W8A8 modules (``patches/opt.py``): pre-LN, ``add_layer_norm_quant`` feeds the q/k/v and fc1
GEMMs int8 activations with per-token scales, and attention's and fc1's outputs are quantized per token
(``quantize_int8``) for out_proj and fc2; every GEMM is ``w8a8_linear`` (on an sm_90 GPU with the CUTLASS kernel,
straight into the extension). At decode-sized prompts on CUDA (at most 16 rows, ``quant/linear.py`` DECODE_ROWS)
their linears run the int8 weight-only GEMV instead, as the patched modules do. Int8 weight-only (W8A16) models take
both paths with fp16 LayerNorms and ``int8_linear`` for every decoder linear (the GEMV up to 16 rows, dequantize +
cuBLASLt above); their LM head must be fp16 (``include_lm_head=False``, the default).

``FUSEINFER_PREFILL`` picks: ``auto`` (graphs up to ``AUTO_GRAPH_MAX_TOKENS`` bucket tokens on CUDA, the lean
loop elsewhere), ``graph`` (graphs wherever they apply), ``lean`` or ``module`` (the patched modules, as before).
``fuseinfer.prefill(model, input_ids, attention_mask)`` is the lean loop without a cache, for callers who need
the next-token logits of a prompt.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import knobs
from .._ext import extension
from ..errors import FuseInferError
from ..ops import add_layer_norm, attention, int8_linear, linear_epilogue
from ..ops.int8_gemm import w8a8_backend, w8a8_linear
from ..ops.layer_norm_quant import add_layer_norm_quant
from ..ops.quant import quantize_per_token
from ..ops.kv_cache import kv_cache_append
from ..state import model_lock, patch_state, unwrapped
from ..quant.linear import DECODE_ROWS, decode_rows
from .cache import COUNTS
from .graphs import capture_stream

LENGTH_BUCKET = 128  # prompt lengths round up to a multiple of this in the graph path (<= 127 padded tokens)
# graphs where bucket rows x bucket length <= this (auto); above it the GPU time dwarfs the lean loop's host time
AUTO_GRAPH_MAX_TOKENS = 4096
# KV cache -> {length bucket: PrefillGraph} (a graph holds only a weak reference to its cache)
_graphs: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
PLAN_KEY = "prefill_plan"  # where the plan is kept in the patch state's family dict


# ---- what the lean loop reads from the model ----

@dataclass(frozen=True)
class _Layer:
    """One patched OPT decoder layer's modules, as the lean loop reads them (tensors are read at each call, so
    ``model.to`` and ``param.data = ...`` are seen)."""

    layer: nn.Module
    attn: nn.Module
    relu: bool


class _Plan:
    """The modules of a patched OPTForCausalLM the lean loop calls, checked once (see :func:`lean_reason`)."""

    def __init__(self, model: nn.Module):
        dec = model.model.decoder
        self.dec, self.lm_head = dec, model.lm_head
        self.pre_ln = bool(model.config.do_layer_norm_before)
        self.layers = tuple(_Layer(layer, layer.self_attn, layer.activation_fn.__class__.__name__ == "ReLU")
                            for layer in dec.layers)
        # the modules the patched forward calls (whose hooks it would run): the lean loop checks theirs at each
        # call; those it reads parameters from instead of calling (fc1, q_proj, ...) patch checked, and hooks added
        # to them later are not seen by the patched forward either (opt.py). Not the model itself (see _plan).
        dec_calls = [dec.embed_tokens, dec.embed_positions, dec.project_in, dec.project_out, dec.final_layer_norm]
        self.called = tuple(m for m in (model.model, dec, model.lm_head, *dec_calls,
                                        *(m for layer in dec.layers for m in (layer, layer.self_attn)))
                            if m is not None)
        # int8 models (SmoothQuant W8A8, or weight-only W8A16): every decoder linear quantized (q/k/v fused as
        # ``qkv_proj``), checked by _structure_reason; the lean loop reads their int8 weights, scales and biases at
        # each call
        self.quant = quant_kind(model)
        self.linears = ()
        if self.quant is not None:
            # the quantized linears per layer, (qkv_proj, out_proj, fc1, fc2): _linears_intact checks they are still
            # the modules' children at each call
            self.qkv = ()
            self.linears = tuple((lyr.attn._modules["qkv_proj"], lyr.attn._modules["out_proj"],
                                  lyr.layer._modules["fc1"], lyr.layer._modules["fc2"]) for lyr in self.layers)
            # q_proj / k_proj / v_proj: the quantizer's slices of qkv_proj; a projection swapped in after patch
            # makes the modules run three projections (opt._qkv_fused), so the lean loop must not run qkv_proj
            self.slices = tuple(tuple(lyr.attn._modules[n] for n in ("q_proj", "k_proj", "v_proj"))
                                for lyr in self.layers)
            # the sm90 kernel takes K % 16 == 0 and N % 8 == 0 (OPT's sizes all do); else the op wrapper dispatches
            self.w8a8_aligned = self.quant == "w8a8" and all(lin.weight_q.shape[1] % 16 == 0 and lin.weight_q.shape[0] % 8 == 0
                                                  for lins in self.linears for lin in lins)
        else:
            # the layers' q/k/v: (attention, its projections' linked parameters, the weight rows' byte step)
            self.qkv = tuple((lyr.attn, lyr.attn._fuseinfer_qkv_params,
                              lyr.attn.qkv_weight.numel() // 3 * lyr.attn.qkv_weight.element_size())
                             for lyr in self.layers)
        self.heads = model.config.num_attention_heads
        self.head_dim = model.config.hidden_size // self.heads
        self.layer_count = len(dec.layers)


def quant_kind(model: nn.Module) -> str | None:
    """'w8a8' (SmoothQuantW8A8), 'w8a16' (Int8WeightOnly) or None (not quantized) for a patched model."""
    from ..quant.config import Int8WeightOnly, SmoothQuantW8A8

    state = patch_state(model)
    quant = None if state is None else state.config.quant
    if isinstance(quant, SmoothQuantW8A8):
        return "w8a8"
    return "w8a16" if isinstance(quant, Int8WeightOnly) else None


def _int8_layer_reason(layer: nn.Module, kind: str) -> str | None:
    """Why a patched layer's linears are not all int8 linears of ``kind`` the lean loop can call (q/k/v fused as
    ``qkv_proj``), or None."""
    from ..quant.linear import Int8WeightOnlyLinear, int8_input

    attn = layer.self_attn
    parts = {"q/k/v": attn._modules.get("qkv_proj"), "out_proj": attn._modules.get("out_proj"),
             "fc1": layer._modules.get("fc1"), "fc2": layer._modules.get("fc2")}
    if kind == "w8a8":
        lins = {n: int8_input(m) for n, m in parts.items()}
    else:
        lins = {n: m if type(m) is Int8WeightOnlyLinear else None for n, m in parts.items()}
    missing = [n for n, lin in lins.items() if lin is None]
    if missing:
        return f"{', '.join(missing)} not {kind.upper()}-quantized"
    if not all(t.is_contiguous() for lin in lins.values() for t in lin.buffers()):
        return "an int8 weight or scale is not contiguous"
    return None


def _structure_reason(model: nn.Module) -> str | None:
    """Why the lean loop cannot stand in for ``model``'s patched modules (checked once per model), or None."""
    from ..config import OPS
    from ..patches import attention_backend, hf_attention
    from ..patches.opt import FusedLayerNorm, FusedOPTAttention, FusedOPTDecoderLayer

    state = patch_state(model)
    if state is None or set(state.config.ops) != set(OPS) or state.config.filter_fn is not None:
        return "the lean prefill needs a model patched with every op and no filter_fn: call fuseinfer.patch(model)"
    kind = quant_kind(model)
    if state.config.quant is not None and kind is None:
        return (f"a {type(state.config.quant).__name__} model runs its patched modules (their int8 linears); "
                "the lean prefill takes fp16/bf16, Int8WeightOnly and SmoothQuantW8A8 models")
    backends = {n for m in model.modules() for n in m.__dict__.get(attention_backend.ATTR, {}).values()}
    if backends - {"fuseinfer"}:  # (what patch resolved the config's backend to, per phase)
        return f"attention_backend={state.config.attention_backend!r} runs in the patched modules"
    if model.__class__.__name__ != "OPTForCausalLM":  # (__class__: a weak proxy's is its referent's)
        return f"the lean prefill needs an OPTForCausalLM, got {model.__class__.__name__}"
    if model.config._attn_implementation != hf_attention.NAME:
        return ("the model does not run the fuseinfer attention (patch() skips it in training mode: call "
                "model.eval() before fuseinfer.patch(model))")
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
    """The model's plan, or None and why not: built once per patch and kept with it (in the patch state, which
    unpatch drops and a deep copy of the model copies along with its modules), rebuilt if the layer list is
    replaced. ``model`` may be a weak proxy (a session's)."""
    state = patch_state(model)
    if state is None:
        return None, "fuseinfer.prefill needs a patched model: call fuseinfer.patch(model) first"
    layers = getattr(getattr(getattr(model, "model", None), "decoder", None), "layers", None)
    cached = state.state.get(PLAN_KEY)
    if cached is not None and cached[0] is layers:
        return cached[1], cached[2]
    why = _structure_reason(model)
    plan = _Plan(model) if why is None else None
    state.state[PLAN_KEY] = (layers, plan, why)
    return plan, why


def lean_reason(model: nn.Module, weights: bool = True) -> str | None:
    """None when the lean loop computes what the patched modules would for this call, else why not. Checked at
    every call: training mode, autocast to another dtype, hooks on a module the patched forward calls (the loop
    calls none); with ``weights``, that each q/k/v projection still holds its rows of the fused (3E, E) buffer
    (``param.data = t`` unlinks them: the patched modules then run three GEMMs); once per patch: the structure
    (:func:`_structure_reason`)."""
    from ..patches.opt import _global_hooks, _has_hooks

    plan, why = _plan(model)
    if why is not None:
        return why
    if model.training:
        return "model is in training mode"
    dev, dtype = plan.lm_head.weight.device.type, plan.lm_head.weight.dtype
    if torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) != dtype:
        return "autocast to another dtype than the model's (the patched modules run the original forward)"
    if _global_hooks() or any(_has_hooks(m) for m in (model, *plan.called) if m._forward_hooks
                              or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                              or "forward" in m.__dict__ or "_hf_hook" in m.__dict__):
        return "a module has hooks, which the lean loop would bypass"
    if weights and plan.quant is not None and not _linears_intact(plan):
        return "an int8 linear was replaced after patch (the lean loop would not call it)"
    if weights and plan.quant is None and not _qkv_intact(plan):
        return "a q/k/v projection's weight was replaced after patch (the fused q/k/v GEMM would not see it)"
    return None


def _qkv_intact(plan: _Plan) -> bool:
    """``opt._qkv_linked`` for every layer, written out for speed (it runs at each lean call)."""
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
    for lyr, (qkv, out, fc1, fc2), (q, k, v) in zip(plan.layers, plan.linears, plan.slices):
        amods, mods = lyr.attn._modules, lyr.layer._modules
        if amods["qkv_proj"] is not qkv or amods["out_proj"] is not out or mods["fc1"] is not fc1 \
                or mods["fc2"] is not fc2 or amods["q_proj"] is not q or amods["k_proj"] is not k \
                or amods["v_proj"] is not v:
            return False
    return True


# ---- the ops the loop calls ----

class _Ops:
    """The four fused ops over 2-D activations: straight into the extension (``direct``: CUDA, the extension
    loaded for the device, fp16/bf16, a head dim the attention kernel takes), else the op wrappers (references on
    CPU), which choose exactly as the patched modules' calls do."""

    def __init__(self, like: torch.Tensor, head_dim: int):
        from ..ops.attention import KERNEL_DTYPES, KERNEL_HEAD_DIMS

        ext = extension(like.device) if like.is_cuda else None
        self.direct = ext is not None and like.dtype in KERNEL_DTYPES and head_dim in KERNEL_HEAD_DIMS
        if self.direct:  # the calls _ext.route makes in eager CUDA mode, minus the wrappers' Python checks
            self.ln = lambda x, r, w, b, eps: ext.add_layer_norm(x, r, w, b, eps, False)[0]
            self.linear = ext.linear_epilogue  # (x (M, K) contiguous, w, b, residual (M, N) or None, activation)
            self.attention = ext.attention
            self.append = ext.kv_cache_append
        else:
            self.ln = lambda x, r, w, b, eps: add_layer_norm(x, r, w, b, eps)[0]
            self.linear = linear_epilogue
            self.attention = attention
            self.append = kv_cache_append
        self.dtype = like.dtype

    def lin(self, spec, x, residual, activation: str) -> torch.Tensor:
        """act(x @ W.T + bias + residual); spec (weight (N, K), bias (N,) or None); x (M, K) -> (M, N)."""
        return self.linear(x, spec[0], spec[1], residual, activation)


class _Int8Ops(_Ops):
    """_Ops whose linears have int8 weights and fp16/bf16 activations (W8A16, and W8A8 linears at decode-sized
    inputs): ``int8_linear`` straight into the extension where the fused ops are, else the op wrapper."""

    def __init__(self, like: torch.Tensor, head_dim: int):
        super().__init__(like, head_dim)
        ext = extension(like.device) if self.direct else None
        # (an extension built without the int8 ops: the wrapper, which falls back to the reference as well)
        self.int8 = ext.w8a16_linear if ext is not None and hasattr(ext, "w8a16_linear") else int8_linear

    def lin(self, spec, x, residual, activation: str) -> torch.Tensor:
        """spec (qweight (N, K) int8, scale (N,) fp32, bias (N,) or None); x (M, K) -> (M, N)."""
        return self.int8(x, spec[0], spec[1], spec[2], residual, activation)


class _W8A8Ops(_Ops):
    """_Ops plus the W8A8 ones over 2-D activations: LayerNorm + per-token quantize, per-token quantize, and the
    int8 GEMM with its epilogue. Straight into the extension where the sm90 kernel serves every linear (``direct``
    and ``w8a8_backend`` is ``cutlass-sm90``, the plan's shapes aligned), else the op wrappers (references on CPU,
    ``torch._int_mm`` + rescale on other GPUs), which choose as the patched W8A8 modules' calls do."""

    def __init__(self, like: torch.Tensor, head_dim: int, aligned: bool):
        super().__init__(like, head_dim)
        ext = extension(like.device) if like.is_cuda else None
        kernel = self.direct and aligned and w8a8_backend(like.device, like.dtype) == "cutlass-sm90"
        if self.direct:  # (x contiguous (M, E)) -> (q int8 (M, E), scale fp32 (M, 1))
            self.ln_quant = lambda x, r, w, b, eps: ext.add_layer_norm_quant(x, r, w, b, eps, False)[:2]
            self.quant = ext.quantize_int8_rows  # (M, K) contiguous -> (q (M, K), scale (M,))
        else:
            self.ln_quant = lambda x, r, w, b, eps: add_layer_norm_quant(x, r, w, b, eps)[:2]
            self.quant = quantize_per_token
        self.w8a8 = self._kernel if kernel else self._wrapper
        self._ext = ext

    def _kernel(self, xq, xs, lin, residual, activation: str) -> torch.Tensor:
        """xq (M, K) int8, xs M fp32 per-token scales -> (M, N): ``torch.ops.fuseinfer_C.w8a8_linear`` (the CUTLASS sm90
        kernel), without the wrapper's checks (the plan checked the shapes; every tensor here is contiguous)."""
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


def _param(module: nn.Module, name: str):
    return module._parameters[name] if module is not None else None


def _ln_args(ln: nn.LayerNorm):
    return ln._parameters.get("weight"), ln._parameters.get("bias"), ln.eps


def _fp_specs(lyr: _Layer) -> tuple:
    """A fp16/bf16 layer's linears as (weight, bias) pairs: (q/k/v fused, out_proj, fc1, fc2), read at each call."""
    attn, mods = lyr.attn, lyr.layer._modules
    out, fc1, fc2 = attn._modules["out_proj"]._parameters, mods["fc1"]._parameters, mods["fc2"]._parameters
    return ((attn.__dict__["qkv_weight"], attn.__dict__["qkv_bias"]), (out["weight"], out["bias"]),
            (fc1["weight"], fc1["bias"]), (fc2["weight"], fc2["bias"]))


def _int8_specs(linears: tuple, dtype: torch.dtype) -> tuple:
    """A layer's int8 linears (Int8WeightOnlyLinear or W8A8Linear) as (qweight, scale (N,), bias) triples."""
    specs = []
    for lin in linears:
        b = lin._buffers
        if "qweight" in b:  # Int8WeightOnlyLinear (its bias a Parameter or, for the fused q/k/v, a buffer)
            bias = lin._parameters["bias"] if "bias" in lin._parameters else b.get("bias")
            specs.append((b["qweight"], b["scale"], bias))
        else:  # W8A8Linear: (N, 1) scales
            bias = b["bias"]
            specs.append((b["weight_q"], b["weight_scale"].view(-1), None if bias is None else bias.to(dtype)))
    return tuple(specs)


def _attend(plan: _Plan, ops: _Ops, i: int, attn: nn.Module, qkv: torch.Tensor, b: int, s: int, key_mask, q_start,
            cache, slots) -> torch.Tensor:
    """Layer ``i``'s attention from its fused q/k/v output (B*S, 3E) -> (B*S, E). With ``cache`` k/v go to its
    ``slots`` and attention reads the whole cache; without, attention reads this prompt's k/v."""
    heads, d = plan.heads, plan.head_dim
    q, k, v = qkv.view(b, s, 3, heads, d).unbind(2)  # 3 x (B, S, H, D)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, S, D)
    if cache is not None:
        ops.append(cache.keys[i], cache.values[i], k, v, slots)
        k, v = cache.keys[i], cache.values[i]  # (B, H, T, D)
    return ops.attention(q, k, v, key_mask, q_start, attn.scaling).view(b * s, heads * d)


def _layers(plan: _Plan, ops: _Ops, h: torch.Tensor, b: int, s: int, key_mask, q_start, cache, slots):
    """h (B*S, E) after the embeddings -> (B*S, E) after the last decoder layer. With ``cache`` k/v go to its
    ``slots`` and attention reads the whole cache; without, attention reads this prompt's k/v. The linears are
    fp16/bf16 (``_Ops``) or have int8 weights (``_Int8Ops``: the plan's quantized linears)."""
    for i, lyr in enumerate(plan.layers):
        layer, attn = lyr.layer, lyr.attn
        mods = layer._modules
        qkv_w, out_w, fc1_w, fc2_w = _int8_specs(plan.linears[i], ops.dtype) if plan.linears else _fp_specs(lyr)
        ln1, ln2 = _ln_args(mods["self_attn_layer_norm"]), _ln_args(mods["final_layer_norm"])
        x = ops.ln(h, None, *ln1) if plan.pre_ln else h  # (B*S, E)
        qkv = ops.lin(qkv_w, x, None, "none")  # (B*S, 3E)
        a = _attend(plan, ops, i, attn, qkv, b, s, key_mask, q_start, cache, slots)  # (B*S, E)
        if plan.pre_ln:  # residual adds in the out_proj / fc2 epilogues, as FusedOPTDecoderLayer does
            h = ops.lin(out_w, a, h, "none")
            x = ops.ln(h, None, *ln2)
            f = _fc1(ops, lyr, layer, fc1_w, x)
            h = ops.lin(fc2_w, f, h, "none")
        else:  # post-LN (opt-350m): the residual adds in the LayerNorms
            a = ops.lin(out_w, a, None, "none")
            h = ops.ln(a, h, *ln1)
            f = _fc1(ops, lyr, layer, fc1_w, h)
            f = ops.lin(fc2_w, f, None, "none")
            h = ops.ln(f, h, *ln2)
    return h


def _layers_w8a8(plan: _Plan, ops: _W8A8Ops, h: torch.Tensor, b: int, s: int, key_mask, q_start, cache, slots):
    """_layers for a SmoothQuant W8A8 model: the same ops in the same order as its patched modules (pre-LN: the
    LayerNorms quantize in the same pass; post-LN: the LayerNorm output is the residual stream, so it is quantized
    apart). h (B*S, E) -> (B*S, E)."""
    for i, (lyr, (qkv_l, out_l, fc1_l, fc2_l)) in enumerate(zip(plan.layers, plan.linears)):
        layer, attn = lyr.layer, lyr.attn
        mods = layer._modules
        ln1, ln2 = _ln_args(mods["self_attn_layer_norm"]), _ln_args(mods["final_layer_norm"])
        act = "relu" if lyr.relu else "none"
        if plan.pre_ln:
            qkv = ops.w8a8(*ops.ln_quant(h, None, *ln1), qkv_l, None, "none")  # (B*S, 3E)
        else:
            qkv = ops.w8a8(*ops.quant(h), qkv_l, None, "none")
        a = _attend(plan, ops, i, attn, qkv, b, s, key_mask, q_start, cache, slots)  # (B*S, E)
        if plan.pre_ln:  # residual adds in the out_proj / fc2 epilogues
            h = ops.w8a8(*ops.quant(a), out_l, h, "none")
            f = ops.w8a8(*ops.ln_quant(h, None, *ln2), fc1_l, None, act)  # (B*S, F)
            f = f if lyr.relu else layer.activation_fn(f)
            h = ops.w8a8(*ops.quant(f), fc2_l, h, "none")
        else:  # post-LN (opt-350m): the residual adds in the LayerNorms
            a = ops.w8a8(*ops.quant(a), out_l, None, "none")
            h = ops.ln(a, h, *ln1)
            f = ops.w8a8(*ops.quant(h), fc1_l, None, act)
            f = f if lyr.relu else layer.activation_fn(f)
            f = ops.w8a8(*ops.quant(f), fc2_l, None, "none")
            h = ops.ln(f, h, *ln2)
    return h


def _fc1(ops: _Ops, lyr: _Layer, layer: nn.Module, spec, x: torch.Tensor) -> torch.Tensor:
    f = ops.lin(spec, x, None, "relu" if lyr.relu else "none")
    return f if lyr.relu else layer.activation_fn(f)


def _embed(plan: _Plan, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """tokens, positions (B, S) int64 -> (B*S, E), as OPTDecoder embeds them (positions: OPT's, -1 on padding)."""
    dec = plan.dec
    h = F.embedding(tokens, dec.embed_tokens.weight)  # (B, S, E_word)
    if dec.project_in is not None:
        h = F.linear(h, dec.project_in.weight)
    pe = dec.embed_positions
    h = h + F.embedding(positions + pe.offset, pe.weight)  # (B, S, E)
    return h.view(-1, h.shape[-1])


def _head(plan: _Plan, ops: _Ops, h: torch.Tensor) -> torch.Tensor:
    """h (B, E) at the positions whose next token is wanted -> fp32 logits (B, V)."""
    dec = plan.dec
    if dec.final_layer_norm is not None:
        h = ops.ln(h.contiguous(), None, *_ln_args(dec.final_layer_norm))
    if dec.project_out is not None:
        h = F.linear(h, dec.project_out.weight)
    return F.linear(h, plan.lm_head.weight, plan.lm_head.bias).float()


def _run(plan: _Plan, tokens, positions, key_mask, q_start, cache, slots, last=None) -> torch.Tensor:
    """The lean loop: fp32 logits (B, V) at position ``last`` ((1,) int64 on the device; None: the last one)."""
    b, s = tokens.shape
    h = _embed(plan, tokens, positions)  # (B*S, E)
    if plan.quant == "w8a8" and not decode_rows(h):
        ops = _W8A8Ops(plan.lm_head.weight, plan.head_dim, plan.w8a8_aligned)
        h = _layers_w8a8(plan, ops, h, b, s, key_mask, q_start, cache, slots)
    else:  # fp16/bf16, W8A16, or W8A8 at decode-sized inputs on CUDA (the GEMV, as the patched modules run it)
        ops = _Int8Ops(plan.lm_head.weight, plan.head_dim) if plan.quant else _Ops(plan.lm_head.weight, plan.head_dim)
        h = _layers(plan, ops, h, b, s, key_mask, q_start, cache, slots)
    h = h.view(b, s, -1)
    h = h[:, -1] if last is None else h.index_select(1, last).view(b, -1)  # (B, E)
    return _head(plan, ops, h)


# ---- entry points ----

@torch.no_grad()
def lean_logits(model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, cache=None, q_start=None,
                key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The lean loop over a patched OPTForCausalLM (check :func:`lean_reason` first): fp32 logits (B, V) of the
    last position. tokens, positions: (B, S) int64 (OPT positions, -1 on padding). With ``cache`` (a
    :class:`~fuseinfer.runtime.StaticKVCache`) k/v go to ``cache.write_idx`` and the mask is the cache's
    ``key_mask`` with ``q_start`` (B,) int32, as ``forward_last_logits`` does; without, ``key_mask`` (B, S) bool
    or None."""
    plan, why = _plan(model)
    if why is not None:
        raise FuseInferError(why)
    if cache is not None:
        return _run(plan, tokens, positions, cache.key_mask, q_start, cache, cache.write_idx)
    return _run(plan, tokens, positions, key_mask, None, None, None)


def prefill(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token logits of a prompt through a patched model: fp32 (B, V), those of the last position (what
    ``model(input_ids, attention_mask=..., logits_to_keep=1).logits[:, -1]`` gives, without transformers' host
    work). Left-pad batches (the last column must be a real token). Inference only (no gradients). Takes the lean
    loop where the model allows it (see :func:`lean_reason`), else the patched forward. No host sync: a caller may
    capture it in a CUDA graph (static shapes, after a warm-up call)."""
    model = unwrapped(model)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or min(input_ids.shape) == 0:
        raise FuseInferError(f"input_ids must be a non-empty (batch, length) tensor, got "
                             f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise FuseInferError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                             f"{tuple(input_ids.shape)}")
    # the model's lock: a patch / unpatch in another thread waits for this call (the lean loop reads the patched
    # layers directly, never through the decoder's locked forward), and this call waits for it
    with model_lock(model), torch.no_grad():
        if lean_reason(model) is not None:
            out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=1)
            return out.logits[:, -1].float()
        if attention_mask is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape)
            key_mask = None
        else:
            mask = attention_mask.long()
            positions = mask.cumsum(1) * mask - 1  # (B, S), -1 on padding, as OPT does
            key_mask = attention_mask.bool()
        return lean_logits(model, input_ids, positions, key_mask=key_mask)


def mode() -> str:
    """FUSEINFER_PREFILL: ``auto``, ``graph``, ``lean`` or ``module``."""
    return knobs.get("FUSEINFER_PREFILL")


def length_bucket(p: int) -> int:
    """The graph path's prompt-length bucket: ``p`` rounded up to a multiple of LENGTH_BUCKET."""
    return -(-p // LENGTH_BUCKET) * LENGTH_BUCKET


def session_prefill(session, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Fast decode's prefill (``_Session.begin``): ids, pos (bucket rows, P) into the session's cache, slots
    [0, P) (``session.cache.write_idx``), with its key mask and ``q_start``; fp32 logits of position P - 1
    (bucket rows, V). Graph, lean loop or patched modules, as FUSEINFER_PREFILL and the model allow."""
    model, choice = session.model, mode()
    # (a captured graph's weights are checked when it is captured; a session's model keeps them: session_for)
    if choice != "module" and lean_reason(model, weights=False) is None:
        graph = _graph_for(session, ids.shape[1], choice)
        if graph is not None:
            return graph.run(ids, pos, session.pad)
        if lean_reason(model) is None:
            return lean_logits(model, ids, pos, session.cache, session.q_start)
    return session.forward(model, ids, pos, session.cache, session.q_start)


def _graph_for(session, p: int, choice: str):
    """The session's prefill graph for prompts of ``p`` tokens (captured on first use), or None where the graph
    path does not apply: not CUDA, CUDA graphs off, the bucket past the cache, or (auto) too many tokens."""
    dev = session.tokens.device
    if choice not in ("auto", "graph") or dev.type != "cuda" or knobs.get("FUSEINFER_CUDA_GRAPHS") == "0":
        return None
    length = length_bucket(p)
    if length > session.capacity or (choice == "auto" and session.bucket * length > AUTO_GRAPH_MAX_TOKENS):
        return None
    if session.bucket * p <= DECODE_ROWS and quant_kind(session.model) is not None:
        # int8 linears at <= DECODE_ROWS rows run the GEMV (the modules and the lean loop); a graph pads the prompt
        # to its 128-token bucket, which would switch them to the prefill GEMM (another computation for W8A8)
        return None
    graphs = _graphs.setdefault(session.cache, {})
    graph = graphs.get(length)
    if graph is None:
        if lean_reason(session.model) is not None:  # the weights, unchecked by the caller
            return None
        pool = next(iter(graphs.values())).pool if graphs else None
        graph = graphs[length] = PrefillGraph(session, length, pool)
    return graph


def graph_stats(session) -> dict:
    """{length bucket: {'capture_ms', 'pool_bytes'}} of the prefill graphs of a session's cache (the benchmark)."""
    return {n: {"capture_ms": g.capture_ms, "pool_bytes": g.pool_bytes}
            for n, g in _graphs.get(session.cache, {}).items()}


class PrefillGraph:
    """A CUDA graph of the lean loop over a session's cache for prompts right-padded to ``length`` tokens. It reads
    nothing of the session but its model and cache, so every session over that cache replays it."""

    def __init__(self, session, length: int, pool=None):
        """pool: another prefill graph's memory pool to share (graphs of one cache never run concurrently: calls
        are serialised per model, and each graph's logits are consumed before the next replay)."""
        COUNTS["prefill_graph"] += 1
        self.model = session.model  # (a weak proxy)
        self.cache = weakref.proxy(session.cache)  # (the cache keys _graphs: a strong reference would keep it)
        bucket, dev = session.bucket, session.tokens.device
        self.q_start = torch.zeros(bucket, dtype=torch.int32, device=dev)  # (Bb,) prefill starts at slot 0
        self.length = length
        self.ids = torch.full((bucket, length), session.pad, dtype=torch.long, device=dev)  # (Bb, L)
        self.pos = torch.full((bucket, length), -1, dtype=torch.long, device=dev)  # (Bb, L)
        self.slots = torch.arange(length, device=dev)  # (L,) cache slots the graph writes
        self.last = torch.zeros(1, dtype=torch.long, device=dev)  # (1,) position whose logits are returned
        self.graph = torch.cuda.CUDAGraph()
        self.logits = None
        torch.cuda.synchronize(dev)
        before, start = torch.cuda.memory_reserved(dev), time.perf_counter()
        self._capture(pool)
        torch.cuda.synchronize(dev)
        self.capture_ms = (time.perf_counter() - start) * 1e3  # two warm-up runs + the capture
        self.pool_bytes = torch.cuda.memory_reserved(dev) - before  # what the capture reserved (0 when shared)
        self.pool = self.graph.pool()

    def _forward(self) -> torch.Tensor:
        plan, _ = _plan(self.model)
        cache = self.cache
        return _run(plan, self.ids, self.pos, cache.key_mask, self.q_start, cache, self.slots, self.last)

    def _capture(self, pool) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph (cuBLASLt's choice, attention's buffers)
            for _ in range(2):
                self._forward()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph, pool=pool, stream=capture_stream(self.graph, self.ids.device)):
            self.logits = self._forward()  # (Bb, V) fp32, in the graph's pool

    def run(self, ids: torch.Tensor, pos: torch.Tensor, pad: int) -> torch.Tensor:
        """ids, pos (Bb, P <= length) -> fp32 logits (Bb, V) of position P - 1; valid until the next replay of a
        graph of this cache's pool. pad: the token the right padding holds (any embeddable id: it is hidden)."""
        p = ids.shape[1]
        self.ids[:, :p].copy_(ids)
        self.pos[:, :p].copy_(pos)
        if p < self.length:  # right padding: its k/v go to slots the causal bound hides until decode writes them
            self.ids[:, p:].fill_(pad)
            self.pos[:, p:].fill_(-1)
        self.last.fill_(p - 1)
        self.graph.replay()
        return self.logits
