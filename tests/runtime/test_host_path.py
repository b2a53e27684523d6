"""The host work before a patched ``model.generate``'s prefill: the resolved fast-path call kept per argument set
(hf_generate ``_Plan``), the prompt without a mask made on the device, the first token read without a stop-flag
sync. Whatever changes between calls (an argument, a config field, the prompt's shape or contents, the model's dtype,
patch state or RuntimeConfig), the tokens equal the unpatched model's and a kept resolution is used only when it
still holds."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import random_opt
from helpers import given, settings, st
from transformers import GenerationConfig

import fuseinfer
from fuseinfer.core.errors import FuseInferError
from fuseinfer.runtime import decode, hf_generate
from fuseinfer.runtime.decode import SESSIONS_ATTR

VOCAB = 512


@pytest.fixture(autouse=True)
def _fresh_log(monkeypatch):
    monkeypatch.setattr(hf_generate, "_logged", set())


@pytest.fixture
def resolutions(monkeypatch):
    """Counts the calls that resolve their arguments anew (prepare_call from model.generate)."""
    count = []
    real = hf_generate.prepare_call
    monkeypatch.setattr(hf_generate, "prepare_call", lambda *a, **k: count.append(1) or real(*a, **k))
    return count


def _pair():
    """(patched model, unpatched twin with the same weights)."""
    ref = random_opt()
    model = copy.deepcopy(ref)
    fuseinfer.patch(model)
    return model, ref


def _ids(batch: int = 1, length: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 60, (batch, length), generator=torch.Generator().manual_seed(seed))


def _plans(model) -> dict:
    return model.__dict__[SESSIONS_ATTR].plans


def test_a_repeated_call_is_resolved_once_and_equals_transformers(resolutions):
    model, ref = _pair()
    ids = _ids()
    want = ref.generate(ids, max_new_tokens=5, do_sample=False)
    for _ in range(3):
        assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False), want)
    assert len(resolutions) == 1 and len(_plans(model)) == 1


def _gen_field(model, ref, kw):
    for m in (model, ref):
        m.generation_config.repetition_penalty = 3.0


def _gen_field_in_place(model, ref, kw):
    for m in (model, ref):
        m.generation_config.suppress_tokens = [5]
    for m in (model, ref):  # the same list object, changed in place
        m.generation_config.suppress_tokens.append(int(ref.generate(_ids(), max_new_tokens=1)[0, -1]))


def _new_generation_config(model, ref, kw):
    for m in (model, ref):
        m.generation_config = GenerationConfig(**{**m.generation_config.to_diff_dict(), "no_repeat_ngram_size": 2})


def _processor(model, ref, kw):
    kw["no_repeat_ngram_size"] = 2


def _eos(model, ref, kw):
    kw["eos_token_id"] = int(ref.generate(_ids(), max_new_tokens=3, do_sample=False)[0, -2])


def _pad(model, ref, kw):
    kw["pad_token_id"] = 7


def _max_new(model, ref, kw):
    kw["max_new_tokens"] = 2


def _model_config(model, ref, kw):
    for m in (model, ref):
        m.config.max_position_embeddings = 14  # (the prompt, 9, and 5 new tokens just fit)


def _dtype(model, ref, kw):
    model.double()
    ref.double()


def _shape(model, ref, kw):
    kw["input_ids"] = _ids(2, 11, seed=3)


def _padded_prompt(model, ref, kw):
    ids = _ids(3, 9, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    kw["input_ids"], kw["attention_mask"] = ids.masked_fill(mask == 0, 1), mask


INGREDIENTS = [_gen_field, _gen_field_in_place, _new_generation_config, _processor, _eos, _pad, _max_new,
               _model_config, _dtype, _shape, _padded_prompt]


@pytest.mark.parametrize("change", INGREDIENTS, ids=[c.__name__.strip("_") for c in INGREDIENTS])
def test_each_ingredient_of_the_resolution_is_seen(change, resolutions):
    """After a first call, a change of one thing the resolution read: the next call resolves anew and gives the
    unpatched model's tokens (or its error), which differ from the first call's where the change matters."""
    model, ref = _pair()
    kw = dict(input_ids=_ids(), max_new_tokens=5, do_sample=False)
    first = model.generate(**kw)
    assert torch.equal(first, ref.generate(**kw)) and len(resolutions) == 1
    change(model, ref, kw)
    try:
        want = ref.generate(**kw)
    except Exception as exc:  # noqa: BLE001 (transformers refuses the call: so must the patched model)
        with pytest.raises(type(exc)):
            model.generate(**kw)
        return
    got = model.generate(**kw)
    assert torch.equal(got, want)
    assert len(resolutions) == 2
    if change not in (_pad, _dtype, _model_config):  # (these leave the tokens as they were)
        assert got.shape != first.shape or not torch.equal(got, first)


def test_a_passed_generation_config_is_checked_by_identity_and_value(resolutions):
    model, ref = _pair()
    ids = _ids()
    cfg = GenerationConfig(max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(ids, generation_config=cfg), ref.generate(ids, generation_config=cfg))
    assert torch.equal(model.generate(ids, generation_config=cfg), ref.generate(ids, generation_config=cfg))
    assert len(resolutions) == 1
    cfg.max_new_tokens = 2  # changed in place
    assert model.generate(ids, generation_config=cfg).shape[1] == 11 and len(resolutions) == 2
    other = GenerationConfig(max_new_tokens=3, do_sample=False)  # another object
    assert model.generate(ids, generation_config=other).shape[1] == 12 and len(resolutions) == 3


def test_the_prompt_contents_are_checked_at_every_call():
    """Same shapes, same arguments: a pad token inside the prompt (the inferred mask), then right padding (handed to
    transformers), then a clean prompt again: each call equals transformers'."""
    model, ref = _pair()
    clean = _ids(2, 9, seed=5)
    with_pad = clean.clone()
    with_pad[0, :3] = 1  # pad id 1 on the left: the mask transformers infers hides it
    right = clean.clone()
    right[1, -2:] = 1  # right padding
    for ids in (clean, with_pad, right, clean, with_pad):
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False),
                           ref.generate(ids, max_new_tokens=4, do_sample=False))


def test_equal_arguments_of_other_types_are_other_keys():
    """top_k=1 and top_k=True hash alike; True is refused (as transformers' type check does) even after 1 ran."""
    model, _ = _pair()
    ids = _ids()
    torch.manual_seed(0)
    model.generate(ids, max_new_tokens=3, do_sample=True, top_k=1)
    with pytest.raises(FuseInferError, match="top_k"):
        model.generate(ids, max_new_tokens=3, do_sample=True, top_k=True)


def test_unpatch_repatch_set_runtime_and_release_drop_the_plans(resolutions):
    model, ref = _pair()
    ids = _ids()
    want = ref.generate(ids, max_new_tokens=3, do_sample=False)
    model.generate(ids, max_new_tokens=3, do_sample=False)
    fuseinfer.runtime.set_runtime(model, prefill="module")
    assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False), want) and len(resolutions) == 2
    fuseinfer.runtime.release(model)
    assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False), want) and len(resolutions) == 3
    fuseinfer.unpatch(model)
    assert SESSIONS_ATTR not in model.__dict__
    assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False), want) and len(resolutions) == 3
    fuseinfer.patch(model)
    assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False), want) and len(resolutions) == 4


def test_a_copy_of_the_model_starts_without_plans():
    model, _ = _pair()
    model.generate(_ids(), max_new_tokens=2, do_sample=False)
    assert _plans(model)
    assert not getattr(copy.deepcopy(model).__dict__.get(SESSIONS_ATTR), "plans", None)


def test_plans_are_bounded(monkeypatch):
    monkeypatch.setattr(hf_generate, "PLANS_PER_MODEL", 2)
    model, _ = _pair()
    for n in (1, 2, 3, 4):
        model.generate(_ids(), max_new_tokens=n, do_sample=False)
    assert len(_plans(model)) == 2


CALLS = [
    dict(input_ids=_ids(), max_new_tokens=4, do_sample=False),
    dict(input_ids=_ids(), max_new_tokens=4, do_sample=False, repetition_penalty=2.0),
    dict(input_ids=_ids(2, 7, seed=1), max_new_tokens=3, do_sample=False),
    dict(input_ids=_ids(2, 7, seed=2).index_fill(1, torch.tensor([0]), 1), max_new_tokens=3, do_sample=False),
    dict(input_ids=_ids(3, 6, seed=3), attention_mask=torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1], [1] * 6]),
         max_new_tokens=2, do_sample=False),
    dict(input_ids=_ids(), max_new_tokens=1, do_sample=False, eos_token_id=5, pad_token_id=0),
]


@settings(max_examples=12, deadline=None, database=None)
@given(st.lists(st.sampled_from(range(len(CALLS))), min_size=2, max_size=7))
def test_any_sequence_of_calls_equals_transformers(order):
    model, ref = _pair()
    for i in order:
        assert torch.equal(model.generate(**CALLS[i]), ref.generate(**CALLS[i])), i


# ---- the session's begin and the first token ----

@pytest.mark.parametrize("batch", [1, 3], ids=["full_bucket", "bucket_with_padding_rows"])
@pytest.mark.parametrize("rule", [{}, dict(repetition_penalty=1.5)], ids=["plain", "processors"])
def test_no_mask_equals_a_mask_of_ones(batch, rule):
    """fuseinfer.generate without a mask (positions from the cache's slots, no mask on the device) and with a mask
    of ones: the same tokens and the same session state (key mask, positions, slots)."""
    model, _ = _pair()
    ids = _ids(batch, 8, seed=6)
    states = []
    for mask in (None, torch.ones_like(ids)):
        out = fuseinfer.generate(model, ids, attention_mask=mask, max_new_tokens=5, **rule)
        session = model.__dict__[SESSIONS_ATTR][decode._bucket(batch)]
        states.append((out, session.cache.key_mask.clone(), session.positions.clone(), session.q_start.clone(),
                       session.decode_idx.clone()))
    for a, b in zip(*states):
        assert torch.equal(a, b)


def test_the_first_token_reads_no_stop_flag(monkeypatch):
    """max_new_tokens=1: no copy of the device's stop flags to the host (a sync on a GPU), the same token even when
    it is an EOS."""
    model, ref = _pair()
    ids = _ids()
    first = int(ref.generate(ids, max_new_tokens=1, do_sample=False)[0, -1])
    model.generate(ids, max_new_tokens=1, do_sample=False, eos_token_id=first)  # (sessions built)
    copies = []
    real = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: copies.append(1) or real(self, *a, **k))
    got = model.generate(ids, max_new_tokens=1, do_sample=False, eos_token_id=first)
    monkeypatch.undo()
    assert not copies
    assert torch.equal(got, ref.generate(ids, max_new_tokens=1, do_sample=False, eos_token_id=first))


def test_trim_reads_each_cache_size_once(monkeypatch):
    model, _ = _pair()
    ids = _ids()
    model.generate(ids, max_new_tokens=2, do_sample=False)
    sizes = []
    real = decode.kv_bytes
    monkeypatch.setattr(decode, "kv_bytes", lambda c: sizes.append(1) or real(c))
    for _ in range(3):
        model.generate(ids, max_new_tokens=2, do_sample=False)
    assert len(sizes) <= 1
    decode.set_cache_budget(0)  # a budget the cache exceeds: the call frees it on return
    try:
        model.generate(ids, max_new_tokens=2, do_sample=False)
        assert 1 not in model.__dict__[SESSIONS_ATTR]
    finally:
        decode.set_cache_budget(None)


# ---- the fast forward's cache copies ----

class _Slotted:
    __slots__ = ("a",)


class _OwnCopy:
    def __copy__(self):
        return "own"


def test_shallow_copy_is_copy_copy():
    from transformers import DynamicCache

    from fuseinfer.runtime.forward import _shallow_copy

    model = random_opt()
    cache = DynamicCache(config=model.config)
    for obj in (cache, cache.layers[0]):
        a, b = copy.copy(obj), _shallow_copy(obj)
        assert type(a) is type(b) and b is not obj
        assert a.__dict__.keys() == b.__dict__.keys() and all(a.__dict__[k] is b.__dict__[k] for k in a.__dict__)
    slotted = _Slotted()
    slotted.a = 3
    assert _shallow_copy(slotted).a == 3 and _shallow_copy(slotted) is not slotted
    assert _shallow_copy(_OwnCopy()) == "own"


def test_model_call_caches_are_independent():
    """Two model(ids) calls' caches (copies of one template) share no layer: extending one leaves the other."""
    model, ref = _pair()
    ids = _ids()
    with torch.no_grad():
        first, second = model(ids).past_key_values, model(ids).past_key_values
        assert all(a is not b for a, b in zip(first.layers, second.layers))
        want = ref(ids).past_key_values
        nxt = torch.tensor([[5]])
        model(nxt, past_key_values=first)
        assert second.get_seq_length() == want.get_seq_length() == 9 and first.get_seq_length() == 10


# ---- on a GPU: the prefill graph without a mask, the first token without a sync ----

@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3], ids=["full_bucket", "bucket_with_padding_rows"])
def test_gpu_no_mask_first_token_and_plans(tiny_model_path, batch, resolutions):
    """CUDA, fp16, the prefill graph: without a mask, with a mask of ones and with a left-padded row, the first token
    and 8 tokens equal across repeated calls (kept resolutions) and a fresh resolution each time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float16).cuda().eval()
    fuseinfer.patch(model)
    ids = torch.randint(3, 1000, (batch, 37), generator=torch.Generator().manual_seed(7)).cuda()
    for n in (1, 8):
        bare = [model.generate(ids, max_new_tokens=n, do_sample=False) for _ in range(3)]
        ones = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
        direct = fuseinfer.generate(model, ids, max_new_tokens=n)
        for out in bare[1:] + [ones, direct]:
            assert torch.equal(out, bare[0])
        assert bare[0].shape == (batch, 37 + n)
    assert len(resolutions) == 4  # (no mask and a mask, each max_new_tokens: kept after the first call)
    if batch > 1:
        mask = torch.ones_like(ids)
        mask[1, :5] = 0
        padded = ids.masked_fill(mask == 0, 1)
        first = model.generate(padded, attention_mask=mask, max_new_tokens=4, do_sample=False)
        again = model.generate(padded, attention_mask=mask, max_new_tokens=4, do_sample=False)
        inferred = model.generate(padded, max_new_tokens=4, do_sample=False)  # (pad id 1 in the prompt)
        assert torch.equal(first, again) and torch.equal(first, inferred)
