"""Concurrent generate calls on one patched model: every caller gets the result a single-threaded call gives
(calls on one model are serialised by ``fuseinfer.runtime.model_lock``)."""
from __future__ import annotations

import threading

import pytest
import torch
from conftest import random_opt

import fuseinfer


def _run_threads(fn, jobs):
    results, errors = {}, []

    def work(i):
        try:
            for r in range(5):
                results[(i, r)] = fn(*jobs[i])
        except Exception as exc:  # noqa: BLE001 (collected and reported below)
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def _jobs(device):
    g = torch.Generator().manual_seed(0)
    jobs = []
    for i, (b, p, n) in enumerate([(1, 9, 20), (2, 14, 33), (4, 5, 18), (3, 11, 40)]):  # other buckets and lengths
        ids = torch.randint(3, 500, (b, p), generator=g).to(device)
        mask = torch.ones_like(ids)
        if b > 1:
            mask[0, :2] = 0
        jobs.append((ids, mask, n, i))
    return jobs


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_four_threads_five_calls_each_give_the_single_threaded_results(device):
    model = random_opt(dtype=torch.float16 if device == "cuda" else torch.float32, device=device)
    fuseinfer.patch(model)
    jobs = _jobs(device)

    def fast(ids, mask, n, i):
        return fuseinfer.generate(model, ids, mask, max_new_tokens=n, repetition_penalty=1.0 + 0.1 * i)

    def hooked(ids, mask, n, i):  # model.generate: fast path for even jobs, beam path for odd ones
        extra = {} if i % 2 == 0 else {"num_beams": 2}
        return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, **extra)

    for fn in (fast, hooked):
        single = [fn(*job) for job in jobs]
        results = _run_threads(fn, jobs)
        for (i, _), out in results.items():
            assert torch.equal(out, single[i]), (fn.__name__, i)



def test_patch_and_unpatch_racing_generate_and_forward_raise_only_the_clear_error():
    """60 calls from 6 threads on one model: patch, unpatch, fuseinfer.generate, model.generate, the model's
    forward and fuseinfer.prefill, interleaved. Each either gives the result a lone call gives (the same tokens whether the model is patched
    or not at that moment; logits within the reference's tolerance) or raises FuseInferError (patching a patched
    model, unpatching an unpatched one, fuseinfer.generate on an unpatched one); nothing else. (model.generate and
    the forward hold ``model_lock`` here: on a model unpatched at that moment they are transformers' own, which
    take no lock; on a patched one they take it themselves, re-entrantly.)"""
    from concurrent.futures import ThreadPoolExecutor

    model = random_opt()
    ids = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ref_logits = model(input_ids=ids, attention_mask=mask).logits
    ref_tokens = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    fuseinfer.patch(model)
    assert torch.equal(fuseinfer.generate(model, ids, mask, max_new_tokens=6), ref_tokens)

    def call(i):
        kind = i % 6
        if kind == 0:
            fuseinfer.patch(model)
        elif kind == 1:
            fuseinfer.unpatch(model)
        elif kind == 2:
            assert torch.equal(fuseinfer.generate(model, ids, mask, max_new_tokens=6), ref_tokens)
        elif kind == 3:
            with fuseinfer.runtime.model_lock(model):
                out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
            assert torch.equal(out, ref_tokens)
        elif kind == 4:
            with fuseinfer.runtime.model_lock(model), torch.no_grad():
                logits = model(input_ids=ids, attention_mask=mask).logits
            torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
        else:  # fuseinfer.prefill takes the lock itself (its lean loop reads the patched layers directly)
            last = fuseinfer.prefill(model, ids, mask)
            torch.testing.assert_close(last, ref_logits[:, -1].float(), rtol=1e-4, atol=1e-4)

    clear, other = 0, []
    with ThreadPoolExecutor(6) as pool:
        for future in [pool.submit(call, i) for i in range(60)]:
            try:
                future.result()
            except fuseinfer.FuseInferError:
                clear += 1
            except Exception as exc:  # noqa: BLE001 (every other exception fails the test, listed)
                other.append(repr(exc))
    assert not other, other
    assert clear < 60


def test_unpatch_waits_for_a_forward_of_the_patched_model():
    """A forward of the patched model holds the model's lock: unpatch from another thread waits until it returns,
    and the forward gives the patched model's logits."""
    model = random_opt()
    ids = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    fuseinfer.patch(model)
    inside, go = threading.Event(), threading.Event()

    def pause(*_):
        inside.set()
        go.wait(10)

    model.model.decoder.layers[0].register_forward_hook(pause)
    out = {}

    def forward():
        with torch.no_grad():
            out["logits"] = model(input_ids=ids).logits

    reader, writer = threading.Thread(target=forward), threading.Thread(target=fuseinfer.unpatch, args=(model,))
    reader.start()
    assert inside.wait(10)
    writer.start()
    writer.join(0.5)
    assert writer.is_alive()  # waiting for the forward
    go.set()
    reader.join(10)
    writer.join(10)
    assert not writer.is_alive() and fuseinfer.patch_state(model) is None
    torch.testing.assert_close(out["logits"], ref, rtol=1e-4, atol=1e-4)
