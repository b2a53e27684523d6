"""Beam search on the generate middle path (transformers' loop over fuseinfer's FusedCache) on CUDA, called
directly (patched ``model.generate`` hands CUDA beam search to transformers until this runs clean): compares the
tokens with the unpatched model's beam search. Run under compute-sanitizer memcheck to locate a bad access.

    python tools/beam_repro.py [--model DIR|random:opt-125m] [--beams 4] [--batch 1] [--new 8]
"""
import argparse
import copy
import os

import torch
from transformers import OPTConfig, OPTForCausalLM

import fuseinfer
from fuseinfer.runtime.hf_generate import _middle_generate

ap = argparse.ArgumentParser()
ap.add_argument("--model", default=os.path.join(os.environ.get("FUSEINFER_SHARED", "../shared"), "models/opt-wt2-tiny"))
ap.add_argument("--beams", type=int, default=4)
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--prompt", type=int, default=16)
ap.add_argument("--new", type=int, default=8)
ap.add_argument("--device", default="cuda")
a = ap.parse_args()
DEV = a.device
torch.manual_seed(0)
if a.model.startswith("random:"):
    big = a.model == "random:opt-1.3b"
    cfg = OPTConfig(hidden_size=2048 if big else 768, num_attention_heads=32 if big else 12,
                    num_hidden_layers=24 if big else 4, ffn_dim=8192 if big else 3072,
                    max_position_embeddings=2048, vocab_size=50272)
    model = OPTForCausalLM(cfg).half().to(DEV).eval()
else:
    model = OPTForCausalLM.from_pretrained(a.model, dtype=torch.float16).to(DEV).eval()
ref = copy.deepcopy(model)
ids = torch.randint(3, model.config.vocab_size - 1, (a.batch, a.prompt), device=DEV)
kw = dict(max_new_tokens=a.new, min_new_tokens=a.new, num_beams=a.beams, do_sample=False, early_stopping=True)
with torch.no_grad():
    want = ref.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    fuseinfer.patch(model)
    got = _middle_generate(model, ids, None, {**kw, "attention_mask": torch.ones_like(ids)}, a.prompt + a.new)
    if DEV == "cuda":
        torch.cuda.synchronize()
print("tokens equal:", torch.equal(got, want), "\nref", want[:, a.prompt:].tolist(), "\ngot", got[:, a.prompt:].tolist())
