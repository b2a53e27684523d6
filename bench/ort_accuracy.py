"""Logits of the ONNX exports (fused and plain) run by ONNX Runtime vs PyTorch, on the trained tiny OPT.

For each flavour: export the fp16 (CUDA) / fp32 (CPU) model, run it through OrtDecoder (IO binding), and measure
max |logits - fp32 PyTorch| over a left-padded batch, whole sequence and prefill + decode steps, next to PyTorch
fp16's own error (the tolerance rule: ours <= 2x torch's + 1e-2), plus greedy tokens for 32 steps vs PyTorch in the
same dtype. Writes JSON + Markdown to $FUSEINFER_BENCH_DIR (argv[1] overrides the stem).

    python bench/ort_accuracy.py [OUT_STEM] [cuda|cpu]
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch  # before onnxruntime: loads the CUDA libraries onnxruntime-gpu links against

from fuseinfer.export import OrtDecoder, to_onnx
from fuseinfer.export.check import logit_errors, within_tolerance

SHARED = Path(os.environ.get("FUSEINFER_SHARED", Path(__file__).resolve().parents[1] / "shared"))
RESULTS = Path(os.environ.get("FUSEINFER_BENCH_DIR", Path(__file__).resolve().parent / "results"))


@torch.no_grad()
def greedy_match(dec, model, ids, steps=32) -> float:
    """Fraction of ORT's greedy tokens equal to PyTorch's (same dtype) over ``steps`` tokens after ``ids``."""
    ref = model.generate(ids, do_sample=False, max_new_tokens=steps, min_new_tokens=steps, pad_token_id=1)
    ref = ref[:, ids.shape[1]:]
    dec.start(ids.shape[0], ids.shape[1] + steps)
    tok = dec.prefill(ids)[:, -1].argmax(-1, keepdim=True)
    out = [tok]
    for _ in range(steps - 1):
        tok = dec.step(tok)[:, -1].argmax(-1, keepdim=True)
        out.append(tok)
    dec.end()
    return (torch.cat(out, dim=1) == ref).double().mean().item()


def main():
    from transformers import AutoModelForCausalLM

    stem = sys.argv[1] if len(sys.argv) > 1 else str(RESULTS / "ort_accuracy")
    device = sys.argv[2] if len(sys.argv) > 2 else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device == "cuda" else torch.float32
    path = SHARED / "models" / "opt-wt2-tiny"
    fp32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    lowp = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, fp32.config.vocab_size, (4, 96), generator=g).to(device)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding on one row
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for flavour in ("fused", "plain"):
            directory = Path(tmp) / flavour
            to_onnx(lowp, directory, flavour=flavour)
            dec = OrtDecoder(directory, device, model=lowp, flavour=flavour)
            row = logit_errors(directory, fp32, lowp, device, ids, mask, prompt_len=80, decoder=dec)
            row["within_2x_torch"] = within_tolerance(row)
            row["greedy_match_32"] = greedy_match(dec, lowp, ids[:1, :16])
            row["providers"] = dec.session.get_providers()
            rows[flavour] = row
            del dec
    env = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
           "onnxruntime": __import__("onnxruntime").__version__, "dtype": str(dtype).split(".")[-1],
           "model": str(path), "batch": list(ids.shape), "padded_rows": 1}
    Path(stem).parent.mkdir(parents=True, exist_ok=True)
    Path(stem + ".json").write_text(json.dumps({"environment": env, "flavours": rows}, indent=2) + "\n")
    lines = [f"# ORT vs PyTorch logits, opt-wt2-tiny {env['dtype']} on {env['device']} (onnxruntime "
             f"{env['onnxruntime']}, torch {env['torch']}); batch {ids.shape[0]} x {ids.shape[1]}, one row "
             "left-padded; prefill 80 + 16 decode steps", "",
             "| flavour | ORT max err | torch max err | ratio | <= 2x torch + 0.01 | greedy = torch (32) |",
             "|---|---|---|---|---|---|"]
    for flavour, r in rows.items():
        lines.append(f"| {flavour} | {r['ort_max_err']:.4g} | {r['torch_max_err']:.4g} | {r['ratio_to_torch']:.2f} "
                     f"| {'yes' if r['within_2x_torch'] else 'NO'} | {r['greedy_match_32']:.0%} |")
    Path(stem + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["within_2x_torch"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
