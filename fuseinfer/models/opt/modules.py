"""Patch rules for Hugging Face OPT (facebook/opt-125m ... opt-66b, pre-LN and the post-LN opt-350m).

Swaps, by changing the class of the existing modules to subclasses (so ``isinstance``-based output capture,
the swapped modules' own hooks and parameters stay as they are):

* ``OPTDecoderLayer`` -> :class:`FusedOPTDecoderLayer`: residual add fused into the LayerNorm (post-LN) or into
  the out_proj/fc2 GEMM epilogue (pre-LN, which then normalises the stream with the fused LN kernel);
  fc1 + bias + ReLU as one GEMM;
* SmoothQuant W8A8 (pre-LN, ``layer_norm`` and ``linear`` patched): each LayerNorm whose output only feeds W8A8
  linears (q/k/v fused; fc1) runs as ``add_layer_norm_quant``, which emits the int8 activations and per-token
  scales those GEMMs read (the smoothing factors are already folded into the LayerNorm's weight and bias); the
  fp16 LayerNorm output is never formed. fc2's input (fc1's ReLU output) and out_proj's (attention's) are
  quantized per token by ``quantize_int8`` (a per-token scale needs the whole row, spread over several CTAs, so no
  epilogue can write it), or, with a calibrated static scale at prefill, written in int8 by the attention kernel
  (``out_proj_input="static"``) and by fc1's GEMM (``fc2_input="static"``);
* FP8 W8A8 (``Float8``) likewise, in e4m3: those LayerNorms run as ``add_layer_norm_quant_fp8``; out_proj's and
  fc2's inputs are quantized by the linears themselves, or written in e4m3 as above with static scales;
* with :data:`FOLD_NORMS` (pre-LN), each LayerNorm runs in the prologue of the GEMV after it at decode rows
  (self_attn_layer_norm in the q/k/v GEMV that writes the cache, final_layer_norm in fc1's:
  ``layer_norm_linear_append`` / ``layer_norm_linear``), for fp16 / bf16 and int8 weight-only weights;
* ``OPTAttention`` -> :class:`FusedOPTAttention`: q/k/v as one GEMM (q/k/v weights become views of one
  (3E, E) tensor, so no memory is added), unscaled q with the scale applied inside the attention kernel,
  out_proj + bias (+ residual) fused. The (3E, E) tensor and its (3E,) bias are plain attributes
  (``qkv_weight`` / ``qkv_bias`` in the module's ``__dict__``), outside the buffer registry, so ``named_buffers``
  and ``state_dict`` list what the unpatched model lists; ``state_dict()`` hands out the q/k/v weights as copies
  of their own (transformers reads tensors sharing storage as tied weights); ``model.to`` and friends convert the
  tensor (``FusedOPTAttention._apply``);
* the decoder's final ``LayerNorm`` -> :class:`FusedLayerNorm`;
* ``OPTDecoder`` -> :class:`LockedOPTDecoder`: the same forward, holding the model's lock (``state.model_lock``), so
  that ``patch`` / ``unpatch`` in another thread wait for a running forward and a forward waits for them;
* ``config._attn_implementation`` -> ``"fuseinfer"``, on a copy of the config that the model and its modules
  hold while patched (so another model built on the same config object keeps its attention); ``unpatch`` puts
  the original object back, with any other change made to the copy meanwhile.

In training mode, and under autocast to another dtype than the model's, the fused modules call the original
forward (dropout is not fused; autocast picks each op's dtype). In eval mode with gradients on, the fused ops
backpropagate with their references' gradients (``ops/``) and q/k/v run as three GEMMs, so every parameter gets
its gradient; under torch.func transforms and forward-mode AD the ops run their references. A module whose fused
forward would bypass a submodule (a projection, fc1 / fc2, a LayerNorm) is left as it is when that submodule has
hooks or is not a plain ``nn.Linear`` / ``nn.LayerNorm`` (an adapter such as LoRA), and so is an attention module
with hooks of its own (its fused output would include the residual); the report lists them under "skipped".
Hooks added after ``patch`` are not seen by the fused forwards.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from transformers.models.opt.modeling_opt import (
    OPTAttention,
    OPTDecoder,
    OPTDecoderLayer,
)

from fuseinfer.core.errors import FuseInferError
from fuseinfer.core.config import PatchConfig, PatchReport, Swap
from fuseinfer.ops import add_layer_norm, linear_rope_append
from fuseinfer.ops.layer_norm_linear import layer_norm_linear, layer_norm_linear_append
from fuseinfer.ops.layer_norm_quant import add_layer_norm_quant, add_layer_norm_quant_fp8
from fuseinfer.layers.linear import (DECODE_ROWS, Int8WeightOnlyLinear, decode_rows, fused_linear, quantized_input,
                                     writes_static_input)
from fuseinfer.core import placement
from fuseinfer.core.state import LOCK_ATTR, lock_holder
from fuseinfer.layers import hf_attention
from fuseinfer.models.common import (
    cache_slots,
    fold_rows,
    install_attention,
    lock_models,
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
from fuseinfer.models.opt.layer import decoder_layer

# Whether a pre-LN decoder layer folds its LayerNorms into the GEMV after each (self_attn_layer_norm into the q/k/v
# projection + cache write, final_layer_norm into fc1 + ReLU; ``ops/layer_norm_linear.py``): at decode one kernel fewer
# per norm, the GEMV normalising the rows in its prologue, for fp16 / bf16 and int8 weight-only (W8A16) weights. Read
# at each layer call (a benchmark flips it to time both in one process); where the fused op does not apply (prefill,
# post-LN, W8A8 / FP8 linears, an FP8 cache, an unpatched or hooked attention) the norm runs first as before, so the
# values are the same either way. Off: OPT-1.3b per-op decode, ms/token folded / not (H200, one process): 1 row
# 1.100 / 1.131, 2 rows 1.163 / 1.172, 4 rows 1.283 / 1.202, 8 rows 1.527 / 1.342 (every block stages and normalises
# all the rows, a cost that grows with them); at 1 and 2 rows, where it gains, the one-kernel step runs by default.
FOLD_NORMS = False
# ... at up to this many rows (tokens) a call (where it gained, above)
FOLD_MAX_ROWS = 2


class FusedLayerNorm(nn.LayerNorm):
    """nn.LayerNorm running the fused LayerNorm kernel."""

    def forward(self, x):
        if _original_forward(self, x):
            return super().forward(x)
        return add_layer_norm(x, None, self.weight, self.bias, self.eps)[0]


def _norm(ln: nn.LayerNorm, x, residual, fused: bool):
    """LayerNorm(x + residual) with ``ln``'s parameters; one kernel when ``fused``."""
    if fused:
        return add_layer_norm(x, residual, ln.weight, ln.bias, ln.eps)[0]
    return ln(x if residual is None else residual + x)


def _norm_quant(ln: nn.LayerNorm, x, fmt: str):
    """LayerNorm(x) with ``ln``'s parameters, quantized per token in the same kernel to ``fmt`` ("int8" or "e4m3"):
    (x_q (..., E), x_scale fp32 (..., 1)), what ``quantize_per_token`` (``quantize_fp8_per_token``) of ``_norm``'s
    output gives (the same rounding to x's dtype first)."""
    op = add_layer_norm_quant if fmt == "int8" else add_layer_norm_quant_fp8
    return op(x, None, ln.weight, ln.bias, ln.eps)[:2]


class FusedOPTAttention(OPTAttention):
    """OPTAttention with a fused q/k/v GEMM, the scale folded into attention and a fused out_proj epilogue."""

    _fuseinfer_ops: frozenset = frozenset()

    def _apply(self, fn, recurse=True):
        """``model.to`` / ``.half()`` / ``.cuda()`` convert the projections' weights (nn.Module's registries) and the
        (3E, E) q/k/v tensor (a plain attribute); the weights then become views of the converted tensor again (one
        copy, updated together)."""
        super()._apply(fn, recurse)
        if self.__dict__.get("qkv_weight") is not None:
            with torch.no_grad():  # (as nn.Module converts its tensors)
                for name in ("qkv_weight", "qkv_bias"):
                    if self.__dict__.get(name) is not None:
                        self.__dict__[name] = fn(self.__dict__[name])
            _link_qkv(self)
        return self

    def __setstate__(self, state):
        """A deep copy or an unpickled copy gets its q/k/v weights as views of its own (3E, E) buffer again
        (copying a Parameter clones it, which would leave the fused GEMM reading a buffer that nothing updates)."""
        super().__setstate__(state)
        if getattr(self, "qkv_weight", None) is not None:
            _link_qkv(self)

    def forward(self, hidden_states, past_key_values=None, attention_mask=None, output_attentions=False,
                residual=None, quantized=None, prenorm=None, **kwargs):
        """quantized: (x_q (B, S, E) int8 / e4m3, x_scale (B, S, 1) fp32), the LayerNorm output already quantized per
        token for the W8A8 / FP8 q/k/v (``FusedOPTDecoderLayer._int8_qkv`` checked that this forward is fused and
        takes it); hidden_states then gives only the shape and dtype. prenorm: the LayerNorm module whose output the
        projections take (hidden_states un-normalised; :data:`FOLD_NORMS`), folded into the q/k/v GEMV where that
        runs the cache-writing ``linear_rope_append`` form, else applied first."""
        if _original_forward(self, hidden_states):
            if prenorm is not None:
                hidden_states = _norm(prenorm, hidden_states, None, True)
            out, weights = super().forward(hidden_states, past_key_values, attention_mask, output_attentions,
                                           **kwargs)
            return (out if residual is None else residual + out), weights
        ops = self._fuseinfer_ops
        bsz, tgt_len, _ = hidden_states.shape
        appended = False  # (k and v already in the cache)
        fused_qkv = quantized is None and "qkv" in ops and _qkv_fused(self)
        operands = _append_operands(self, hidden_states, past_key_values) if fused_qkv else None
        if prenorm is not None and operands is None:  # (no GEMV to fold the norm into)
            hidden_states, prenorm = _norm(prenorm, hidden_states, None, True), None
        if quantized is not None:  # W8A8 / FP8 q/k/v on add_layer_norm_quant(_fp8)'s output: (B, S, 3E)
            qkv = self._modules["qkv_proj"].forward_quantized(*quantized, None, "none", hidden_states.dtype)
            q, k, v = qkv.view(bsz, tgt_len, 3, self.num_heads, self.head_dim).unbind(2)  # 3 x (B, S, H, D)
        elif operands is not None:
            # decode rows over fuseinfer's static cache: projection, split and cache write in one GEMV (its
            # epilogue stores k and v into the cache), with prenorm in its prologue
            i = self.layer_idx
            keys, values = past_key_values.keys[i], past_key_values.values[i]
            slots = cache_slots(past_key_values, hidden_states.device)
            if prenorm is not None:
                q = layer_norm_linear_append(hidden_states, prenorm.weight, prenorm.bias, prenorm.eps, *operands,
                                             self.num_heads, self.num_heads, keys, values, slots)  # (B, H, S, D)
            else:
                q = linear_rope_append(hidden_states, *operands, None, None, self.num_heads, self.num_heads, keys,
                                       values, slots)  # (B, H, S, D)
            k, v, appended = keys, values, True  # (B, H, T, D)
        elif fused_qkv:
            qkv = fused_linear(self, hidden_states)  # (B, S, 3E); int8 weights when quantized
            q, k, v = qkv.view(bsz, tgt_len, 3, self.num_heads, self.head_dim).unbind(2)  # 3 x (B, S, H, D)
        else:
            q, k, v = (proj(hidden_states).view(bsz, tgt_len, self.num_heads, self.head_dim)
                       for proj in (self.q_proj, self.k_proj, self.v_proj))
        if not appended:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, S, D)
            if past_key_values is not None:
                k, v = past_key_values.update(k, v, self.layer_idx)  # (B, H, Skv, D)
        impl = self.config._attn_implementation
        if impl == hf_attention.NAME and (output_attentions or hf_attention.weights_requested(self)):
            # the attention weights were asked for, which the kernel does not form: eager, with OPT's scaled q
            attn_fn, scaling, q = hf_attention.eager_attention_with_weights, 1.0, q * self.scaling
        elif impl == hf_attention.NAME:
            attn_fn, scaling = hf_attention.fuseinfer_attention_forward, self.scaling
        else:  # keep OPT's order of operations: scale q first, attention with scaling=1
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
            from transformers.models.opt.modeling_opt import eager_attention_forward

            attn_fn, scaling, q = ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_attention_forward), 1.0, \
                q * self.scaling
        if impl == hf_attention.NAME and "linear" in ops and not output_attentions:
            out = self._static_out_proj(hidden_states, q, k, v, attention_mask, residual)
            if out is not None:
                return out, None
        attn, weights = attn_fn(self, q, k, v, attention_mask, dropout=0.0, scaling=scaling, **kwargs)
        attn = attn.reshape(bsz, tgt_len, -1)  # (B, S, E)
        if "linear" in ops:
            return fused_linear(self.out_proj, attn, residual), weights
        out = self.out_proj(attn)
        return (out if residual is None else residual + out), weights

    def _static_out_proj(self, hidden_states, q, k, v, attention_mask, residual):
        """out_proj(attention) + residual with out_proj's 8-bit input written by the attention kernel (W8A8 / FP8
        with ``out_proj_input="static"``: out_proj holds a calibrated ``input_scale``) at prefill; None where that
        does not apply (decode-sized rows run the 8-bit weight GEMV on fp16 activations) or the call would not run
        fuseinfer's attention op."""
        out_proj = self._modules["out_proj"]
        scale = getattr(out_proj, "input_scale", None)
        if scale is None or not hasattr(out_proj, "forward_quantized") or decode_rows(hidden_states):
            return None
        y = hf_attention.fuseinfer_attention_8bit(self, q, k, v, attention_mask, self.scaling, scale,
                                                  out_proj.quantized_input)
        if y is None:
            return None
        y = y.reshape(*hidden_states.shape[:-1], -1)  # (B, S, E) int8 / e4m3
        return out_proj.forward_quantized(y, out_proj.static_scales(y), residual, "none", hidden_states.dtype)


class _Quantized:
    """A LayerNorm output quantized per token for the W8A8 / FP8 GEMM that reads it: ``q`` = (x_q int8 / e4m3
    (B, S, E), x_scale fp32 (B, S, 1)); ``x``, the LayerNorm's input, gives the shape and dtype. Also fc1's 8-bit
    output for an fc2 with a static input scale (``x``: fc1's input, for the dtype; x_scale that one scale)."""

    __slots__ = ("x", "q")

    def __init__(self, x, q):
        self.x, self.q = x, q


class ModuleOps:
    """The patched modules' strategy for :func:`~fuseinfer.models.opt.layer.decoder_layer`, over (B, S, E) with
    transformers' cache and mask (``ctx``: the attention module's keyword arguments). The attention runs as a call of
    the attention module (patched or not); the LayerNorms and fc1 / fc2 run fused as far as the layer's ops say
    (``_fuseinfer_ops``; none: the submodules are called). One per layer call: ``h``, the layer's input, decides
    whether W8A8 LayerNorms quantize (not at decode-sized inputs on CUDA, where the W8A8 linears run the GEMV)."""

    __slots__ = ("layer", "fused_ln", "fused_linear", "int8", "fold", "prefill")

    def __init__(self, layer: nn.Module, h: torch.Tensor):
        ops = layer._fuseinfer_ops
        self.layer = layer
        self.fused_ln = "layer_norm" in ops
        self.fused_linear = "linear" in ops
        # W8A8 / FP8 at prefill: LayerNorm + per-token quantize in one pass feeds the 8-bit GEMMs; at decode on CUDA
        # those linears run the 8-bit weight GEMV on fp16 activations (layers/linear.py decode_rows), so the LayerNorm
        # is fp16
        self.prefill = not decode_rows(h)
        self.int8 = self.fused_ln and self.prefill
        # pre-LN with the LayerNorms fused: each LayerNorm goes, unapplied (PendingNorm), to the q/k/v or fc1 step
        self.fold = FOLD_NORMS and fold_rows(h, FOLD_MAX_ROWS) and self.fused_ln and \
            layer.do_layer_norm_before and _folds_norms(layer)

    def norm(self, x, ln, residual=None):
        if residual is not None:
            return _norm(ln, x, residual, self.fused_ln), None
        if self.int8:  # (pre-LN: the LayerNorm output feeds q/k/v or fc1 only)
            layer = self.layer
            lin = layer._int8_qkv(x) if ln is layer._modules["self_attn_layer_norm"] else layer._int8_fc1()
            if lin is not None:
                return _Quantized(x, _norm_quant(ln, x, lin.quantized_input)), x
        if self.fold:  # (the attention module or the fc1 step normalises)
            return PendingNorm(x, ln), x
        return _norm(ln, x, None, self.fused_ln), x

    def attention(self, i, attn, x, ctx):
        if type(x) is PendingNorm:  # (fold: a fused attention, plainly called)
            return _PendingAttention(attn, x.x, {**ctx, "prenorm": x.norm})
        return _PendingAttention(attn, x, ctx)

    def linear(self, x, lin, residual=None, activation=None):
        if type(x) is PendingNorm:  # fc1 after final_layer_norm (fold): one GEMV at decode rows, else the norm first
            y = self._norm_linear(x, lin, residual, activation)
            if y is not None:
                return y
            x = _norm(x.norm, x.x, None, self.fused_ln)
        if type(x) is _PendingAttention:  # out_proj: the attention module's call
            attn = x.attn
            if isinstance(attn, FusedOPTAttention):  # (out_proj + bias + residual fused)
                if type(x.x) is _Quantized:
                    return attn(x.x.x, residual=residual, quantized=x.x.q, **x.kwargs)[0]
                return attn(x.x, residual=residual, **x.kwargs)[0]
            out = attn(x.x, **x.kwargs)[0]  # attention left unpatched by the config's filter_fn
            return out if residual is None else residual + out
        if not self.fused_linear:
            y = lin(x)
            y = y if activation is None else activation(y)
            return y if residual is None else residual + y
        if activation is not None and activation.__class__.__name__ != "ReLU":
            y = activation(self._gemm(x, lin, None, "none"))
            return y if residual is None else residual + y
        act = "none" if activation is None else "relu"  # (ReLU in the GEMM's epilogue)
        nxt = self._static_next(lin)
        if nxt is not None:  # fc1 writing fc2's 8-bit input with fc2's static scale (ReLU before the quantization)
            like = x.x if type(x) is _Quantized else x
            xq, xs = x.q if type(x) is _Quantized else lin.quantize_input(x)
            y = lin.forward_8bit_out(xq, xs, nxt.input_scale, act, like.dtype)  # (..., F) int8 / e4m3
            return _Quantized(like, (y, nxt.static_scales(y)))
        return self._gemm(x, lin, residual, act)

    @staticmethod
    def _gemm(x, lin, residual, act: str):
        """act(x @ W.T + bias + residual) for ``lin``; x a tensor, or 8-bit activations (``_Quantized``: fc1 on
        add_layer_norm_quant(_fp8)'s output, fc2 on fc1's 8-bit output) -> (..., N) in the model's dtype."""
        if type(x) is _Quantized:
            return lin.forward_quantized(*x.q, residual, act, x.x.dtype)
        return fused_linear(lin, x, residual, act)

    def _static_next(self, lin):
        """fc2, when ``lin`` is this layer's fc1 and fc1's epilogue writes fc2's 8-bit input at prefill
        (``fc2_input="static"``: fc2 holds a calibrated ``input_scale``); else None."""
        mods = self.layer._modules
        fc2 = mods.get("fc2")
        return fc2 if self.prefill and lin is mods.get("fc1") and writes_static_input(lin, fc2) else None

    def _norm_linear(self, x: PendingNorm, lin, residual, activation):
        """``layer_norm_linear`` of the pending norm's rows for ``lin`` (a plain nn.Linear or an int8 weight-only
        linear, ReLU or no activation), else None. (A pending norm has at most FOLD_MAX_ROWS rows; the op itself
        runs the norm and the linear apart where its GEMV prologue does not serve.)"""
        h, ln = x.x, x.norm
        if not self.fused_linear or not (activation is None or activation.__class__.__name__ == "ReLU"):
            return None
        if type(lin) is nn.Linear:
            weight, scale, bias = lin.weight, None, lin.bias
        elif type(lin) is Int8WeightOnlyLinear:
            weight, scale, bias = lin.qweight, lin.scale, lin.bias
        else:
            return None
        return layer_norm_linear(h, ln.weight, ln.bias, ln.eps, weight, scale, bias, residual,
                                 "none" if activation is None else "relu")


def _folds_norms(layer: nn.Module) -> bool:
    """Whether ``layer`` may hand its LayerNorms to its attention and fc1 steps (:data:`FOLD_NORMS`): the attention
    fused and plainly called (it takes the un-normalised rows and the norm)."""
    attn = layer._modules["self_attn"]
    return isinstance(attn, FusedOPTAttention) and plain_call(attn)


class FusedOPTDecoderLayer(OPTDecoderLayer):
    """OPTDecoderLayer whose residual adds, LayerNorms and MLP run as fused ops: ``decoder_layer`` over
    :class:`ModuleOps`."""

    _fuseinfer_ops: frozenset = frozenset()

    def _int8_qkv(self, h):
        """The W8A8 / FP8 q/k/v reading self_attn_layer_norm's output when this forward can hand it 8-bit
        activations (the attention's fused forward runs, q/k/v fused and quantized), else None. h: the layer's
        input."""
        attn = self.self_attn
        if not (isinstance(attn, FusedOPTAttention) and "qkv" in attn._fuseinfer_ops) or _original_forward(attn, h):
            return None
        return quantized_input(attn)

    def _int8_fc1(self):
        """fc1 when it is a W8A8 / FP8 linear the fused MLP calls (it then takes final_layer_norm's output in int8 /
        e4m3)."""
        return quantized_input(self.fc1) if "linear" in self._fuseinfer_ops else None

    def _strategy(self, h: torch.Tensor):
        """The ops strategy of this call (tensor parallel wraps it: models/opt/tp.py)."""
        return ModuleOps(self, h)

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False,
                position_ids=None, **kwargs):
        if _original_forward(self, hidden_states):
            return super().forward(hidden_states, attention_mask, past_key_values, use_cache, position_ids,
                                   **kwargs)
        ctx = dict(past_key_values=past_key_values, position_ids=position_ids, attention_mask=attention_mask,
                   **kwargs)
        attn = self._modules["self_attn"]
        return decoder_layer(self._strategy(hidden_states), attn.layer_idx, self, hidden_states, ctx,
                             self.do_layer_norm_before)


class LockedOPTDecoder(OPTDecoder):
    """OPTDecoder whose forward holds the patched model's lock (``ModelLock`` in ``__dict__[LOCK_ATTR]``): the forward
    runs over a model that is wholly patched or wholly unpatched, never one that another thread is changing."""

    @functools.wraps(OPTDecoder.forward)
    def forward(self, *args, **kwargs):
        holder = self.__dict__.get(LOCK_ATTR)
        if holder is None or torch.compiler.is_compiling():  # (dynamo does not trace a lock; a compiled forward
            return OPTDecoder.forward(self, *args, **kwargs)  # runs under the caller's: generate, or none)
        with holder.lock:  # (``OPTDecoder.forward``, not super(): unpatch may have restored the class meanwhile)
            return OPTDecoder.forward(self, *args, **kwargs)


def check_decoder_inputs(decoder, args, kwargs):
    """Forward pre-hook that ``patch`` puts on the decoder: the inputs the fused modules cannot take become one clear
    error each (an empty batch or sequence, more positions than the model has) instead of a reshape error and an
    IndexError. Shapes only: no device sync, so it stays capturable."""
    x = kwargs.get("input_ids", args[0] if args else None)
    name = "input_ids"
    if x is None:
        x, name = kwargs.get("inputs_embeds"), "inputs_embeds"
    if x is None or x.dim() < 2:
        return None
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise FuseInferError(f"empty input: {name} has shape {tuple(x.shape)}; pass at least one row of at least one "
                             "token")
    cache = kwargs.get("past_key_values")
    past = cache.get_seq_length() if cache is not None and not torch.compiler.is_compiling() else 0
    limit = decoder.config.max_position_embeddings
    if isinstance(past, int) and past + x.shape[1] > limit:
        raise FuseInferError(f"{past + x.shape[1]} positions ({past} cached + {x.shape[1]} new) exceed the model's "
                             f"max_position_embeddings ({limit}): shorten the input (e.g. tokenizer(..., "
                             "truncation=True, max_length=...))")
    return None


class OPTPatchRules:
    """Patch and unpatch rules for OPT models (the module swaps; ``decode.py`` has the fast-decode parts)."""

    def patch(self, model: nn.Module, config: PatchConfig, report: PatchReport) -> dict:
        ops = frozenset(config.ops)
        state = {"classes": [], "qkv": [], "config": None, "attn_backends": []}
        like = next(model.parameters())  # what a parameter-free module's ops run on
        layer_ops = ops & {"layer_norm", "linear"}
        attn_ops = ops & {"qkv", "linear", "attention"} - ({"attention"} if model.training else set())
        plan = []  # (module, name, class, ops): every filter_fn call and check comes before the first swap
        for name, module in model.named_modules():
            ln_name = f"{name}.final_layer_norm".lstrip(".")  # (name is "" when the decoder itself is patched)
            if type(module) is OPTDecoderLayer and layer_ops and config.selects(module, name):
                plan.append((module, name, FusedOPTDecoderLayer, layer_ops))
            elif type(module) is OPTAttention and attn_ops and config.selects(module, name):
                plan.append((module, name, FusedOPTAttention, attn_ops))
            elif isinstance(module, OPTDecoder) and type(module.final_layer_norm) is nn.LayerNorm \
                    and "layer_norm" in ops and config.selects(module.final_layer_norm, ln_name):
                plan.append((module.final_layer_norm, ln_name, FusedLayerNorm, {"layer_norm"}))
        for module, name, cls, module_ops in plan:
            why = _bypass_reason(module, module_ops, like)
            if why is not None:
                report.skipped.append((name, why))
                continue
            if cls is FusedOPTAttention and "qkv" in ops:
                self._fuse_qkv(module, state)
            self._swap(module, name, cls, module_ops, state, report, like)
        decoders = [module for module in model.modules() if isinstance(module, OPTDecoder)] if report.swaps else []
        state["input_checks"] = [module.register_forward_pre_hook(check_decoder_inputs, with_kwargs=True)
                                 for module in decoders]
        lock_models([module for module in decoders if type(module) is OPTDecoder], lambda m: LockedOPTDecoder,
                    lock_holder(model), state)
        if "attention" in ops:
            install_attention(model, config, report, like, model.config.hidden_size // model.config.num_attention_heads,
                              (OPTAttention,), state)
        if not report.swaps:
            report.skipped.append(("all modules", "no OPT module matched the config's ops and filter_fn"))
        return state

    @staticmethod
    def _swap(module, name, cls, ops, state, report, like):
        state["classes"].append((module, type(module)))
        report.swaps.append(Swap(name, type(module).__name__, cls.__name__, _backends(module, ops, like)))
        module.__class__ = cls
        module._fuseinfer_ops = frozenset(ops)
        placement.swap_forward(module, cls, state)  # under an accelerate hook: the hook calls cls.forward

    @staticmethod
    def _fuse_qkv(attn: OPTAttention, state):
        """Concatenate q/k/v weights into one (3E, E) tensor and make the projections' weights views of it."""
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        attn.__dict__["qkv_weight"] = torch.cat([p.weight.detach() for p in projs])  # (3E, E)
        attn.__dict__["qkv_bias"] = torch.cat([p.bias.detach() for p in projs]) if attn.enable_bias else None
        _link_qkv(attn)
        state["qkv"].append(attn)
        state.setdefault("qkv_hooks", []).append(attn._register_state_dict_hook(_own_qkv_storage))

    def unpatch(self, model: nn.Module, state: dict) -> None:
        for attn in state["qkv"]:
            for p in (attn.q_proj, attn.k_proj, attn.v_proj):
                p.weight.data = p.weight.detach().clone()
                if p.bias is not None:
                    p.bias.data = p.bias.detach().clone()
            del attn.qkv_weight, attn.qkv_bias, attn._fuseinfer_qkv_params
        for handle in state.get("qkv_hooks", ()):
            handle.remove()
        for handle in state.get("input_checks", ()):
            handle.remove()
        placement.restore_forwards(state)
        for module, cls in state["classes"]:
            module.__class__ = cls
            del module._fuseinfer_ops
        unlock_models(state, lambda m: OPTDecoder)
        restore_attention(model, state)


def _bypass_reason(module: nn.Module, ops, like: torch.Tensor) -> str | None:
    """Why ``module`` must stay unswapped, or None: its fused forward reads the parameters of the submodules
    listed here instead of calling them, so each must be a plain, hook-free nn.Linear / nn.LayerNorm; and the
    fused ops take their weights in the activations' dtype (``like``'s, the model's first parameter)."""
    why = placement.bypass_reason(module)  # accelerate: offloaded modules stay, hooked ones run fused
    if why is not None:
        return why
    dtypes = {p.dtype for p in module.parameters()} - {like.dtype}
    if dtypes:
        return (f"it has {'/'.join(sorted(str(d) for d in dtypes))} parameters in a {like.dtype} model: the fused ops "
                f"take one dtype (e.g. model.to({like.dtype}))")
    if isinstance(module, OPTAttention):
        if _has_hooks(module):  # (the decoder layer would hand it the residual to fuse into out_proj)
            return "the attention module has hooks (the fused one returns its output plus the residual)"
        names = (("q_proj", "k_proj", "v_proj") if "qkv" in ops else ()) + (("out_proj",) if "linear" in ops else ())
        kinds = {n: nn.Linear for n in names}
    elif isinstance(module, OPTDecoderLayer):
        kinds = {n: nn.LayerNorm for n in ("self_attn_layer_norm", "final_layer_norm") if "layer_norm" in ops}
        kinds.update({n: nn.Linear for n in ("fc1", "fc2") if "linear" in ops})
        if "linear" in ops:  # a ReLU runs in fc1's epilogue instead of activation_fn
            kinds["activation_fn"] = nn.Module
    else:
        kinds = {}
    for n, kind in kinds.items():
        sub = getattr(module, n)
        if kind is not nn.Module and type(sub) is not kind:
            return f"{n} is a {type(sub).__name__}, not a plain {kind.__name__} (the fused forward would bypass it)"
        if _has_hooks(sub):
            return f"{n} has hooks (the fused forward does not call it)"
    return None


def _qkv_params(attn: OPTAttention) -> tuple:
    """The q/k/v projections' weights and biases, as stored (``_parameters``, where functional_call swaps tensors
    in; read without nn.Module's attribute lookup, which cost most of the check below on every forward)."""
    mods = attn._modules
    return tuple(mods[name]._parameters[p] for name in ("q_proj", "k_proj", "v_proj") for p in ("weight", "bias"))


def _append_operands(attn: OPTAttention, x: torch.Tensor, cache):
    """(weight, scale, bias) of the fused q/k/v projection for ``linear_rope_append`` without rotation, when the
    forward's decode-sized x (B, S, E) (at most DECODE_ROWS rows: the GEMV's) writes into fuseinfer's static cache in
    the model's dtype (an FP8 cache takes its own append) under fuseinfer's attention: the fp16/bf16/fp32 fused weight
    (scale None) or the int8 weight-only one; else None (W8A8 and FP8 linears run their own GEMM; prefill-sized
    inputs keep the GEMM and q as a view; transformers' caches take ``update``)."""
    if x.numel() > DECODE_ROWS * x.shape[-1] or not static_cache(cache) \
            or getattr(cache, "kv_scales", None) is not None or attn.config._attn_implementation != hf_attention.NAME:
        return None
    keys = cache.keys[attn.layer_idx]
    if keys.dim() != 4 or keys.shape[1] != attn.num_heads or keys.shape[3] != attn.head_dim:
        return None
    quant = attn._modules.get("qkv_proj")
    if quant is None:
        return attn.__dict__["qkv_weight"], None, attn.__dict__["qkv_bias"]
    if type(quant) is Int8WeightOnlyLinear:
        return quant.qweight, quant.scale, quant.bias
    return None


def _qkv_fused(attn: OPTAttention) -> bool:
    """Whether the fused q/k/v GEMM, which reads the (3E, E) buffer, serves this forward: the projections hold the
    Parameters linked to it (``torch.func.functional_call`` or ``load_state_dict(..., assign=True)`` put other
    tensors there), and none of them needs a gradient (autograd does not connect the buffer to them). Otherwise
    the three projections run."""
    params = _qkv_params(attn)
    return _qkv_linked(attn, params) and \
        (not torch.is_grad_enabled() or not any(p is not None and p.requires_grad for p in params))


def _qkv_linked(attn: OPTAttention, params: tuple) -> bool:
    """Whether the projections hold the Parameters linked to the (3E, E) buffer, and those still are their rows of
    ``qkv_weight`` / ``qkv_bias``: ``param.data = t`` (as ``torch.nn.utils.vector_to_parameters`` does) keeps the
    Parameter but not the view. (The views are checked in eager mode only: dynamo does not trace data pointers.)"""
    if any(a is not b for a, b in zip(params, attn._fuseinfer_qkv_params)):
        return False
    if torch.compiler.is_compiling():
        return True
    for buf, ps in ((attn.qkv_weight, params[0::2]), (attn.qkv_bias, params[1::2])):
        if buf is None:
            continue
        step = buf.numel() // 3 * buf.element_size()
        if any(p.data_ptr() != buf.data_ptr() + i * step for i, p in enumerate(ps)):
            return False
    return True


def _link_qkv(attn: OPTAttention) -> None:
    """Point the q/k/v projections' parameters (the same Parameter objects, so optimizers and hooks keep them) at
    their rows of ``qkv_weight`` / ``qkv_bias``, and remember those objects (see _qkv_fused)."""
    e = attn.embed_dim
    for i, proj in enumerate((attn.q_proj, attn.k_proj, attn.v_proj)):
        proj.weight.data = attn.qkv_weight[i * e:(i + 1) * e]
        if attn.qkv_bias is not None:
            proj.bias.data = attn.qkv_bias[i * e:(i + 1) * e]
    attn._fuseinfer_qkv_params = _qkv_params(attn)
