"""The fast path's tensor logits processors (fuseinfer/runtime/processors.py) against transformers' own, on random
logits and token histories with left padding, one step at a time as generate applies them."""
from __future__ import annotations

import pytest
import torch

from fuseinfer.runtime.args import Sampling
from fuseinfer.runtime.processors import Processors, Rule, bad_words, repetition_penalty_skips_padding

V, P = 40, 7


def _hf_processors(rule: Rule, prompt_len: int, mask):
    from transformers.generation import logits_process as lp

    procs = []
    if rule.repetition_penalty:
        if rule.penalty_skips_padding:
            procs.append(lp.RepetitionPenaltyLogitsProcessor(rule.repetition_penalty,
                                                             prompt_ignore_length=(mask != 0).int().argmax(1)))
        else:
            procs.append(lp.RepetitionPenaltyLogitsProcessor(rule.repetition_penalty))
    if rule.no_repeat_ngram_size:
        procs.append(lp.NoRepeatNGramLogitsProcessor(rule.no_repeat_ngram_size))
    if rule.bad_single or rule.bad_multi:
        procs.append(lp.NoBadWordsLogitsProcessor([list(s) for s in ((t,) for t in rule.bad_single)]
                                                  + [list(s) for s in rule.bad_multi], list(rule.eos)))
    if rule.min_length:
        procs.append(lp.MinLengthLogitsProcessor(rule.min_length, list(rule.eos)))
    if rule.min_new_tokens:
        procs.append(lp.MinNewTokensLengthLogitsProcessor(prompt_len, rule.min_new_tokens, list(rule.eos)))
    if rule.suppress:
        procs.append(lp.SuppressTokensLogitsProcessor(list(rule.suppress)))
    if rule.begin_suppress:
        procs.append(lp.SuppressTokensAtBeginLogitsProcessor(list(rule.begin_suppress), prompt_len))
    return procs


RULES = {
    "repetition_penalty": Rule(repetition_penalty=1.7),
    "repetition_penalty_below_1_skips_padding": Rule(repetition_penalty=0.6, penalty_skips_padding=True),
    "ngram_1": Rule(no_repeat_ngram_size=1),
    "ngram_2": Rule(no_repeat_ngram_size=2),
    "ngram_3": Rule(no_repeat_ngram_size=3),
    "bad_words": Rule(bad_single=(5,), bad_multi=((3, 4), (1, 2, 3), (9, 9))),
    "min_length_and_new": Rule(min_length=P + 3, min_new_tokens=5, eos=(2, 6)),
    "suppress_and_begin": Rule(suppress=(7, 8), begin_suppress=(3,)),
    "all": Rule(repetition_penalty=1.3, no_repeat_ngram_size=2, bad_single=(5,), bad_multi=((3, 4),),
                min_new_tokens=4, eos=(2,), suppress=(8,), begin_suppress=(4,)),
}


@pytest.mark.parametrize("name", list(RULES))
def test_processors_match_transformers_step_by_step(name):
    rule = RULES[name]
    g = torch.Generator().manual_seed(0)
    b, steps = 4, 9
    ids = torch.randint(0, 10, (b, P), generator=g)  # few distinct ids: n-grams and bad words recur
    mask = torch.ones(b, P, dtype=torch.long)
    mask[1, :2] = 0
    mask[3, :4] = 0
    ids = ids.masked_fill(mask == 0, 1)  # pad id 1, left padding
    procs = Processors(rule, b, P + steps + 3, V, "cpu")
    procs.begin(ids, mask, b)
    hf = _hf_processors(rule, P, mask)
    seq = ids
    step = torch.zeros(1, dtype=torch.long)
    for t in range(steps):
        logits = torch.randn(b, V, generator=g) * 3
        ref = logits.clone()
        for proc in hf:
            ref = proc(seq, ref)
        ours = procs(logits, step)
        torch.testing.assert_close(ours, ref, rtol=0, atol=0, msg=f"step {t}")
        nxt = torch.randint(0, 10, (b, 1), generator=g)
        procs.record(nxt, torch.tensor([P + t]))  # the token joins the history at its slot
        seq = torch.cat([seq, nxt], 1)
        step += 1


def test_bad_words_follow_transformers_validation_and_eos_rule():
    assert bad_words([[2], [5], [3, 4]], (2,)) == ((5,), ((3, 4),))  # a bad word that is just EOS is dropped
    with pytest.raises(ValueError):
        bad_words([[-1]], ())


def test_penalty_padding_rule_follows_the_installed_transformers():
    import inspect

    from transformers.generation.utils import GenerationMixin

    src = inspect.getsource(GenerationMixin._get_logits_processor)
    assert repetition_penalty_skips_padding() == ("prompt_ignore_length=padding_lengths" in src)


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [(0.7, None, None, 0.1), (1.3, 5, None, 0.05),
                                                           (1.0, None, 0.8, 0.2), (0.5, 40, 0.9, 0.01)])
def test_min_p_sampling_distribution_matches_transformers_warpers(temperature, top_k, top_p, min_p):
    """softmax of Sampling.warp, the probability each token is drawn with, is transformers' warped softmax."""
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(3)) * 3
    ours = Sampling(True, temperature, top_k, top_p, min_p).warp(logits).softmax(-1)
    warped = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        warped = TopKLogitsWarper(top_k)(None, warped)
    if top_p is not None:
        warped = TopPLogitsWarper(top_p)(None, warped)
    warped = MinPLogitsWarper(min_p)(None, warped)
    torch.testing.assert_close(ours, warped.softmax(-1), rtol=1e-5, atol=1e-7)
