"""Runs each int8 CUDA kernel once on small odd shapes (decode GEMV fp16/bf16 with one and two n-tiles, with and
without a K tail, each epilogue; the prefill dequantize + GEMM; row quantize; dequantize) and a small W8A16 model;
the target of compute-sanitizer (memcheck, racecheck, synccheck) in tools/gpu_stage_int8.sh."""
import sys
from pathlib import Path

import torch

import fuseinfer
from fuseinfer import ops
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import random_opt  # noqa: E402

assert torch.cuda.is_available()
torch.manual_seed(0)
for dtype in (torch.float16, torch.bfloat16):
    for m in (1, 5, 9, 16, 40):
        for n, k in ((70, 96), (200, 1040), (48, 256)):
            w = torch.randn(n, k, device="cuda", dtype=dtype)
            q, s = ops.quantize_per_channel(w)
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            b = torch.randn(n, device="cuda", dtype=dtype)
            r = torch.randn(m, n, device="cuda", dtype=dtype)
            ops.w8a16_linear(x, q, s.reshape(-1), b, None, "relu")
            ops.w8a16_linear(x, q, s.reshape(-1), b, r, "none")
            ops.dequantize_weight(q, s.reshape(-1), dtype)
    ops.quantize_per_token(torch.randn(3, 100, device="cuda", dtype=dtype))
model = random_opt(hidden_size=128, num_attention_heads=2, ffn_dim=256).to("cuda", torch.float16)
fuseinfer.patch(model, fuseinfer.PatchConfig(quant=fuseinfer.Int8WeightOnly()))
fuseinfer.generate(model, torch.randint(0, 512, (2, 20), device="cuda"), max_new_tokens=3)
torch.cuda.synchronize()
print("int8 smoke ok")
