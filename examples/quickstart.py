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


def fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


if len(sys.argv) == 1 and not os.path.isfile(os.path.join(path, "config.json")):
    fail(f"no model given and the shared tiny OPT is not at {os.path.abspath(path)}: pass a model "
         "(python examples/quickstart.py facebook/opt-125m) or set FUSEINFER_SHARED to the folder holding models/")
try:
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
except (OSError, ValueError) as exc:  # (no such folder or hub id, no network, not a causal LM)
    fail(f"cannot load {path!r}: {str(exc).strip().splitlines()[0]}")
enc = tok(["The tower is", "In 1990 , the band released"], return_tensors="pt", padding=True).to(device)

with torch.no_grad():
    before = model(**enc).logits
    expected = model.generate(**enc, max_new_tokens=20, do_sample=False)  # transformers' own, unpatched
    report = fuseinfer.patch(model)
    print(report)
    after = model(**enc).logits
    real = enc.attention_mask.bool()
    diff = (after - before)[real].abs().max().item()
    print(f"max |patched - original| logit difference: {diff:.3g}")
    # fp32 on CPU runs the ops' references (same math, another order); fp16 kernels differ by rounding
    assert diff < (5e-2 if dtype == torch.float16 else 1e-3), f"patched logits differ by {diff}"
    out = model.generate(**enc, max_new_tokens=20, do_sample=False)  # static cache + CUDA graphs on GPU
    print(tok.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True))
    if dtype == torch.float32:  # (fp16 may break a near-tie between two tokens another way)
        assert torch.equal(out, expected), "greedy tokens differ from transformers' generate"
fuseinfer.unpatch(model)
assert model(**enc).logits.equal(before), "unpatch did not restore the model"
print("quickstart: OK")
