"""Target for Nsight Compute: the prefill attention at batch 1, 32 heads, 2048 tokens, head dims 64 and 128, in fp16,
twice with the 16-bit wgmma kernel and twice with the FP8 one (FUSEINFER_ATTN_FP8=1: its quantize pass of k and v,
then the e4m3 kernel), so that ncu times each kernel alone.

    ncu --kernel-name regex:'prefill_sm90_kernel|fp8_prep' --section SpeedOfLight --section InstructionStats \\
        python bench/ncu_attention_fp8.py
"""
import torch

from fuseinfer import ops
from fuseinfer.core.knobs import override

if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("ncu_attention_fp8: needs a CUDA GPU")
    torch.manual_seed(0)
    for d in (64, 128):
        q = torch.randn(1, 32, 2048, d, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(1, 32, 2048, d, device="cuda", dtype=torch.float16) for _ in range(2))
        for fp8 in ("0", "1"):
            with override(ATTN_FP8=fp8):
                for _ in range(2):
                    ops.attention(q, k, v, None, None, d ** -0.5)
    torch.cuda.synchronize()
