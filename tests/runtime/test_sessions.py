"""Fast-decode sessions per batch bucket: several settings over one cache, no rebuild when callers alternate
(previously ``model.generate`` with the generation config's EOS / pad and ``fuseinfer.generate`` without rebuilt the
bucket's session and captured its graphs at every call).

On the CPU no graph is captured; ``fake_graphs`` stands in ``decode.capture_graphs`` with an eager replay (the same
warm-up steps, then ``step()`` n times per replay), so that the sessions' capture bookkeeping runs and is counted.
"""
from __future__ import annotations

import pytest
import torch
from conftest import random_opt

import fuseinfer
from fuseinfer.runtime import decode
from fuseinfer.runtime.decode import COUNTS, SESSIONS_ATTR, SESSIONS_PER_BUCKET


class _EagerGraph:
    def __init__(self, step, n):
        self.step, self.n = step, n

    def replay(self):
        for _ in range(self.n):
            self.step()


@pytest.fixture
def fake_graphs(monkeypatch):
    """Sessions 'capture' decode graphs on the CPU: two real warm-up steps, then eager replays."""
    def capture(step, counts, step_counter, mode):
        for _ in range(2):
            step_counter.zero_()
            step()
        step_counter.zero_()
        return {n: _EagerGraph(step, n) for n in counts}

    monkeypatch.setattr(decode, "_graphs_enabled", lambda dev, plan, runtime: True)
    monkeypatch.setattr(decode, "capture_graphs", capture)


def _counts() -> dict:
    return {k: COUNTS[k] for k in ("session", "decode_graphs", "cache", "prefill_graph")}


@pytest.mark.parametrize("graphs", ["eager", "fake_graphs"])
def test_alternating_call_styles_do_not_rebuild(graphs, request):
    """model.generate (EOS 2, pad 1 from the generation config) and fuseinfer.generate (no EOS, pad 0) in turn, with
    1 and 12 new tokens, on a left-padded batch of 2: after one warm-up call of each, no session, cache or graph is
    made again, and every result equals the one that style gives alone (sessions released before)."""
    if graphs == "fake_graphs":
        request.getfixturevalue("fake_graphs")
    model = random_opt()
    assert (model.generation_config.eos_token_id, model.generation_config.pad_token_id) == (2, 1)
    fuseinfer.patch(model)
    ids = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ids = ids.masked_fill(mask == 0, 1)
    enc = {"input_ids": ids, "attention_mask": mask}
    styles = {
        "hf1": lambda: model.generate(**enc, max_new_tokens=1, do_sample=False),
        "fi1": lambda: fuseinfer.generate(model, ids, mask, max_new_tokens=1),
        "hf12": lambda: model.generate(**enc, max_new_tokens=12, do_sample=False),
        "fi12": lambda: fuseinfer.generate(model, ids, mask, max_new_tokens=12),
    }
    alone = {}
    for name, fn in styles.items():  # each style on its own (sessions dropped between)
        fuseinfer.runtime.release(model)
        alone[name] = fn()
        fn()
    fuseinfer.runtime.release(model)
    for fn in styles.values():  # warm-up: each style's session (and graphs) once
        fn()
    before = _counts()
    for _ in range(3):
        for name, fn in styles.items():
            assert torch.equal(fn(), alone[name]), name
    assert _counts() == before  # nothing rebuilt, recaptured or reallocated
    sessions = model.__dict__[SESSIONS_ATTR]
    lru = sessions.lru[2]
    assert len(lru) == 2  # two settings (EOS/pad), one session each; max_new 1 and 12 share it
    assert len({id(s.cache) for s in lru.values()}) == 1  # one cache for the bucket
    if graphs == "fake_graphs":
        assert all(s.graphs for s in lru.values())  # captured by the first call that decoded


def test_single_token_calls_capture_no_decode_graph(fake_graphs):
    """A call making one token needs no decode graph: the session defers the capture to its first call that
    decodes (time to first token of a session's first call)."""
    model = random_opt()
    fuseinfer.patch(model)
    ids = torch.tensor([[5, 6, 7, 8]])
    before = _counts()
    model.generate(ids, max_new_tokens=1, do_sample=False)
    model.generate(ids, max_new_tokens=1, do_sample=False)
    after = _counts()
    assert after["session"] - before["session"] == 1 and after["decode_graphs"] == before["decode_graphs"]
    model.generate(ids, max_new_tokens=5, do_sample=False)
    assert _counts()["decode_graphs"] == before["decode_graphs"] + 1
    assert _counts()["session"] == after["session"]  # the same session, now with its graphs


def test_deferred_capture_at_a_full_cache_stays_in_bounds(fake_graphs):
    """A session whose last call left decode_idx at the cache's last slot captures its graphs on the next call: the
    warm-up steps must not write past the cache (the CPU reference of kv_cache_append raises on such a slot; the
    CUDA kernel would skip it silently, the one-kernel step would not)."""
    model = random_opt(max_position_embeddings=256)
    fuseinfer.patch(model)
    g = torch.Generator().manual_seed(0)
    long = torch.randint(3, 500, (1, 127), generator=g)
    fuseinfer.generate(model, long, max_new_tokens=1)  # capacity 128; decode_idx = 127 after the call
    (session,) = model.__dict__[SESSIONS_ATTR].lru[1].values()
    assert session.capacity == 128 and int(session.decode_idx) == 127 and not session.graphs
    short = long[:, :100]
    out = fuseinfer.generate(model, short, max_new_tokens=6)  # same settings, fits: capture now
    assert session.graphs and model.__dict__[SESSIONS_ATTR][1] is session
    fuseinfer.runtime.release(model)
    assert torch.equal(out, fuseinfer.generate(model, short, max_new_tokens=6))


def test_sessions_per_bucket_are_bounded_and_share_the_cache():
    model = random_opt()
    fuseinfer.patch(model)
    ids = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(1))
    results = {pad: fuseinfer.generate(model, ids, max_new_tokens=4, eos_token_id=7, pad_token_id=pad)
               for pad in range(SESSIONS_PER_BUCKET + 2)}
    sessions = model.__dict__[SESSIONS_ATTR]
    lru = sessions.lru[2]
    assert len(lru) == SESSIONS_PER_BUCKET  # the least recently used went
    assert [k[3] for k in lru] == list(range(2, SESSIONS_PER_BUCKET + 2))  # (pad is the key's last field)
    assert len({id(s.cache) for s in lru.values()}) == 1 and sessions[2] is lru[next(reversed(lru))]
    for pad, out in results.items():  # evicted settings come back (a new session), the same tokens
        assert torch.equal(fuseinfer.generate(model, ids, max_new_tokens=4, eos_token_id=7, pad_token_id=pad), out)


def test_a_larger_cache_replaces_every_session_of_the_bucket():
    model = random_opt()
    fuseinfer.patch(model)
    g = torch.Generator().manual_seed(2)
    short, long = torch.randint(3, 500, (1, 10), generator=g), torch.randint(3, 500, (1, 200), generator=g)
    fuseinfer.generate(model, short, max_new_tokens=3)
    model.generate(short, max_new_tokens=3, do_sample=False, eos_token_id=2, pad_token_id=1)
    sessions = model.__dict__[SESSIONS_ATTR]
    old = sessions[1].cache
    assert len(sessions.lru[1]) == 2
    out = fuseinfer.generate(model, long, max_new_tokens=3)  # capacity 256 > 128
    assert len(sessions.lru[1]) == 1 and sessions[1].cache is not old and sessions[1].capacity == 256
    fuseinfer.runtime.release(model)
    assert torch.equal(out, fuseinfer.generate(model, long, max_new_tokens=3))


def test_copies_and_pickles_start_without_sessions(tmp_path):
    import copy

    model = random_opt()
    fuseinfer.patch(model)
    fuseinfer.generate(model, torch.tensor([[5, 6, 7]]), max_new_tokens=2)
    clone = copy.deepcopy(model)
    assert not clone.__dict__[SESSIONS_ATTR] and not clone.__dict__[SESSIONS_ATTR].lru
    assert torch.equal(fuseinfer.generate(clone, torch.tensor([[5, 6, 7]]), max_new_tokens=2),
                       fuseinfer.generate(model, torch.tensor([[5, 6, 7]]), max_new_tokens=2))


@pytest.mark.gpu
def test_alternating_call_styles_replay_without_recapture_cuda(tiny_model_path):
    """On the GPU (real decode and prefill graphs): the two call styles in turn, 1 and 12 new tokens, capture
    nothing after their warm-up and give the tokens each gives alone."""
    from transformers import AutoModelForCausalLM

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float16).cuda().eval()
    fuseinfer.patch(model)
    ids = torch.randint(3, 8000, (2, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    ids = ids.masked_fill(mask == 0, 1)
    styles = {
        "hf1": lambda: model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False),
        "fi1": lambda: fuseinfer.generate(model, ids, mask, max_new_tokens=1),
        "hf12": lambda: model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False),
        "fi12": lambda: fuseinfer.generate(model, ids, mask, max_new_tokens=12),
    }
    alone = {}
    for name, fn in styles.items():
        fuseinfer.runtime.release(model)
        alone[name] = fn()
    fuseinfer.runtime.release(model)
    for fn in styles.values():
        fn()
    before = _counts()
    for _ in range(3):
        for name, fn in styles.items():
            assert torch.equal(fn(), alone[name]), name
    assert _counts() == before
    assert before["prefill_graph"] >= 1 and before["decode_graphs"] >= 2  # graphs ran (FUSEINFER_PREFILL=auto)
