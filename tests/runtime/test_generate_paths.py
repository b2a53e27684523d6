"""Patched ``model.generate`` against transformers' on CPU fp32: every greedy setting of the fast path, the middle
path (beam search, custom processors and criteria, assisted decoding), a pipeline, streamer and stop strings."""
from __future__ import annotations

import logging

import pytest
import torch
from conftest import random_opt

import fuseinfer
from fuseinfer.runtime import beam, hf_generate
from fuseinfer.runtime.decode import SESSIONS_ATTR

PROMPTS = ["The tower is", "In 1990 , the band released their second album", "He was",
           "= Valkyria Chronicles III ="]


@pytest.fixture(autouse=True)
def _fresh_log(monkeypatch):
    monkeypatch.setattr(hf_generate, "_logged", set())


def _inputs(batch: int):
    """Random-model prompts: batch 1 unpadded, or a left-padded batch of 4 (pad id 1)."""
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, 60, (batch, 12), generator=g)  # few distinct ids: the random model repeats itself
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :3] = 0
        mask[3, :7] = 0
        ids = ids.masked_fill(mask == 0, 1)
    return ids, mask


def _settings(model, ids, mask):
    """Greedy settings, with token ids taken from the unpatched model's own output so that each setting changes
    it (an EOS that the plain run emits early, a bigram it repeats, its first token)."""
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None)
    new = plain[0, ids.shape[1]:].tolist()
    eos = new[3]
    p = ids.shape[1]
    return {
        "none": {},
        "min_new_tokens": dict(eos_token_id=eos, min_new_tokens=12),
        "min_length": dict(eos_token_id=eos, min_length=p + 9),
        "repetition_penalty": dict(repetition_penalty=1.3),
        "repetition_penalty_below_1": dict(repetition_penalty=0.7),
        "no_repeat_ngram_size_2": dict(no_repeat_ngram_size=2),
        "no_repeat_ngram_size_3": dict(no_repeat_ngram_size=3),
        "bad_words_ids": dict(bad_words_ids=[[new[0]], [new[4], new[5]]]),
        "suppress_tokens": dict(suppress_tokens=[new[1], new[2]]),
        "begin_suppress_tokens": dict(begin_suppress_tokens=[new[0]]),
        "combined": dict(eos_token_id=eos, min_new_tokens=6, repetition_penalty=1.2, no_repeat_ngram_size=3,
                         suppress_tokens=[new[2]]),
    }


@pytest.mark.parametrize("batch", [1, 4], ids=["single", "left_padded_batch_of_4"])
def test_every_greedy_setting_takes_the_fast_path_and_equals_transformers(batch, caplog):
    model = random_opt()
    ids, mask = _inputs(batch)
    settings = _settings(model, ids, mask)
    kw = dict(max_new_tokens=24, do_sample=False)
    refs = {name: model.generate(ids, attention_mask=mask, **kw, **s) for name, s in settings.items()}
    assert len({tuple(r.flatten().tolist()) for r in refs.values()}) > 6  # the settings change the output
    fuseinfer.patch(model)
    with caplog.at_level(logging.INFO, logger="fuseinfer"):
        for name, s in settings.items():
            model.__dict__.pop(SESSIONS_ATTR, None)
            assert torch.equal(model.generate(ids, attention_mask=mask, **kw, **s), refs[name]), name
            assert any(isinstance(k, int) for k in model.__dict__[SESSIONS_ATTR]), name  # the fast path ran
            ours = fuseinfer.generate(model, ids, mask, **kw, **{"eos_token_id": 2, "pad_token_id": 1, **s})
            assert torch.equal(ours, refs[name]), name
    assert "falls back" not in caplog.text and "middle path" not in caplog.text


@pytest.mark.parametrize("batch", [1, 4], ids=["single", "left_padded_batch_of_4"])
def test_return_dict_with_scores_and_logits_like_transformers(batch):
    model = random_opt()
    ids, mask = _inputs(batch)
    kw = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_scores=True,
              output_logits=True, repetition_penalty=1.4, no_repeat_ngram_size=2)
    ref = model.generate(ids, attention_mask=mask, **kw)
    fuseinfer.patch(model)
    out = model.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == len(out.logits) == 10
    for ours, theirs in zip(out.scores + out.logits, ref.scores + ref.logits):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                           return_dict_in_generate=True)
    assert plain.scores is None and plain.logits is None
    assert all(s.scores_out is None for k, s in model.__dict__[SESSIONS_ATTR].items()
               if s.rule.output_scores is False)  # per-step buffers only where asked for


def test_sampling_with_processors_and_min_p_runs_on_the_fast_path():
    model = random_opt()
    ids, mask = _inputs(4)
    fuseinfer.patch(model)
    torch.manual_seed(0)
    kw = dict(max_new_tokens=16, do_sample=True, temperature=0.9, top_k=20, top_p=0.95, min_p=0.05,
              repetition_penalty=1.2, no_repeat_ngram_size=2)
    a, b = model.generate(ids, attention_mask=mask, **kw), model.generate(ids, attention_mask=mask, **kw)
    assert a.shape == b.shape == (4, 28) and not torch.equal(a, b)
    for row in a[:, 12:].tolist():  # the n-gram ban holds on every sampled row
        pairs = list(zip(row, row[1:]))
        assert len(pairs) == len(set(pairs))


class _Collect:
    """A streamer that records what it is handed."""

    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.clone())

    def end(self):
        self.ended = True


def test_streamer_gets_the_prompt_then_chunks_of_the_new_tokens():
    model = random_opt()
    ids, mask = _inputs(1)
    ref_stream = _Collect()
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, streamer=ref_stream)
    fuseinfer.patch(model)
    stream = _Collect()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, streamer=stream)
    assert torch.equal(out, ref) and stream.ended
    assert torch.equal(stream.chunks[0], ids)
    assert 2 <= len(stream.chunks) - 1 <= 4  # 40 tokens in chunks of ~16, not one put per token
    streamed = torch.cat([c.reshape(1, -1) for c in stream.chunks[1:]], 1)
    assert torch.equal(streamed, out[:, ids.shape[1]:])
    assert SESSIONS_ATTR in model.__dict__


def test_stop_strings_end_rows_like_transformers(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_path, padding_side="left")
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    plain = model.generate(**enc, max_new_tokens=40, do_sample=False)
    texts = tok.batch_decode(plain[:, enc.input_ids.shape[1]:])
    # a word row 0 produces around its 5th token and one that row 2 produces later: rows stop at different steps
    stops = [texts[0].split()[2], texts[2].split()[6]]
    kw = dict(max_new_tokens=40, do_sample=False, stop_strings=stops, tokenizer=tok)
    ref = model.generate(**enc, **kw)
    assert ref.shape[1] < plain.shape[1] or bool((ref[:, enc.input_ids.shape[1]:] == 1).any())
    fuseinfer.patch(model)
    assert torch.equal(model.generate(**enc, **kw), ref)
    assert torch.equal(model.generate(**{k: v[:1] for k, v in enc.items()}, **kw),
                       fuseinfer.generate(model, enc.input_ids[:1], enc.attention_mask[:1], eos_token_id=2,
                                          pad_token_id=1, **kw))
    with pytest.raises(ValueError, match="stop_strings needs the tokenizer"):
        fuseinfer.generate(model, enc.input_ids, max_new_tokens=3, stop_strings=stops)


@pytest.mark.parametrize("case", ["beam_search_4", "beam_search_sampling", "custom_logits_processor",
                                  "custom_stopping_criteria", "sequence_bias", "assisted_prompt_lookup"])
@pytest.mark.parametrize("batch", [1, 4], ids=["single", "left_padded_batch_of_4"])
def test_middle_path_equals_transformers(case, batch, caplog, monkeypatch):
    from transformers import LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList
    from transformers.generation.logits_process import TemperatureLogitsWarper

    if case == "assisted_prompt_lookup" and batch > 1:
        pytest.skip("transformers' assisted decoding takes batch 1 only")
    model = random_opt()
    ids, mask = _inputs(batch)
    kw = dict(max_new_tokens=12, do_sample=False)
    if case == "beam_search_4":  # (the one-graph beam path serves it: tests/runtime/test_beam.py; off here)
        kw.update(num_beams=4, num_return_sequences=2)
        monkeypatch.setattr(beam, "ENABLED", False)
    elif case == "beam_search_sampling":
        kw.update(num_beams=3, do_sample=True, top_k=1)  # top-k 1: a deterministic check of the beam bookkeeping
    elif case == "custom_logits_processor":
        kw["logits_processor"] = LogitsProcessorList([TemperatureLogitsWarper(0.5)])
    elif case == "custom_stopping_criteria":
        kw["stopping_criteria"] = StoppingCriteriaList([MaxLengthCriteria(ids.shape[1] + 7)])
    elif case == "sequence_bias":
        kw["sequence_bias"] = {(int(ids[0, -1]),): -5.0}
    else:
        kw["prompt_lookup_num_tokens"] = 3
    torch.manual_seed(0)
    ref = model.generate(ids, attention_mask=mask, **kw)
    fuseinfer.patch(model)
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="fuseinfer"):
        out = model.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(out, ref)
    assert "takes the middle path" in caplog.text and "falls back" not in caplog.text
    assert any(isinstance(k, tuple) for k in model.__dict__[SESSIONS_ATTR])
    assert "forward" not in model.__dict__  # the forward wrapper is gone after the call


def test_text_generation_pipeline_takes_the_fast_and_middle_paths(tiny_model_path, caplog):
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    calls = [dict(max_new_tokens=12, do_sample=False, repetition_penalty=1.2),
             dict(max_new_tokens=8, do_sample=False, num_beams=3)]
    refs = [pipe(PROMPTS[1], **kw)[0]["generated_text"] for kw in calls]
    fuseinfer.patch(model)
    with caplog.at_level(logging.INFO, logger="fuseinfer"):
        model.__dict__.pop(SESSIONS_ATTR, None)
        assert pipe(PROMPTS[1], **calls[0])[0]["generated_text"] == refs[0]
        assert any(isinstance(k, int) for k in model.__dict__[SESSIONS_ATTR])  # fast path
        assert pipe(PROMPTS[1], **calls[1])[0]["generated_text"] == refs[1]
        assert (beam.KEY, 3) in model.__dict__[SESSIONS_ATTR]  # the one-graph beam path: 3 beams
    assert "falls back" not in caplog.text


def test_output_attentions_is_handed_to_transformers():
    model = random_opt()
    ids, mask = _inputs(1)
    kw = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_attentions=True,
              num_beams=2)
    ref = model.generate(ids, attention_mask=mask, **kw)
    fuseinfer.patch(model)
    out = model.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(out.sequences, ref.sequences) and len(out.attentions) == len(ref.attentions)
    assert SESSIONS_ATTR not in model.__dict__
