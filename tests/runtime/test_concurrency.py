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

    def hooked(ids, mask, n, i):  # model.generate: fast path for even jobs, middle path (beams) for odd ones
        extra = {} if i % 2 == 0 else {"num_beams": 2}
        return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, **extra)

    for fn in (fast, hooked):
        single = [fn(*job) for job in jobs]
        results = _run_threads(fn, jobs)
        for (i, _), out in results.items():
            assert torch.equal(out, single[i]), (fn.__name__, i)
