"""The one-graph beam search (``fuseinfer/runtime/beam.py``) on the GPU with CUDA graphs: in fp16 its tokens and beam
indices equal those of transformers' loop over the same fused forward (the middle path, forced) bit for bit, and its
beam scores to float32 rounding, on random OPT and Llama models (single prompt and a left-padded batch, EOS, length
penalty, every early_stopping value, num_return_sequences); in fp32 on the trained tiny OPT its tokens equal the
unpatched model's beam search; one capture per setting, none on repeated calls."""
from __future__ import annotations

import pytest
import torch
from conftest import random_llama, random_opt

import fuseinfer
from fuseinfer.runtime import beam
from fuseinfer.runtime.cache import COUNTS
from fuseinfer.runtime.decode import SESSIONS_ATTR

pytestmark = pytest.mark.gpu


def _inputs(batch: int, vocab: int, pad: int, length: int = 24, seed: int = 0):
    g = torch.Generator().manual_seed(seed + batch)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :5] = 0
        mask[-1, :11] = 0
        ids = ids.masked_fill(mask == 0, pad)
    return ids.cuda(), mask.cuda()


def _models():
    # head dim 64: the shapes the fused kernels (and OPT's one-kernel decode step) run
    return {"opt": lambda: random_opt(dtype=torch.float16, device="cuda", hidden_size=256, num_attention_heads=4,
                                      ffn_dim=512, vocab_size=1024, num_hidden_layers=3),
            "llama": lambda: random_llama(dtype=torch.float16, device="cuda", hidden_size=256, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=512, vocab_size=1024,
                                          num_hidden_layers=3)}


def _ours_and_middle(model, ids, mask, monkeypatch, **kw):
    """(our tokens, our session's program, transformers' loop over the fused forward: its output with scores)."""
    before = COUNTS["beam"]
    out = model.generate(ids, attention_mask=mask, do_sample=False, **kw)
    assert COUNTS["beam"] == before + 1
    rows = ids.shape[0] * kw["num_beams"]
    prog = next(reversed(model.__dict__[SESSIONS_ATTR][(beam.KEY, rows)].programs.values()))
    with monkeypatch.context() as m:
        m.setattr(beam, "ENABLED", False)
        ref = model.generate(ids, attention_mask=mask, do_sample=False, return_dict_in_generate=True,
                             output_scores=True, **kw)
    assert COUNTS["beam"] == before + 1
    return out, prog, ref


@pytest.mark.parametrize("family", ["opt", "llama"])
@pytest.mark.parametrize("batch,beams", [(1, 4), (3, 2), (3, 4)])
@pytest.mark.parametrize("case", ["plain", "eos", "eos_penalty_early", "eos_never_returns"])
def test_fp16_equals_transformers_loop_over_the_same_forward(family, batch, beams, case, monkeypatch):
    model = _models()[family]()
    fuseinfer.patch(model)
    ids, mask = _inputs(batch, 1024, model.config.pad_token_id)
    kw = dict(max_new_tokens=40, num_beams=beams)
    if case != "plain":
        plain = model.generate(ids, attention_mask=mask, do_sample=False, eos_token_id=None, max_new_tokens=8,
                               num_beams=beams)
        kw["eos_token_id"] = int(plain[0, ids.shape[1] + 4])
    if case == "eos_penalty_early":
        kw.update(length_penalty=1.7, early_stopping=True, min_new_tokens=3)
    elif case == "eos_never_returns":
        kw.update(length_penalty=0.5, early_stopping="never", num_return_sequences=2)
    out, prog, ref = _ours_and_middle(model, ids, mask, monkeypatch, **kw)
    assert torch.equal(out, ref.sequences), f"ours {out[:, ids.shape[1]:]}\nref {ref.sequences[:, ids.shape[1]:]}"
    returns = kw.get("num_return_sequences", 1)
    ours = prog.scores[:, :returns].reshape(-1)
    # the scores agree to float32 rounding: with a length penalty other than 1 some runs have differed in the last
    # bit from transformers' on CUDA (the same tokens and beams, so the same sums), never on the CPU (test_beam.py)
    torch.testing.assert_close(ours, ref.sequences_scores, rtol=2e-6, atol=1e-6,
                               msg=lambda m: f"{m}\nours {ours.tolist()}\nref {ref.sequences_scores.tolist()}")
    n = ref.beam_indices.shape[1]
    assert torch.equal(prog.bidx[:, :returns].reshape(ref.beam_indices.shape[0], -1)[:, :n].long(),
                       ref.beam_indices)


def test_fp32_tokens_equal_the_unpatched_beam_search(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).cuda().eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_path, padding_side="left")
    enc = tok(["The tower is", "In 1990 , the band released their second album", "He was"], return_tensors="pt",
              padding=True).to("cuda")
    calls = [dict(max_new_tokens=24, num_beams=4), dict(max_new_tokens=24, num_beams=3, num_return_sequences=2,
                                                          length_penalty=0.6, early_stopping=True)]
    refs = [model.generate(**enc, do_sample=False, **kw) for kw in calls]
    fuseinfer.patch(model)
    for kw, ref in zip(calls, refs):
        before = COUNTS["beam"]
        assert torch.equal(model.generate(**enc, do_sample=False, **kw), ref), kw
        assert COUNTS["beam"] == before + 1


def test_one_capture_per_setting_and_graphs_replayed():
    model = _models()["opt"]()
    fuseinfer.patch(model)
    ids, mask = _inputs(1, 1024, 1)
    kw = dict(max_new_tokens=20, num_beams=4, do_sample=False)
    captures = COUNTS["beam_graphs"]
    first = model.generate(ids, attention_mask=mask, **kw)
    assert COUNTS["beam_graphs"] == captures + 1
    prog = next(iter(model.__dict__[SESSIONS_ATTR][(beam.KEY, 4)].programs.values()))
    assert prog.graphs  # the steps ran as graph replays
    for _ in range(2):
        assert torch.equal(model.generate(ids, attention_mask=mask, **kw), first)
    assert COUNTS["beam_graphs"] == captures + 1
    longer, mask2 = _inputs(1, 1024, 1, length=40)  # another prompt length: the same graphs
    model.generate(longer, attention_mask=mask2, **kw)
    assert COUNTS["beam_graphs"] == captures + 1
