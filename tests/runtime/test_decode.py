"""Fast decode (static KV cache; CUDA graphs on GPU) against transformers' generate."""
from __future__ import annotations

import copy
import gc
import logging
import weakref

import pytest
import torch
from conftest import VARIANTS, random_opt

import fuseinfer
from fuseinfer import FuseInferError, PatchConfig
from fuseinfer.runtime import hf_generate
from fuseinfer.runtime.decode import SESSIONS_ATTR, STOP_CHECK_EVERY

PROMPTS = ["The tower is", "In 1990 , the band released their second album", "He was",
           "= Valkyria Chronicles III ="]


@pytest.fixture(autouse=True)
def _fresh_fallback_log(monkeypatch):
    """Each test sees every fallback reason logged (they are logged once per process)."""
    monkeypatch.setattr(hf_generate, "_logged", set())


def _load(path, device="cpu"):
    """The tiny model on ``device`` (fp32 on CPU, fp16 on CUDA) and its left-padding tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    return model, tok


def _greedy_matches_hf(model, tok, prompts, device="cpu"):
    enc = tok(prompts, return_tensors="pt", padding=True).to(device)
    kwargs = dict(max_new_tokens=64, do_sample=False)
    ref = model.generate(**enc, **kwargs)
    fuseinfer.patch(model)
    ours = fuseinfer.generate(model, enc.input_ids, enc.attention_mask, eos_token_id=2, pad_token_id=1, **kwargs)
    model.__dict__.pop(SESSIONS_ATTR)
    hooked = model.generate(**enc, **kwargs)
    assert SESSIONS_ATTR in model.__dict__  # model.generate took the static-cache path
    assert torch.equal(ours, ref)
    assert torch.equal(hooked, ref)
    return model


@pytest.mark.parametrize("prompts", [PROMPTS[1:2], PROMPTS], ids=["single", "left_padded_batch_of_4"])
def test_greedy_64_tokens_identical_to_hf_cpu(tiny_model_path, prompts):
    model, tok = _load(tiny_model_path)
    _greedy_matches_hf(model, tok, prompts)
    assert SESSIONS_ATTR in model.__dict__  # the static-cache path ran


@pytest.mark.parametrize("variant", ["post_ln_project_in_out", "no_bias"])
def test_greedy_identical_to_hf_other_layouts(variant):
    model = random_opt(**VARIANTS[variant])
    ids = torch.randint(3, 512, (2, 17))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    kwargs = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=1)
    ref = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    fuseinfer.patch(model)
    assert torch.equal(fuseinfer.generate(model, ids, mask, **kwargs), ref)


def test_release_through_a_compile_wrapper():
    """release() frees the sessions of the model a torch.compile wrapper holds, as patch and generate reach it."""
    model = random_opt()
    wrapper = torch.compile(model)
    fuseinfer.patch(wrapper)
    fuseinfer.generate(wrapper, torch.randint(3, 512, (1, 5)), max_new_tokens=3)
    assert SESSIONS_ATTR in model.__dict__
    fuseinfer.runtime.release(wrapper)
    assert SESSIONS_ATTR not in model.__dict__


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("rows", ["some_rows_finish", "every_row_finishes"])
def test_eos_stops_like_hf(tiny_model_path, device, rows):
    """EOS is row 0's 4th free token. Rows that finish are padded; once every row has (the one row of the second
    case), the stop check ends the run and the output ends where HF's does. On CUDA the run replays 16-step graphs,
    then one-step ones."""
    model, tok = _load(tiny_model_path, device)
    prompts, max_new = (PROMPTS, 40) if rows == "some_rows_finish" else (PROMPTS[1:2], 60)
    enc = tok(prompts, return_tensors="pt", padding=True).to(device)
    eos = int(model.generate(**enc, max_new_tokens=4, do_sample=False)[0, -1])
    kwargs = dict(max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=1)
    ref = model.generate(**enc, **kwargs)
    fuseinfer.patch(model)
    ours = fuseinfer.generate(model, enc.input_ids, enc.attention_mask, **kwargs)
    assert torch.equal(ours, ref)
    new = ours[:, enc.input_ids.shape[1]:]
    if rows == "some_rows_finish":
        padded = (new == 1).any(1)  # rows that finished early and were padded
        assert padded.any() and not padded.all()
    else:
        assert new.shape[1] <= 4  # the output ends at the first EOS
        session = next(iter(model.__dict__[SESSIONS_ATTR].values()))
        assert int(session.step) <= STOP_CHECK_EVERY + 1  # and the run stopped at its first check, not after 60


def test_sampling_respects_top_k_and_reuses_session(tiny_model_path):
    model, tok = _load(tiny_model_path)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    greedy = model.generate(**enc, max_new_tokens=20, do_sample=False)
    fuseinfer.patch(model)
    top1 = fuseinfer.generate(model, enc.input_ids, enc.attention_mask, max_new_tokens=20, do_sample=True,
                              top_k=1, temperature=0.7, eos_token_id=2, pad_token_id=1)
    assert torch.equal(top1, greedy)  # top-k 1 leaves only the argmax
    torch.manual_seed(0)
    a = model.generate(**enc, max_new_tokens=20, do_sample=True, top_p=0.9, temperature=1.3)
    session = model.__dict__[SESSIONS_ATTR][4]
    b = model.generate(**enc, max_new_tokens=20, do_sample=True, top_p=0.9, temperature=1.3)
    assert model.__dict__[SESSIONS_ATTR][4] is session  # second call reused cache (and graph)
    assert a.shape == b.shape == (4, enc.input_ids.shape[1] + 20) and not torch.equal(a, b)
    assert ((a >= 0) & (a < model.config.vocab_size)).all()
    model.generate(**enc, max_new_tokens=23, do_sample=True, top_p=0.9, temperature=1.3)  # a few more tokens
    assert model.__dict__[SESSIONS_ATTR][4] is session
    assert torch.equal(model.generate(**enc, max_new_tokens=20, do_sample=False), greedy)  # another token rule:
    assert model.__dict__[SESSIONS_ATTR][4].cache is session.cache  # new graphs, the same cache


def test_one_session_across_calls_with_other_eos_pad_and_lengths(tiny_model_path):
    """Calls in a row on one model, each against HF: another EOS id, another pad id, a longer prompt, more new
    tokens (a session is reused only where it fits, and its cache only where it is large enough)."""
    model, tok = _load(tiny_model_path)
    enc = tok(PROMPTS[:2], return_tensors="pt", padding=True)
    long_ids = torch.randint(3, 8000, (2, 200), generator=torch.Generator().manual_seed(0))
    first = model.generate(**enc, max_new_tokens=5, do_sample=False)[0, enc.input_ids.shape[1]:]
    a, b = int(first[2]), int(first[4])  # row 0 stops there, row 1 runs on: its padding shows the pad id
    calls = [(enc.input_ids, enc.attention_mask, dict(max_new_tokens=12, eos_token_id=a, pad_token_id=1)),
             (enc.input_ids, enc.attention_mask, dict(max_new_tokens=12, eos_token_id=b, pad_token_id=1)),  # EOS
             (enc.input_ids, enc.attention_mask, dict(max_new_tokens=12, eos_token_id=b, pad_token_id=0)),  # pad
             (long_ids, torch.ones_like(long_ids), dict(max_new_tokens=12, eos_token_id=b, pad_token_id=0)),  # room
             (enc.input_ids, enc.attention_mask, dict(max_new_tokens=130, eos_token_id=b, pad_token_id=0))]  # length
    refs = [model.generate(ids, attention_mask=mask, do_sample=False, **kw) for ids, mask, kw in calls]
    fuseinfer.patch(model)
    for (ids, mask, kw), ref in zip(calls, refs):
        assert torch.equal(fuseinfer.generate(model, ids, mask, **kw), ref), kw


def test_unsupported_setting_in_the_generation_config_falls_back(tiny_model_path, caplog):
    model, tok = _load(tiny_model_path)
    enc = tok(PROMPTS[:2], return_tensors="pt", padding=True)
    model.generation_config.update(return_dict_in_generate=True, output_hidden_states=True)
    ref = model.generate(**enc, max_new_tokens=8, do_sample=False)
    fuseinfer.patch(model)
    with caplog.at_level(logging.WARNING, logger="fuseinfer"):
        out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    assert torch.equal(out.sequences, ref.sequences) and len(out.hidden_states) == len(ref.hidden_states)
    assert "falls back to transformers" in caplog.text and "output_hidden_states" in caplog.text


def test_sampling_settings_are_validated(tiny_model_path):
    model, tok = _load(tiny_model_path)
    fuseinfer.patch(model)
    ids = tok(PROMPTS[:1], return_tensors="pt").input_ids
    for bad in (dict(temperature=float("nan")), dict(temperature=0.0), dict(top_p=float("nan")),
                dict(top_p=1.5), dict(top_k=-1)):
        with pytest.raises(FuseInferError):
            fuseinfer.generate(model, ids, max_new_tokens=3, do_sample=True, **bad)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, None, None), (1.3, 5, None), (1.0, None, 0.8),
                                                     (0.5, 40, 0.9), (2.0, 3, 0.5)])
def test_sampling_distribution_matches_transformers_warpers(temperature, top_k, top_p):
    """The probability each token is drawn with, softmax of Sampling.warp, is softmax of the logits after
    transformers' temperature, top-k and top-p warpers, in that order; the CPU path draws from it with
    torch.multinomial (a one at the drawn token of each of the call's rows, zeros in the others), the CUDA path by
    an exponential race over it."""
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    from fuseinfer.runtime.decode import Sampling

    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(3)) * 3  # (B, V)
    sampling = Sampling(True, temperature, top_k, top_p)
    probs = sampling.warp(logits).softmax(-1)
    torch.manual_seed(0)
    chosen = sampling.choose(sampling.warp(logits), rows=3)
    torch.manual_seed(0)
    assert torch.equal(chosen[:3].argmax(-1), torch.multinomial(probs[:3], 1)[:, 0])
    assert chosen.sum().item() == 3 and not chosen[3].any()
    ours = probs
    warped = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        warped = TopKLogitsWarper(top_k)(None, warped)
    if top_p is not None:
        warped = TopPLogitsWarper(top_p)(None, warped)
    torch.testing.assert_close(ours, warped.softmax(-1), rtol=1e-5, atol=1e-7)


def test_beam_search_takes_the_beam_path_and_the_middle_path_with_logged_reason(tiny_model_path, caplog):
    model, tok = _load(tiny_model_path)
    enc = tok(PROMPTS[:2], return_tensors="pt", padding=True)
    ref = model.generate(**enc, max_new_tokens=8, num_beams=2)
    fuseinfer.patch(model)
    with caplog.at_level(logging.INFO, logger="fuseinfer"):
        out = model.generate(**enc, max_new_tokens=8, num_beams=2)
    assert torch.equal(out, ref)
    assert "middle path" not in caplog.text and "falls back" not in caplog.text
    assert set(model.__dict__[SESSIONS_ATTR]) == {("beam", 4)}  # 2 prompts x 2 beams, no fast-path session
    with caplog.at_level(logging.INFO, logger="fuseinfer"):
        out = model.generate(**enc, max_new_tokens=8, num_beams=2, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert "takes the middle path (transformers' loop, fused static-cache forward): unsupported generate() " \
           "arguments ['num_beams']; return_dict_in_generate" in caplog.text
    assert ("hf", 4) in model.__dict__[SESSIONS_ATTR]


@pytest.mark.parametrize("case", ["partial_patch", "patched_in_training_mode", "use_cache_false"])
def test_generate_hook_falls_back_when_fast_path_does_not_apply(tiny_model_path, case, caplog):
    model, tok = _load(tiny_model_path)
    enc = tok(PROMPTS[:2], return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=8, do_sample=False)
    ref = model.generate(**enc, **kwargs)
    if case == "partial_patch":
        fuseinfer.patch(model, PatchConfig(ops=("linear",)))
        reason = "patched with every op"
    elif case == "patched_in_training_mode":
        fuseinfer.patch(model.train())
        model.eval()
        reason = "skips in training mode"
    else:
        fuseinfer.patch(model)
        kwargs["use_cache"] = False
        reason = "use_cache=False"
    with caplog.at_level(logging.WARNING, logger="fuseinfer"):
        out = model.generate(**enc, **kwargs)
    assert torch.equal(out, ref)
    assert reason in caplog.text
    assert SESSIONS_ATTR not in model.__dict__


def test_generate_errors_and_unpatch_releases(tiny_model_path):
    model, tok = _load(tiny_model_path)
    ids = tok(PROMPTS[:1], return_tensors="pt").input_ids
    with pytest.raises(FuseInferError, match="call fuseinfer.patch"):
        fuseinfer.generate(model, ids)
    fuseinfer.patch(model, PatchConfig(ops=("attention",)))
    with pytest.raises(FuseInferError, match="patched with every op"):
        fuseinfer.generate(model, ids)
    fuseinfer.unpatch(model)
    fuseinfer.patch(model)
    with pytest.raises(FuseInferError, match="left padding"):
        fuseinfer.generate(model, torch.ones(2, 4, dtype=torch.long), torch.tensor([[1, 1, 1, 0], [1] * 4]))
    with pytest.raises(FuseInferError, match="exceeds the model's max_position_embeddings"):
        fuseinfer.generate(model, ids, max_new_tokens=5000)
    with pytest.raises(FuseInferError, match="temperature must be > 0"):
        fuseinfer.generate(model, ids, do_sample=True, temperature=0.0)
    with pytest.raises(FuseInferError, match=r"input_ids must be \(batch, length\)"):
        fuseinfer.generate(model, ids[0])
    with pytest.raises(FuseInferError, match="attention_mask shape"):
        fuseinfer.generate(model, ids, torch.ones(1, ids.shape[1] + 1, dtype=torch.long))
    assert torch.equal(fuseinfer.generate(model, ids, max_new_tokens=0), ids)  # nothing to generate
    fuseinfer.generate(model, ids, max_new_tokens=3)
    assert SESSIONS_ATTR in model.__dict__
    fuseinfer.unpatch(model)
    assert SESSIONS_ATTR not in model.__dict__ and "generate" not in model.__dict__


@pytest.mark.parametrize("bad, match", [
    (dict(max_new_tokens=-3), "max_new_tokens must be a non-negative int"),
    (dict(max_new_tokens=5.0), "max_new_tokens must be a non-negative int"),
    (dict(max_new_tokens=True), "max_new_tokens must be a non-negative int"),
    (dict(input_ids=torch.ones(1, 0, dtype=torch.long)), "at least one row of at least one token"),
    (dict(input_ids=torch.ones(0, 4, dtype=torch.long)), "at least one row of at least one token"),
    (dict(pad_token_id=-1), "pad_token_id -1 is not a token"),
])
def test_generate_bad_arguments_are_one_clear_error(tiny_model_path, bad, match):
    model, tok = _load(tiny_model_path)
    fuseinfer.patch(model)
    kwargs = {"input_ids": tok(PROMPTS[:1], return_tensors="pt").input_ids, "max_new_tokens": 3, **bad}
    with pytest.raises(FuseInferError, match=match):
        fuseinfer.generate(model, kwargs.pop("input_ids"), **kwargs)


@pytest.mark.parametrize("case", ["eos_0d_tensor", "eos_numpy_int", "max_new_tokens_float", "pad_outside_vocab",
                                  "no_pad_and_eos_outside_vocab", "inputs_and_input_ids"])
def test_generate_hook_odd_arguments_behave_like_transformers(tiny_model_path, case, caplog):
    """Arguments transformers accepts give its tokens (on the fast path or through the fallback); a call it
    refuses is refused the same way."""
    import numpy as np

    model, tok = _load(tiny_model_path)
    enc = tok(PROMPTS[:3], return_tensors="pt", padding=True)  # batch 3: the bucket of 4 has an unused row
    args, kwargs = (enc.input_ids,), dict(attention_mask=enc.attention_mask, max_new_tokens=6)
    fast = case.startswith("eos")
    if case == "eos_0d_tensor":
        kwargs["eos_token_id"] = torch.tensor(2)
    elif case == "eos_numpy_int":
        kwargs["eos_token_id"] = np.int64(2)
    elif case == "max_new_tokens_float":
        kwargs["max_new_tokens"] = 6.0
    elif case == "pad_outside_vocab":
        kwargs.update(pad_token_id=-1, eos_token_id=None)
    elif case == "no_pad_and_eos_outside_vocab":  # the pad then is the first EOS id, as in transformers
        model.generation_config.pad_token_id = None
        kwargs["eos_token_id"] = [model.config.vocab_size + 5, 2]
    else:
        kwargs["input_ids"] = enc.input_ids
    try:
        ref = model.generate(*args, **kwargs)
    except ValueError as exc:
        ref = exc
    fuseinfer.patch(model)
    with caplog.at_level(logging.WARNING, logger="fuseinfer"):
        if isinstance(ref, Exception):
            with pytest.raises(type(ref)):
                model.generate(*args, **kwargs)
        else:
            assert torch.equal(model.generate(*args, **kwargs), ref)
    assert (SESSIONS_ATTR in model.__dict__) == fast
    assert fast or "falls back to transformers" in caplog.text


def test_generate_hook_hands_right_padding_and_max_length_to_the_right_path(tiny_model_path, caplog):
    """model.generate on a patched model: right padding goes to transformers (logged), and max_length (no
    max_new_tokens) takes the fast path with max_length - prompt new tokens, like transformers."""
    model, tok = _load(tiny_model_path)
    tok.padding_side = "right"
    enc = tok(PROMPTS[:2], return_tensors="pt", padding=True)
    ref_right = model.generate(**enc, max_new_tokens=6, do_sample=False)
    ids = tok(PROMPTS[1:2], return_tensors="pt").input_ids
    ref_len = model.generate(ids, max_length=ids.shape[1] + 7, do_sample=False)
    fuseinfer.patch(model)
    with caplog.at_level(logging.WARNING, logger="fuseinfer"):
        assert torch.equal(model.generate(**enc, max_new_tokens=6, do_sample=False), ref_right)
    assert "right padding" in caplog.text and SESSIONS_ATTR not in model.__dict__
    assert torch.equal(model.generate(ids, max_length=ids.shape[1] + 7, do_sample=False), ref_len)
    assert SESSIONS_ATTR in model.__dict__  # (the fast path ran)


@pytest.mark.parametrize("case", ["no_length_set", "padded_batch_without_mask", "pad_is_eos_without_mask",
                                  "config_object_without_eos", "config_object_without_length"])
def test_generate_hook_resolves_settings_like_transformers(tiny_model_path, case):
    """model.generate on a patched model takes the fast path with the settings transformers would use: 20 new
    tokens when no length is set anywhere, the mask inferred from pad tokens when none is passed, and a passed
    GenerationConfig's unset fields filled from the model's generation_config (EOS, pad, max_new_tokens)."""
    from transformers import GenerationConfig

    model, tok = _load(tiny_model_path)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    ids = enc.input_ids
    args, kwargs = (ids,), {"attention_mask": enc.attention_mask}
    if case == "padded_batch_without_mask":
        kwargs = {"max_new_tokens": 20}  # the prompts hold pad tokens (1), which is not the EOS (2)
    elif case == "pad_is_eos_without_mask":  # the prompt starts with BOS = EOS = 2: no mask is inferred from it
        two = [tok(p, return_tensors="pt").input_ids for p in PROMPTS[1:3]]  # each starts with BOS = EOS = 2
        args, kwargs = (torch.cat(two, 1),), {"max_new_tokens": 8, "pad_token_id": 2}
        assert int((args[0] == 2).sum()) == 2 and model.generation_config.eos_token_id == 2
    elif case == "config_object_without_eos":
        # a common continuation of the first prompt as the model's EOS: rows stop and are padded with the model's
        # pad token, which the passed config does not set
        eos = int(model.generate(ids[:1], attention_mask=enc.attention_mask[:1], max_new_tokens=3)[0, -2])
        model.generation_config.eos_token_id = eos
        kwargs["generation_config"] = GenerationConfig(max_new_tokens=6)
    elif case == "config_object_without_length":
        model.generation_config.max_new_tokens = 12
        kwargs["generation_config"] = GenerationConfig(do_sample=False)
    ref = model.generate(*args, **kwargs)
    fuseinfer.patch(model)
    ours = model.generate(*args, **kwargs)
    assert SESSIONS_ATTR in model.__dict__  # the fast path ran
    assert ours.shape == ref.shape and torch.equal(ours, ref)
    if case == "no_length_set":
        assert ref.shape[1] == ids.shape[1] + 20
    if case == "config_object_without_eos":
        assert bool((ref[:, ids.shape[1]:] == 1).any())  # some row finished and was padded


def test_generation_settings_on_model_config_are_refused_like_transformers(tiny_model_path):
    model, tok = _load(tiny_model_path)
    ids = tok(PROMPTS[:1], return_tensors="pt").input_ids
    fuseinfer.patch(model)
    model.config.repetition_penalty = 1.3  # legacy: transformers raises instead of ignoring it
    with pytest.raises(ValueError, match="model.generation_config"):
        model.generate(ids, max_new_tokens=3)


def test_generate_fallback_with_a_static_cache(tiny_model_path):
    """A call the fast path does not take (here cache_implementation='static') runs transformers' generate with
    the attention implementation the model had before patching (its static-cache masks must be tensors)."""
    model, tok = _load(tiny_model_path)
    enc = tok(PROMPTS[:2], return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=5, do_sample=False, cache_implementation="static")
    ref = model.generate(**enc, **kwargs)
    fuseinfer.patch(model)
    assert torch.equal(model.generate(**enc, **kwargs), ref)
    assert model.config._attn_implementation == "fuseinfer"  # restored after the call


@pytest.mark.parametrize("bad, match", [({"top_k": -1}, "top_k must be a non-negative integer"),
                                        ({"top_p": -0.5}, r"top_p must be in \[0, 1\]")])
def test_bad_sampling_settings_are_one_clear_error(tiny_model_path, bad, match):
    model, tok = _load(tiny_model_path)
    ids = tok(PROMPTS[:1], return_tensors="pt").input_ids
    fuseinfer.patch(model)
    with pytest.raises(FuseInferError, match=match):
        fuseinfer.generate(model, ids, max_new_tokens=3, do_sample=True, **bad)
    with pytest.raises(ValueError, match=match):  # FuseInferError is a ValueError, as transformers raises
        model.generate(ids, max_new_tokens=3, do_sample=True, **bad)


@pytest.mark.gpu
@pytest.mark.parametrize("prompts", [PROMPTS[1:2], PROMPTS], ids=["single", "left_padded_batch_of_4"])
def test_greedy_64_tokens_identical_to_hf_fp16_cuda_graphs(tiny_model_path, prompts):
    model, tok = _load(tiny_model_path, "cuda")
    model = _greedy_matches_hf(model, tok, prompts, "cuda")
    sessions = model.__dict__[SESSIONS_ATTR]
    assert all(set(s.graphs) == {1, fuseinfer.RuntimeConfig().graph_steps} for s in sessions.values())  # 63 steps: 3 groups + 15 single


@pytest.mark.gpu
@pytest.mark.parametrize("max_new, group", [(1, 1), (6, 5), (40, 39)])  # group: the decode steps, max_new - 1
def test_graphs_fit_the_steps_a_call_takes(tiny_model_path, max_new, group):
    """A session captures a group graph no longer than its max_new_tokens - 1 decode steps (none when that is 1),
    and the run replays it: the tokens are the first ones of a longer run's."""
    model, tok = _load(tiny_model_path, "cuda")
    enc = tok(PROMPTS, return_tensors="pt", padding=True).to("cuda")
    fuseinfer.patch(model)
    long = fuseinfer.generate(model, enc.input_ids, enc.attention_mask, max_new_tokens=48)
    fuseinfer.runtime.release(model)
    short = fuseinfer.generate(model, enc.input_ids, enc.attention_mask, max_new_tokens=max_new)
    (session,) = model.__dict__[SESSIONS_ATTR].values()
    # (a call that decodes nothing, max_new_tokens=1, captures no decode graph: runtime/decode.py)
    assert set(session.graphs) == (set() if max_new == 1 else {1, min(fuseinfer.RuntimeConfig().graph_steps, group)})
    assert torch.equal(short, long[:, :short.shape[1]])


@pytest.mark.gpu
def test_100_calls_do_not_grow_memory(tiny_model_path):
    model, tok = _load(tiny_model_path, "cuda")
    enc = tok(PROMPTS, return_tensors="pt", padding=True).to("cuda")
    fuseinfer.patch(model)
    fuseinfer.generate(model, enc.input_ids, enc.attention_mask, max_new_tokens=1)  # a graph for 1 token
    fuseinfer.generate(model, enc.input_ids, enc.attention_mask, max_new_tokens=32)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(100):
        fuseinfer.generate(model, enc.input_ids, enc.attention_mask, max_new_tokens=32)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    fuseinfer.unpatch(model)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() < before  # cache and graph pool released


def test_session_is_rebuilt_after_the_model_moves():
    """A session's graphs and step read the weights where they were: after model.to(...) the next call makes a
    new session, and its tokens are a freshly converted model's."""
    model = random_opt()
    fuseinfer.patch(model)
    ids = torch.randint(3, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    fuseinfer.generate(model, ids[:1], max_new_tokens=5)  # a second bucket, which the move must drop too
    fuseinfer.generate(model, ids, max_new_tokens=5)
    session = model.__dict__[SESSIONS_ATTR][2]
    model.to(torch.bfloat16)
    out = fuseinfer.generate(model, ids, max_new_tokens=5)
    assert set(model.__dict__[SESSIONS_ATTR]) == {2} and model.__dict__[SESSIONS_ATTR][2] is not session
    fresh = random_opt().to(torch.bfloat16)
    fuseinfer.patch(fresh)
    assert torch.equal(out, fuseinfer.generate(fresh, ids, max_new_tokens=5))


def test_fallback_reasons_are_logged_once_per_kind(caplog, monkeypatch):
    model = random_opt()
    fuseinfer.patch(model)
    monkeypatch.setattr(type(model), "generate", lambda self, inputs=None, **kwargs: inputs)  # transformers' part
    ids = torch.randint(3, model.config.vocab_size, (1, 9))
    limit = model.config.max_position_embeddings
    with caplog.at_level(logging.WARNING, logger="fuseinfer"):
        for extra in (1, 2, 3):  # the same reason with other numbers
            assert model.generate(ids, max_length=limit + extra, do_sample=False) is ids
    assert caplog.text.count("exceeds the model's max_position_embeddings") == 1


@pytest.mark.parametrize("value", ["0", "-3", "four"])
def test_bad_graph_steps_setting_is_one_clear_error(value, monkeypatch):
    monkeypatch.setenv("FUSEINFER_DECODE_GRAPH_STEPS", value)
    with pytest.raises(FuseInferError, match="FUSEINFER_DECODE_GRAPH_STEPS must be an integer >= 1"):
        fuseinfer.RuntimeConfig()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_patched_model_is_freed_by_del(tiny_model_path, device):
    """No reference cycle through the generate hook or the decode sessions: ``del model`` frees the model with its
    caches and graphs at once, without waiting for the garbage collector."""
    model, tok = _load(tiny_model_path, device)
    ids = tok(PROMPTS[:2], return_tensors="pt", padding=True).to(device)
    fuseinfer.patch(model)
    model.generate(**ids, max_new_tokens=20)  # the hook, and a session (with graphs on CUDA)
    assert SESSIONS_ATTR in model.__dict__
    alive = weakref.ref(model)
    before = torch.cuda.memory_allocated() if device == "cuda" else 0
    gc.collect()
    gc.disable()
    try:
        del model
        assert alive() is None
        if device == "cuda":
            assert torch.cuda.memory_allocated() < before
    finally:
        gc.enable()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_deep_copy_of_patched_model_generates_with_its_own_weights(tiny_model_path, device):
    model, tok = _load(tiny_model_path, device)
    enc = tok(PROMPTS[:2], return_tensors="pt", padding=True).to(device)
    fuseinfer.patch(model)
    model.generate(**enc, max_new_tokens=5)  # a session on the original
    clone = copy.deepcopy(model)
    assert not clone.__dict__[SESSIONS_ATTR] or all(s is None for s in clone.__dict__[SESSIONS_ATTR].values())
    with torch.no_grad():
        clone.lm_head.weight.zero_()  # (tied to the embeddings: changes the copy's whole model)
    ours = clone.generate(**enc, max_new_tokens=5)
    assert torch.equal(ours, fuseinfer.generate(clone, enc.input_ids, enc.attention_mask, max_new_tokens=5))
    assert not torch.equal(ours, model.generate(**enc, max_new_tokens=5))  # the hook drives the copy


@pytest.mark.parametrize("quant", [None, "w8a16"])
def test_opt_decode_writes_the_cache_from_the_qkv_projection(tiny_model_path, monkeypatch, quant):
    """Over the static cache, OPT's q/k/v projection is linear_rope_append without rotation (on CUDA one GEMV whose
    epilogue writes k and v into the cache) for fp16 and int8 weight-only models; the greedy tokens equal those of
    the projection then the cache's update (the path before), and transformers' for the unquantized model."""
    from fuseinfer.models.opt import modules

    model, tok = _load(tiny_model_path)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=8, do_sample=False)
    ref = model.generate(**enc, **kwargs)
    calls = []
    real = modules.linear_rope_append

    def counted(*args):
        calls.append((args[4], args[5], args[2] is not None))  # (cos, sin, int8 scales)
        return real(*args)

    monkeypatch.setattr(modules, "linear_rope_append", counted)
    fuseinfer.patch(model, PatchConfig(quant=fuseinfer.Int8WeightOnly()) if quant else PatchConfig())

    def generate():
        model.__dict__.pop(SESSIONS_ATTR, None)
        return fuseinfer.generate(model, enc.input_ids, enc.attention_mask, eos_token_id=2, pad_token_id=1, **kwargs)

    ours = generate()
    layers = model.config.num_hidden_layers
    assert len(calls) >= layers * (kwargs["max_new_tokens"] - 1)  # every layer of every decode step
    assert all(cos is None and sin is None and int8 == (quant is not None) for cos, sin, int8 in calls)
    monkeypatch.setattr(modules, "_append_operands", lambda attn, x, cache: None)  # the projection, then update
    assert torch.equal(ours, generate())
    if quant is None:
        assert torch.equal(ours, ref)
