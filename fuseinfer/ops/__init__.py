"""Fused ops: each module holds a pure-PyTorch reference and a ``fuseinfer::<name>`` torch.library custom op
that runs the CUDA kernel when the extension is built and the tensors are on CUDA, the reference otherwise.
``quant`` (int8 quantize / dequantize), ``w8a16_linear`` (W8A16 GEMM), ``w8a8_linear``, ``fp8_linear`` (FP8
e4m3 W8A8), ``fp8_linear_fp8out`` / ``w8a8_linear_int8out`` (their 8-bit-output variants) and
``fp8_weight_linear`` (the FP8 decode GEMV) serve
``fuseinfer.quant``, as ``attention_fp8out`` / ``attention_int8out`` (attention writing the output projection's
8-bit input) do;
``sample_tokens`` is sampling's
token choice in one pass.
"""
from fuseinfer.ops.attention import attention, attention_fp8_ref, attention_ref
from fuseinfer.ops.attention_8bit_out import (attention_fp8out, attention_fp8out_ref, attention_int8out,
                                             attention_int8out_ref)
from fuseinfer.ops.decode_step import decode_step_workspace, opt_decode_step, opt_decode_step_ref
from fuseinfer.ops.emit_tokens import emit_tokens, emit_tokens_ref, emit_tokens_scratch
from fuseinfer.ops.fp8_gemv import fp8_weight_linear, fp8_weight_linear_ref
from fuseinfer.ops.fp8_linear import fp8_linear, fp8_linear_ref, quantize_fp8_per_token, quantize_fp8_ref
from fuseinfer.ops.linear_8bit_out import (fp8_linear_fp8out, fp8_linear_fp8out_ref, quantize_fp8_static,
                                           w8a8_linear_int8out, w8a8_linear_int8out_ref)
from fuseinfer.ops.w8a16_linear import dequantize_weight, w8a16_linear, w8a16_linear_ref
from fuseinfer.ops.kv_cache import kv_cache_append, kv_cache_append_ref
from fuseinfer.ops.kv_reorder import kv_reorder, kv_reorder_ref
from fuseinfer.ops.w8a8_linear import w8a8_linear, w8a8_linear_ref
from fuseinfer.ops.layer_norm import add_layer_norm, add_layer_norm_ref
from fuseinfer.ops.layer_norm_quant import (add_layer_norm_quant, add_layer_norm_quant_fp8,
                                            add_layer_norm_quant_fp8_ref, add_layer_norm_quant_ref)
from fuseinfer.ops.layer_norm_linear import (layer_norm_linear, layer_norm_linear_append,
                                             layer_norm_linear_append_ref, layer_norm_linear_ref)
from fuseinfer.ops.linear import linear_epilogue, linear_epilogue_ref
from fuseinfer.ops.linear_rope import linear_rope_append, linear_rope_append_ref
from fuseinfer.ops.norm_linear import (rms_norm_linear, rms_norm_linear_ref, rms_norm_linear_rope_append,
                                      rms_norm_linear_rope_append_ref)
from fuseinfer.ops.llama_step import llama_decode_step, llama_decode_step_ref
from fuseinfer.ops.rms_norm import add_rms_norm, add_rms_norm_ref
from fuseinfer.ops.sample_tokens import sample_tokens, sample_tokens_ref, warp_ref
from fuseinfer.ops.rope import qkv_rope, qkv_rope_append, qkv_rope_append_ref, qkv_rope_ref
from fuseinfer.ops.silu_mul import silu_mul, silu_mul_ref
from fuseinfer.ops.quant import (
    dequantize,
    dequantize_int8_ref,
    quantize_int8_ref,
    quantize_per_channel,
    quantize_per_token,
)

__all__ = [
    "add_layer_norm", "add_layer_norm_ref", "attention", "attention_ref", "attention_fp8_ref", "attention_fp8out",
    "attention_fp8out_ref", "attention_int8out", "attention_int8out_ref", "decode_step_workspace", "dequantize",
    "dequantize_int8_ref", "dequantize_weight", "emit_tokens", "emit_tokens_ref", "emit_tokens_scratch",
    "fp8_linear", "fp8_linear_ref", "fp8_linear_fp8out", "fp8_linear_fp8out_ref", "fp8_weight_linear",
    "fp8_weight_linear_ref", "quantize_fp8_per_token", "quantize_fp8_ref", "quantize_fp8_static",
    "w8a16_linear", "w8a16_linear_ref", "kv_cache_append", "kv_cache_append_ref", "kv_reorder", "kv_reorder_ref",
    "linear_epilogue", "linear_epilogue_ref", "linear_rope_append", "linear_rope_append_ref", "llama_decode_step",
    "llama_decode_step_ref",
    "opt_decode_step", "opt_decode_step_ref", "quantize_int8_ref", "quantize_per_channel", "quantize_per_token",
    "add_layer_norm_quant", "add_layer_norm_quant_ref", "add_layer_norm_quant_fp8", "add_layer_norm_quant_fp8_ref",
    "w8a8_linear", "w8a8_linear_ref", "w8a8_linear_int8out", "w8a8_linear_int8out_ref",
    "add_rms_norm", "add_rms_norm_ref", "qkv_rope", "qkv_rope_append", "qkv_rope_append_ref", "qkv_rope_ref",
    "sample_tokens", "sample_tokens_ref", "silu_mul", "silu_mul_ref", "warp_ref",
    "rms_norm_linear", "rms_norm_linear_ref", "rms_norm_linear_rope_append", "rms_norm_linear_rope_append_ref",
    "layer_norm_linear", "layer_norm_linear_ref", "layer_norm_linear_append", "layer_norm_linear_append_ref",
]
