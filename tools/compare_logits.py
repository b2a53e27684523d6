"""Patched vs unpatched logits of a random-weight OPT on CUDA (default: the opt-1.3b shape, fp16).

Prints the patch report, then the max abs error of each against an fp32 run of the same weights and the rule
|ours - fp32| <= 2 |torch_fp16 - fp32|; exits 1 when the rule fails. Used by tools/gpu_check.sh.
"""
from __future__ import annotations

import argparse
import sys

import torch
from transformers import OPTConfig, OPTForCausalLM

import fuseinfer
from fuseinfer.harness.models import SHORT_NAMES
from fuseinfer.models.opt.configs import OPT_CONFIGS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="opt-1.3b", choices=SHORT_NAMES)
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    args = ap.parse_args()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    cfg = OPTConfig(**{**OPT_CONFIGS[f"facebook/{args.shape}"], "dropout": 0.0})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = OPTForCausalLM(cfg).eval()
    ids = torch.randint(3, cfg.vocab_size, (args.batch, args.seq), device="cuda")
    mask = torch.ones_like(ids)
    mask[-1, : args.seq // 4] = 0  # left-pad the last row
    real = mask.bool()
    with torch.no_grad():
        ref32 = model(input_ids=ids, attention_mask=mask).logits[real]
        model.to(dtype)
        torch_lowp = model(input_ids=ids, attention_mask=mask).logits[real].float()
        report = fuseinfer.patch(model)
        ours = model(input_ids=ids, attention_mask=mask).logits[real].float()
    print(report)
    torch_err = (torch_lowp - ref32).abs().max().item()
    ours_err = (ours - ref32).abs().max().item()
    agree = (ours.argmax(-1) == torch_lowp.argmax(-1)).float().mean().item()
    ok = ours_err <= 2 * torch_err
    print(f"{args.shape} {args.dtype} batch {args.batch} seq {args.seq} on {torch.cuda.get_device_name()}: "
          f"max|logit| {ref32.abs().max().item():.3f}; max abs err vs fp32: torch {torch_err:.4g}, "
          f"fuseinfer {ours_err:.4g} (ratio {ours_err / torch_err:.2f}, rule <= 2); "
          f"max |fuseinfer - torch_{args.dtype}| {(ours - torch_lowp).abs().max().item():.4g}; "
          f"argmax agreement {agree:.4f} -> {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
