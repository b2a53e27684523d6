"""Generate calls that misuse the runtime: non-integer token ids, and the memory one large call leaves held."""
from __future__ import annotations

import pytest
import torch
from conftest import random_opt

import fuseinfer
from fuseinfer import FuseInferError


@pytest.fixture(scope="module")
def patched():
    model = random_opt()
    fuseinfer.patch(model)
    return model


def _ids(batch=2, length=7):
    return torch.randint(3, 500, (batch, length), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64, torch.bfloat16, torch.bool,
                                   torch.complex64])
@pytest.mark.parametrize("entry", ["fuseinfer", "model", "model_beams"])
def test_non_integer_input_ids_are_one_clear_error(patched, dtype, entry):
    """transformers refuses float ids deep in the embedding; fast decode used to truncate them (3.7 -> 3)."""
    ids = (_ids().double() + 0.7).to(dtype)
    with pytest.raises(FuseInferError, match="input_ids must hold integer token ids, got dtype"):
        if entry == "fuseinfer":
            fuseinfer.generate(patched, ids, max_new_tokens=3)
        else:
            patched.generate(ids, max_new_tokens=3, do_sample=False, **({"num_beams": 2} if entry == "model_beams"
                                                                        else {}))


def test_int32_input_ids_give_the_int64_result(patched):
    ids = _ids()
    expected = fuseinfer.generate(patched, ids, max_new_tokens=4)
    assert torch.equal(fuseinfer.generate(patched, ids.int(), max_new_tokens=4), expected)
    assert torch.equal(patched.generate(ids.int(), max_new_tokens=4, do_sample=False), expected)


def _held(model) -> int:
    """Bytes of the KV-cache tensors the model's sessions hold (every bucket's and middle-path graph's cache)."""
    from fuseinfer.runtime.decode import SESSIONS_ATTR

    caches = {id(s.cache): s.cache for s in model.__dict__.get(SESSIONS_ATTR, {}).values() if s is not None}
    return sum(t.numel() * t.element_size() for c in caches.values() for t in [*c.keys, *c.values, c.key_mask])


@pytest.fixture
def budget():
    yield fuseinfer.runtime.set_cache_budget
    fuseinfer.runtime.set_cache_budget(None)


def test_one_large_call_does_not_keep_its_cache_past_the_budget(budget):
    """A call whose cache exceeds the budget frees it on return; smaller, recently used ones stay within it; the
    middle path's graphs count too; results are unchanged."""
    model = random_opt()
    fuseinfer.patch(model)
    small, big = _ids(1, 5), _ids(64, 5)
    expected = {b: fuseinfer.generate(model, ids, max_new_tokens=4) for b, ids in ((1, small), (64, big))}
    fuseinfer.runtime.release(model)
    fuseinfer.generate(model, small, max_new_tokens=4)
    one = _held(model)  # bucket 1 (capacity 128)
    assert one > 0
    budget(4 * one)
    assert torch.equal(fuseinfer.generate(model, big, max_new_tokens=4), expected[64])
    assert _held(model) == one  # the 64-row cache (64x) went on return; the small one stays
    budget(100 * one)
    fuseinfer.generate(model, big, max_new_tokens=4)
    assert _held(model) == 65 * one  # both fit
    budget(2 * one)
    assert torch.equal(fuseinfer.generate(model, small, max_new_tokens=4), expected[1])
    assert _held(model) == one  # the large one, least recently used and over the budget, is freed
    model.generate(small, max_new_tokens=4, do_sample=False, num_beams=2)  # middle path: a 2-row graph
    assert _held(model) == 2 * one  # the most recent (the graph's 2 rows) fills the budget: bucket 1 went
    budget(0)
    model.generate(small, max_new_tokens=4, do_sample=False, num_beams=2)
    assert _held(model) == 0
    budget(None)
    assert fuseinfer.runtime.decode.cache_budget(torch.device("cpu")) == 512 << 20
    with pytest.raises(FuseInferError, match="set_cache_budget takes"):
        budget(-1)


def test_middle_path_returns_transformers_cache_type():
    """transformers' contract: past_key_values of a return_dict_in_generate call is a DynamicCache (not fuseinfer's
    static cache, whose buffers the model's next call reuses), holding what transformers' own generate holds; also
    with compile_config; and a later call can continue from it."""
    from transformers import CompileConfig, DynamicCache

    ref_model, model = random_opt(), random_opt()
    fuseinfer.patch(model)
    ids = _ids(2, 6)
    for extra in ({"num_beams": 2}, {"compile_config": CompileConfig()}):
        kwargs = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, **extra)
        out, ref = model.generate(ids, **kwargs), ref_model.generate(ids, **kwargs)
        assert torch.equal(out.sequences, ref.sequences)
        assert type(out.past_key_values) is DynamicCache, type(out.past_key_values)
        assert out.past_key_values.get_seq_length() == ref.past_key_values.get_seq_length()
        for got, want in zip(out.past_key_values.layers, ref.past_key_values.layers):
            torch.testing.assert_close(got.keys, want.keys, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(got.values, want.values, rtol=1e-4, atol=1e-4)
    out = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                         compile_config=CompileConfig())
    more = model.generate(out.sequences, past_key_values=out.past_key_values, max_new_tokens=3, do_sample=False)
    assert torch.equal(more, ref_model.generate(ids, max_new_tokens=6, do_sample=False))
