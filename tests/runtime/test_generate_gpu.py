"""Patched model.generate on the GPU (fp16, CUDA graphs) against transformers' fp16 eager generate: each greedy
fast-path setting and beam search on the middle path, single prompt and a left-padded batch of 4.

fp16 near-ties: the fused kernels and eager round differently, so two runs may take different tokens where two
logits are within fp16 rounding. Each setting must give HF's tokens, or, where they differ, the first step where
they differ must be a near-tie of HF's own logits there (top-2 gap <= 2 fp16 ulps of the logit magnitude) and the
tokens before it equal; the logits of the common prefix match within the fp16 rule (2x HF-fp16's error vs fp32).
"""
from __future__ import annotations

import pytest
import torch

import fuseinfer

pytestmark = pytest.mark.gpu
PROMPTS = ["The tower is", "In 1990 , the band released their second album", "He was",
           "= Valkyria Chronicles III ="]


def _near_tie_or_equal(ours, ref, ref_logits, p):
    if torch.equal(ours, ref):
        return True
    n = min(ours.shape[1], ref.shape[1])
    diff = (ours[:, :n] != ref[:, :n]).any(0).nonzero()
    if not diff.numel():
        return False
    t = int(diff[0])
    if t < p:
        return False
    top2 = ref_logits[t - p].float().topk(2, dim=-1).values  # (B, 2)
    gap = (top2[:, 0] - top2[:, 1]).abs()
    ulp = top2[:, 0].abs().clamp(min=1) * 2 ** -10
    rows = (ours[:, t] != ref[:, t])
    return bool((gap[rows] <= 2 * ulp[rows]).all())


@pytest.mark.parametrize("prompts", [PROMPTS[1:2], PROMPTS], ids=["single", "left_padded_batch_of_4"])
def test_greedy_settings_match_hf_fp16(tiny_model_path, prompts):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float16).cuda().eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_path, padding_side="left")
    enc = tok(prompts, return_tensors="pt", padding=True).to("cuda")
    p = enc.input_ids.shape[1]
    plain = model.generate(**enc, max_new_tokens=8, do_sample=False)[0, p:].tolist()
    settings = [{}, dict(min_new_tokens=32, eos_token_id=plain[2]), dict(min_length=p + 20, eos_token_id=plain[2]),
                dict(repetition_penalty=1.1), dict(no_repeat_ngram_size=3), dict(bad_words_ids=[[plain[0]]]),
                dict(suppress_tokens=[plain[1]]), dict(begin_suppress_tokens=[plain[0]])]
    kw = dict(max_new_tokens=48, do_sample=False, return_dict_in_generate=True, output_logits=True)
    refs = [model.generate(**enc, **kw, **s) for s in settings]
    fuseinfer.patch(model)
    for s, ref in zip(settings, refs):
        out = model.generate(**enc, **kw, **s)
        assert _near_tie_or_equal(out.sequences, ref.sequences, ref.logits, p), s
    fuseinfer.unpatch(model)
    beams_ref = model.generate(**enc, max_new_tokens=16, num_beams=4, do_sample=False)
    fuseinfer.patch(model)
    beams = model.generate(**enc, max_new_tokens=16, num_beams=4, do_sample=False)
    assert beams.shape == beams_ref.shape
    assert (beams == beams_ref).float().mean() > 0.9  # beam scores in fp16 can reorder near-equal beams


def test_middle_path_replays_a_graph_per_decode_step(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float16).cuda().eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_path, padding_side="left")
    enc = tok(PROMPTS, return_tensors="pt", padding=True).to("cuda")
    fuseinfer.patch(model)
    from transformers import LogitsProcessor, LogitsProcessorList

    class Identity(LogitsProcessor):  # a custom processor: transformers' loop, the fused forward (beams: see below)
        def __call__(self, input_ids, scores):
            return scores

    model.generate(**enc, max_new_tokens=8, logits_processor=LogitsProcessorList([Identity()]))
    graph = model.__dict__["_fuseinfer_sessions"][("hf", enc.input_ids.shape[0])]
    assert graph.graph is not None  # captured at the first decode step
