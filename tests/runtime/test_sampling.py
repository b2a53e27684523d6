"""Sampling on the fast decode path: one fused op (fuseinfer::sample_tokens) whose Philox seed comes from torch's
generator at each call, so torch.manual_seed makes generate reproducible; output_scores keeps the path that
materialises the warped scores. On a GPU: the same inside the decode graphs."""
from __future__ import annotations

import pytest
import torch

import fuseinfer
from fuseinfer.ops.sample_tokens import sample_tokens_ref
from fuseinfer.runtime.decode import SESSIONS_ATTR

PROMPTS = ["The tower is", "In 1990 , the band released their second album", "He was"]


def _load(path, device="cpu"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    return model, tok


def _session(model):
    return next(s for k, s in model.__dict__[SESSIONS_ATTR].items() if isinstance(k, int))


def _reproducible(model, enc, **kw):
    """Two calls after torch.manual_seed(0) agree, a third after manual_seed(1) does not; returns the first."""
    run = lambda: fuseinfer.generate(model, enc.input_ids, enc.attention_mask, **kw)  # noqa: E731
    torch.manual_seed(0)
    a = run()
    torch.manual_seed(0)
    b = run()
    torch.manual_seed(1)
    c = run()
    assert torch.equal(a, b) and not torch.equal(a, c)
    return a


@pytest.fixture
def fused(monkeypatch):
    """The fused sampling op on, whatever decode.FUSED_SAMPLING's default: these tests are about that path."""
    from fuseinfer.runtime import decode

    monkeypatch.setattr(decode, "FUSED_SAMPLING", True)


@pytest.mark.parametrize("kw", [dict(top_p=0.9, temperature=0.7), dict(top_k=50), dict(min_p=0.05, top_p=0.95)])
def test_sampling_is_reproducible_under_manual_seed(tiny_model_path, kw, fused):
    model, tok = _load(tiny_model_path)
    fuseinfer.patch(model)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    out = _reproducible(model, enc, max_new_tokens=12, do_sample=True, **kw)
    assert out.shape == (3, enc.input_ids.shape[1] + 12) and _session(model).fused_sampling


def test_first_token_is_the_reference_draw_of_the_prompt_logits(tiny_model_path, fused):
    """The first sampled token is sample_tokens_ref of the prompt's last logits, with the seed the call drew from
    torch's generator and offset 0 (the step counter)."""
    model, tok = _load(tiny_model_path)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**enc).logits[:, -1].float()  # (B, V)
    fuseinfer.patch(model)
    torch.manual_seed(3)
    seed = torch.randint(2**62, (1,))
    want = sample_tokens_ref(logits, seed, torch.tensor([0]), 0.8, 0, 0.9, 0.0)
    torch.manual_seed(3)
    out = fuseinfer.generate(model, enc.input_ids, enc.attention_mask, max_new_tokens=1, do_sample=True, top_p=0.9,
                             temperature=0.8)
    assert _session(model).fused_sampling and out[:, -1].tolist() == want.tolist()


def test_output_scores_keeps_the_warped_scores(tiny_model_path):
    model, tok = _load(tiny_model_path)
    fuseinfer.patch(model)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    out = fuseinfer.generate(model, enc.input_ids, enc.attention_mask, max_new_tokens=6, do_sample=True, top_k=5,
                             return_dict_in_generate=True, output_scores=True)
    assert not _session(model).fused_sampling
    p = enc.input_ids.shape[1]
    for t, scores in enumerate(out.scores):  # (B, V): top-k 5 leaves 5 finite scores, the drawn token among them
        assert (torch.isfinite(scores).sum(-1) == 5).all()
        assert torch.isfinite(scores.gather(1, out.sequences[:, p + t, None])).all()


def test_pytorch_warpers_path_still_samples(tiny_model_path, monkeypatch):
    """decode.FUSED_SAMPLING = False (what bench_sampling compares): the warpers as PyTorch ops and the race."""
    from fuseinfer.runtime import decode

    monkeypatch.setattr(decode, "FUSED_SAMPLING", False)
    model, tok = _load(tiny_model_path)
    fuseinfer.patch(model)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    greedy = fuseinfer.generate(model, enc.input_ids, enc.attention_mask, max_new_tokens=8)
    top1 = fuseinfer.generate(model, enc.input_ids, enc.attention_mask, max_new_tokens=8, do_sample=True, top_k=1)
    assert torch.equal(top1, greedy) and not _session(model).fused_sampling


@pytest.mark.gpu
def test_sampling_inside_the_decode_graphs(tiny_model_path, fused):
    from helpers import require_kernel

    require_kernel()
    model, tok = _load(tiny_model_path, "cuda")
    enc = tok(PROMPTS, return_tensors="pt", padding=True).to("cuda")
    fuseinfer.patch(model)
    out = _reproducible(model, enc, max_new_tokens=40, do_sample=True, top_p=0.9, temperature=0.7)
    session = _session(model)
    assert session.fused_sampling and session.graphs and out.shape[1] == enc.input_ids.shape[1] + 40
    # top-k 1 leaves the maximum (every tied one: fp16 logits tie), through the kernel and the graphs
    top1 = fuseinfer.generate(model, enc.input_ids, enc.attention_mask, max_new_tokens=40, do_sample=True, top_k=1,
                              temperature=0.7, return_dict_in_generate=True, output_logits=True)
    assert _session(model).fused_sampling
    p = enc.input_ids.shape[1]
    for t, logits in enumerate(top1.logits):  # (B, V) per step
        chosen = logits.gather(1, top1.sequences[:, p + t, None].to(logits.device))
        assert torch.equal(chosen[:, 0], logits.amax(-1))


@pytest.mark.parametrize("kw", [dict(top_p=0.9, temperature=0.7, top_k=0), dict(top_k=20), dict(min_p=0.05, top_k=0)])
def test_sampled_tokens_equal_transformers_under_the_same_seed_on_cpu(tiny_model_path, kw):
    """On the CPU the default sampling path draws as transformers does (torch.multinomial over the call's rows, one
    call per step), so under one torch.manual_seed the patched model.generate and fuseinfer.generate give the
    unpatched model's sampled tokens (a left-padded batch of 3, 12 new tokens). top_k is always given: fuseinfer.generate
    takes only the settings it is passed, model.generate also the generation config's defaults (its top_k of 50)."""
    model, tok = _load(tiny_model_path)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    args = dict(max_new_tokens=12, min_new_tokens=12, do_sample=True, **kw)
    with torch.no_grad():
        torch.manual_seed(5)
        want = model.generate(**enc, **args)
    fuseinfer.patch(model)
    torch.manual_seed(5)
    got = model.generate(**enc, **args)
    assert not _session(model).fused_sampling
    assert torch.equal(got, want), (got[:, -12:].tolist(), want[:, -12:].tolist())
    torch.manual_seed(5)
    assert torch.equal(fuseinfer.generate(model, enc.input_ids, enc.attention_mask, **args), want)
    torch.manual_seed(6)
    assert not torch.equal(fuseinfer.generate(model, enc.input_ids, enc.attention_mask, **args), want)  # (it samples)
