"""Runs every CUDA kernel once on small odd shapes; the target of compute-sanitizer in tools/gpu_check.sh."""
import torch

from fuseinfer import ops

assert torch.cuda.is_available()
torch.manual_seed(0)
for dtype in (torch.float16, torch.bfloat16, torch.float32):
    x, r = torch.randn(37, 123, device="cuda", dtype=dtype), torch.randn(37, 123, device="cuda", dtype=dtype)
    w, b = torch.randn(123, device="cuda", dtype=dtype), torch.randn(123, device="cuda", dtype=dtype)
    ops.add_layer_norm(x, r, w, b, 1e-5, True)
    ops.add_layer_norm(torch.randn(5, 2048, device="cuda", dtype=dtype), None, None, None, 1e-5, False)
for dtype in (torch.float16, torch.bfloat16):
    x, w = torch.randn(19, 96, device="cuda", dtype=dtype), torch.randn(136, 96, device="cuda", dtype=dtype)
    b, r = torch.randn(136, device="cuda", dtype=dtype), torch.randn(19, 136, device="cuda", dtype=dtype)
    ops.linear_epilogue(x, w, b, None, "relu")
    ops.linear_epilogue(x, w, b, r, "none")
    ops.linear_epilogue(x[:1], w, b, r[:1], "none")
    for d in (64, 128):
        for sq, skv in ((77, 77), (1, 300), (4, 129)):
            q = torch.randn(2, 3, sq, d, device="cuda", dtype=dtype)
            k, v = (torch.randn(2, 3, skv, d, device="cuda", dtype=dtype) for _ in range(2))
            key_mask = torch.arange(skv, device="cuda")[None] >= torch.tensor([0, 11], device="cuda")[:, None]
            ops.attention(q, k, v, key_mask, None, d ** -0.5)
            ops.attention(q, k, v, None, None, d ** -0.5)
torch.cuda.synchronize()
print("kernel_smoke: all kernels ran")
