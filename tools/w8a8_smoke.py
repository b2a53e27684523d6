"""Runs the W8A8 kernels once each on small shapes and checks them against their references; the target of
compute-sanitizer memcheck in tools/gpu_stage_w8a8.sh.

    python tools/w8a8_smoke.py

Covers: the sm90 int8 GEMM's two tile configurations (M <= 128 and M > 128, M not a tile multiple), fp16 and bf16
output, with and without bias / residual / ReLU; add_layer_norm_quant's warp-per-row and block-per-row vector
paths and its scalar path (N not a multiple of 8), with and without residual and sum. Exits non-zero on a mismatch
or when the sm90 kernel is not the backend on an sm_90 GPU.
"""
import sys

import torch

from fuseinfer.ops.w8a8_linear import w8a8_backend, w8a8_linear, w8a8_linear_ref, w8a8_unavailable_reason
from fuseinfer.ops.layer_norm_quant import add_layer_norm_quant, add_layer_norm_quant_ref

assert torch.cuda.is_available()
dev = torch.device("cuda")
backend = w8a8_backend(dev)
print(f"w8a8 backend: {backend} {w8a8_unavailable_reason(dev)}")
if torch.cuda.get_device_capability() == (9, 0) and backend != "cutlass-sm90":
    sys.exit(f"sm_90 GPU but the W8A8 GEMM backend is {backend}: {w8a8_unavailable_reason(dev)}")
torch.manual_seed(0)
failures = 0
for m in (48, 200):
    for dtype in (torch.float16, torch.bfloat16):
        for bias, residual, act in ((True, False, "none"), (True, True, "none"), (True, False, "relu"),
                                    (False, False, "none")):
            n, k = 136, 96
            xq = torch.randint(-127, 128, (m, k), device=dev, dtype=torch.int8)
            wq = torch.randint(-127, 128, (n, k), device=dev, dtype=torch.int8)
            xs, ws = torch.rand(m, 1, device=dev) * 1e-3, torch.rand(n, 1, device=dev) * 1e-3
            b = torch.randn(n, device=dev, dtype=dtype) if bias else None
            r = torch.randn(m, n, device=dev, dtype=dtype) if residual else None
            out = w8a8_linear(xq, xs, wq, ws, b, r, act, dtype)
            ref = w8a8_linear_ref(xq, xs, wq, ws, b, r, act, torch.float32)
            err = (out.float() - ref).abs().max().item()
            tol = 2e-2 * ref.abs().max().item() + 1e-2
            ok = err <= tol
            failures += not ok
            print(f"w8a8_linear M={m} N={n} K={k} {dtype} bias={bias} residual={residual} {act}: max err {err:.3g} "
                  f"{'ok' if ok else 'FAIL'}")
for shape, dtype in (((5, 256), torch.float16), ((3, 4096), torch.bfloat16), ((4, 100), torch.float16),
                     ((2, 12288), torch.float16), ((6, 64), torch.float32)):
    for residual in (False, True):
        x = torch.randn(*shape, device=dev, dtype=dtype)
        r = torch.randn(*shape, device=dev, dtype=dtype) if residual else None
        w, b = torch.randn(shape[1], device=dev, dtype=dtype), torch.randn(shape[1], device=dev, dtype=dtype)
        q, s, total = add_layer_norm_quant(x, r, w, b, 1e-5, residual)
        eq, es, etotal = add_layer_norm_quant_ref(x, r, w, b, 1e-5, residual)
        ok = (q.int() - eq.int()).abs().max().item() <= 1 and torch.allclose(s, es, rtol=2e-3) and \
            torch.equal(total, etotal)
        failures += not ok
        print(f"add_layer_norm_quant {shape} {dtype} residual={residual}: {'ok' if ok else 'FAIL'}")
torch.cuda.synchronize()
print(f"{failures} failures")
sys.exit(1 if failures else 0)
