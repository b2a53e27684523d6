"""Patch an OPT model, check it against the original, generate with the fast path, and unpatch.

    python examples/quickstart.py [MODEL]   # a hub id or local directory; default: the shared opt-wt2-tiny
"""
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import fuseinfer

shared = os.environ.get("FUSEINFER_SHARED", os.path.join(os.path.dirname(__file__), "..", "..", "shared"))
default = os.path.join(shared, "models", "opt-wt2-tiny")  # (../shared beside the repository, wherever this runs)
path = sys.argv[1] if len(sys.argv) > 1 else default
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.float16 if device == "cuda" else torch.float32

tok = AutoTokenizer.from_pretrained(path, padding_side="left")
model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
enc = tok(["The tower is", "In 1990 , the band released"], return_tensors="pt", padding=True).to(device)

with torch.no_grad():
    before = model(**enc).logits
    report = fuseinfer.patch(model)
    print(report)
    after = model(**enc).logits
    real = enc.attention_mask.bool()
    print(f"max |patched - original| logit difference: {(after - before)[real].abs().max().item():.3g}")
    out = model.generate(**enc, max_new_tokens=20, do_sample=False)  # static cache + CUDA graphs on GPU
    print(tok.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True))
fuseinfer.unpatch(model)
