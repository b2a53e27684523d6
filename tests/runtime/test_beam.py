"""Beam search of patched ``model.generate`` on the one-graph path (``fuseinfer/runtime/beam.py``) against the
unpatched model's beam search, on CPU fp32: the trained tiny OPT, random OPT and Llama models, 2 and 4 beams,
batch 1 and a left-padded batch of 3, EOS that ends beams early, length penalties, every early_stopping value,
num_return_sequences, min_new_tokens; the settings it hands to the middle path; the exact beam scores."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from conftest import random_llama, random_opt
from helpers import given, settings, st

import fuseinfer
from fuseinfer.runtime import beam, hf_generate
from fuseinfer.runtime.cache import COUNTS
from fuseinfer.runtime.decode import SESSIONS_ATTR


@pytest.fixture(autouse=True)
def _fresh_log(monkeypatch):
    monkeypatch.setattr(hf_generate, "_logged", set())


def _pair(model):
    """(the unpatched model, a patched copy)."""
    patched = copy.deepcopy(model)
    fuseinfer.patch(patched)
    return model, patched


@pytest.fixture(scope="module")
def tiny_opt(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return _pair(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval())


@pytest.fixture(scope="module")
def rand_opt():
    return _pair(random_opt())


@pytest.fixture(scope="module")
def rand_llama():
    return _pair(random_llama())


def _inputs(batch: int, vocab: int, pad: int, length: int = 10, seed: int = 0):
    """Random prompts: batch 1 unpadded, or a batch of 3 with rows 1 and 2 left-padded (3 and 6 pads)."""
    g = torch.Generator().manual_seed(seed + batch)
    ids = torch.randint(3, min(vocab, 200), (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :3] = 0
        mask[2, :6] = 0
        ids = ids.masked_fill(mask == 0, pad)
    return ids, mask


def _check(pair, ids, mask, **kw):
    """The patched model's beam search takes the one-graph path and returns the unpatched model's tokens."""
    base, patched = pair
    kw = {"do_sample": False, **kw}
    ref = base.generate(ids, attention_mask=mask, **kw)
    before = COUNTS["beam"]
    out = patched.generate(ids, attention_mask=mask, **kw)
    assert COUNTS["beam"] == before + 1, "the one-graph beam search did not run"
    assert out.shape == ref.shape and torch.equal(out, ref), f"{kw}\nours {out[:, ids.shape[1]:]}\n" \
                                                             f"ref  {ref[:, ids.shape[1]:]}"
    return ref


def _early_eos(pair, ids, mask, **kw) -> int:
    """An EOS id the beams meet early: the third new token of the best beam without EOS."""
    ref = pair[0].generate(ids, attention_mask=mask, do_sample=False, eos_token_id=None, **kw)
    return int(ref[0, ids.shape[1] + 2])


# (the CPU runs fuseinfer's op references, slower than the model's own forward: few, short cases per model)
@pytest.mark.parametrize("name,beams,batch", [("tiny_opt", 4, 3), ("tiny_opt", 2, 1), ("rand_opt", 2, 3),
                                              ("rand_opt", 4, 1), ("rand_llama", 4, 3), ("rand_llama", 2, 1)])
def test_beam_search_equals_transformers(name, beams, batch, request):
    pair = request.getfixturevalue(name)
    cfg = pair[0].config
    ids, mask = _inputs(batch, cfg.vocab_size, cfg.pad_token_id)
    _check(pair, ids, mask, max_new_tokens=8, num_beams=beams)
    eos = _early_eos(pair, ids, mask, max_new_tokens=4, num_beams=beams)
    _check(pair, ids, mask, max_new_tokens=8, num_beams=beams, eos_token_id=eos)
    _check(pair, ids, mask, max_new_tokens=8, num_beams=beams, eos_token_id=[eos, cfg.eos_token_id],
           num_return_sequences=2, length_penalty=2.0, early_stopping=True)


@pytest.mark.parametrize("early_stopping,length_penalty", [(True, 1.0), (True, 0.5), (False, -1.5), (False, 3),
                                                           ("never", 1.0), ("never", -0.5)])
def test_early_stopping_and_length_penalty(early_stopping, length_penalty, rand_opt):
    ids, mask = _inputs(3, 512, 1, seed=5)
    eos = _early_eos(rand_opt, ids, mask, max_new_tokens=4, num_beams=3)
    _check(rand_opt, ids, mask, max_new_tokens=10, num_beams=3, eos_token_id=eos, early_stopping=early_stopping,
           length_penalty=length_penalty, num_return_sequences=2)


@pytest.mark.parametrize("name", ["rand_opt", "rand_llama"])
def test_min_new_tokens_and_min_length_hold_eos_back(name, request):
    pair = request.getfixturevalue(name)
    ids, mask = _inputs(3, 512, pair[0].config.pad_token_id, seed=2)
    eos = _early_eos(pair, ids, mask, max_new_tokens=6, num_beams=2)
    _check(pair, ids, mask, max_new_tokens=12, num_beams=2, eos_token_id=eos, min_new_tokens=7)
    _check(pair, ids, mask, max_new_tokens=12, num_beams=2, eos_token_id=eos, min_length=ids.shape[1] + 5)
    _check(pair, ids, mask, max_length=ids.shape[1] + 9, num_beams=2, eos_token_id=eos)


def test_max_new_tokens_1_and_repeated_calls_reuse_the_session(rand_opt):
    ids, mask = _inputs(1, 512, 1)
    _check(rand_opt, ids, mask, max_new_tokens=1, num_beams=4)
    sessions = rand_opt[1].__dict__[SESSIONS_ATTR]
    _check(rand_opt, ids, mask, max_new_tokens=9, num_beams=4)
    session = sessions[(beam.KEY, 4)]
    programs = list(session.programs.values())
    _check(rand_opt, ids, mask, max_new_tokens=9, num_beams=4)
    assert list(session.programs.values()) == programs  # the same settings: the same program (and graphs)
    # a longer prompt reuses the session's cache where it fits
    longer, mask2 = _inputs(1, 512, 1, length=30)
    _check(rand_opt, longer, mask2, max_new_tokens=9, num_beams=4)
    assert sessions[(beam.KEY, 4)] is session


@settings(max_examples=8, deadline=None)
@given(beams=st.integers(2, 4), batch=st.sampled_from([1, 3]), new=st.integers(1, 9),
       length_penalty=st.sampled_from([1.0, 0.0, 0.7, -0.5, 2.0]),
       early_stopping=st.sampled_from([True, False, "never"]), returns=st.integers(1, 4),
       min_new=st.integers(0, 5), eos_at=st.integers(0, 4), seed=st.integers(0, 1000))
def test_any_supported_setting_equals_transformers(beams, batch, new, length_penalty, early_stopping, returns,
                                                    min_new, eos_at, seed):
    pair = _random_opt_pair()
    ids, mask = _inputs(batch, 512, 1, seed=seed)
    plain = pair[0].generate(ids, attention_mask=mask, max_new_tokens=6, num_beams=2, do_sample=False,
                             eos_token_id=None)
    eos = int(plain[0, ids.shape[1] + eos_at])
    _check(pair, ids, mask, max_new_tokens=new, num_beams=beams, length_penalty=length_penalty,
           early_stopping=early_stopping, num_return_sequences=min(returns, beams), eos_token_id=eos,
           min_new_tokens=min_new)


_PAIR: list = []


def _random_opt_pair():
    """One random OPT pair for the property test (hypothesis does not take function-scoped fixtures)."""
    if not _PAIR:
        _PAIR.append(_pair(random_opt(seed=1)))
    return _PAIR[0]


def test_scores_are_transformers_beam_scores(tiny_opt):
    """The finished hypotheses' scores and beam indices equal those of transformers' loop over the same forward
    (the middle path, which return_dict_in_generate takes) bit for bit: the same arithmetic; and the unpatched
    model's up to the forwards' rounding."""
    base, patched = tiny_opt
    ids, mask = _inputs(3, 8192, 1, seed=7)
    eos = _early_eos(tiny_opt, ids, mask, max_new_tokens=6, num_beams=4)
    kw = dict(max_new_tokens=8, num_beams=4, num_return_sequences=3, eos_token_id=eos, length_penalty=0.8,
              do_sample=False)
    unpatched = base.generate(ids, attention_mask=mask, return_dict_in_generate=True, output_scores=True, **kw)
    ref = patched.generate(ids, attention_mask=mask, return_dict_in_generate=True, output_scores=True, **kw)
    out = patched.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(out, ref.sequences) and torch.equal(out, unpatched.sequences)
    torch.testing.assert_close(ref.sequences_scores, unpatched.sequences_scores)
    session = patched.__dict__[SESSIONS_ATTR][(beam.KEY, 12)]
    prog = next(reversed(session.programs.values()))
    assert torch.equal(prog.scores[:, :3].reshape(-1), ref.sequences_scores)
    n = ref.beam_indices.shape[1]
    assert torch.equal(prog.bidx[:, :3].reshape(9, -1)[:, :n].long(), ref.beam_indices)


@pytest.mark.parametrize("case", ["return_dict", "sampling", "custom_processor", "switched_off"])
def test_other_beam_searches_take_the_middle_path(case, rand_opt, caplog, monkeypatch):
    from transformers import LogitsProcessorList
    from transformers.generation.logits_process import TemperatureLogitsWarper

    ids, mask = _inputs(1, 512, 1)
    kw = dict(max_new_tokens=6, num_beams=4, do_sample=False)
    if case == "return_dict":
        kw["return_dict_in_generate"] = True
    elif case == "sampling":
        kw.update(do_sample=True, top_k=1)
    elif case == "custom_processor":
        kw["logits_processor"] = LogitsProcessorList([TemperatureLogitsWarper(0.5)])
    else:
        monkeypatch.setattr(beam, "ENABLED", False)
    base, patched = rand_opt
    torch.manual_seed(0)
    ref = base.generate(ids, attention_mask=mask, **kw)
    before = COUNTS["beam"]
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="fuseinfer"):
        out = patched.generate(ids, attention_mask=mask, **kw)
    assert COUNTS["beam"] == before
    assert "takes the middle path" in caplog.text
    seq = out.sequences if case == "return_dict" else out
    assert torch.equal(seq, ref.sequences if case == "return_dict" else ref)


class _EagerGraph:
    def __init__(self, step, n):
        self.step, self.n = step, n

    def replay(self):
        for _ in range(self.n):
            self.step()


def test_captured_steps_on_the_cpu_equal_transformers(monkeypatch):
    """The graph bookkeeping on the CPU: ``capture_graphs`` stands in with two real warm-up steps (on the state a
    step scored on zero logits leaves) and eager replays of 1 and ``graph_steps`` steps; the call after the capture
    resets that state, an early stop inside a multi-step replay leaves the result as it was, one capture per
    setting."""
    def capture(step, counts, step_counter, mode):
        for _ in range(2):
            step_counter.zero_()
            step()
        step_counter.zero_()
        return {n: _EagerGraph(step, n) for n in counts}

    monkeypatch.setattr(beam, "_graphs_enabled", lambda dev, plan, runtime: True)
    monkeypatch.setattr(beam, "capture_graphs", capture)
    pair = _pair(random_opt(seed=2))
    ids, mask = _inputs(3, 512, 1, seed=4)
    kw = dict(max_new_tokens=21, num_beams=3, do_sample=False)
    plain = pair[0].generate(ids, attention_mask=mask, eos_token_id=None, num_return_sequences=3, **kw)
    stopping = dict(early_stopping=True, num_return_sequences=2)
    # an EOS with which the search stops early (steps 2 to 17: inside the first replay of 16 steps)
    eos = next(t for t in dict.fromkeys(plain[:, ids.shape[1]:].flatten().tolist())
               if pair[0].generate(ids, attention_mask=mask, eos_token_id=t, **stopping, **kw).shape[1]
               < ids.shape[1] + 18)
    captures = COUNTS["beam_graphs"]
    for settings_ in ({}, dict(eos_token_id=eos, **stopping)):
        for _ in range(2):
            _check(pair, ids, mask, **kw, **settings_)
    assert COUNTS["beam_graphs"] == captures + 2
    programs = pair[1].__dict__[SESSIONS_ATTR][(beam.KEY, 9)].programs.values()
    assert all(sorted(p.graphs) == sorted({1, min(p.session.graph_steps, 20)}) for p in programs)
