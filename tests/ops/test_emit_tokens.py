"""fuseinfer::emit_tokens (fuseinfer/ops/emit_tokens.py): the reference against a plain per-row loop (ties, NaN,
finished rows, EOS), bad input, the registration (opcheck), property tests against the reference and the loop
(hypothesis) on every device and, on a GPU, the CUDA kernel against the reference (exact: token ids and counters),
across vocabulary sizes that do and do not split evenly into the kernel's chunks, repeated launches and a CUDA
graph."""
from __future__ import annotations

import pytest
import torch
from helpers import DEVICES, examples, given, require_kernel, st

from fuseinfer import FuseInferError, ops

STATE = ("tokens", "positions", "q_start", "decode_idx", "step", "unfinished", "out", "alive", "scratch")


def _state(b: int, max_new: int, device="cpu", step: int = 2):
    """The decode bookkeeping tensors, as fuseinfer.runtime.decode._Session holds them."""
    return dict(
        tokens=torch.zeros(b, 1, dtype=torch.long, device=device),
        positions=torch.arange(b, dtype=torch.long, device=device).view(b, 1) + 10,
        q_start=torch.full((b,), 20, dtype=torch.int32, device=device),
        decode_idx=torch.tensor([20], device=device),
        step=torch.tensor([step], device=device),
        unfinished=torch.tensor([r % 4 != 3 for r in range(b)], device=device),  # every 4th row has finished
        out=torch.full((b, max_new), -7, dtype=torch.long, device=device),
        alive=torch.ones(max_new, dtype=torch.bool, device=device),
        scratch=ops.emit_tokens_scratch(b, device),
    )


def _call(fn, scores, eos, pad, st):
    fn(scores, eos, pad, st["tokens"], st["positions"], st["q_start"], st["decode_idx"], st["step"],
       st["unfinished"], st["out"], st["alive"], st["scratch"])


def _scores(b: int, v: int, device="cpu") -> torch.Tensor:
    """Random scores with the cases an argmax gets wrong: ties (first index wins), NaN (largest), all -inf."""
    s = torch.randn(b, v, device=device)
    if b > 1:
        s[1, v // 3] = s[1, v - 1] = 50.0  # a tie far apart (different chunks): the first wins
    if b > 2:
        s[2, 0] = s[2, 1] = 60.0  # a tie next to each other
    if b > 4:
        s[4, v // 2] = float("nan")
        s[4, v - 1] = float("nan")  # two NaNs: the first NaN wins
    if b > 5:
        s[5] = float("-inf")  # nothing: index 0
    return s


def _first_max(row: torch.Tensor) -> int:
    """The token a row's scores choose: the first NaN, else the first maximum (torch's argmax rule)."""
    return int(torch.isnan(row).nonzero()[0]) if torch.isnan(row).any() else int(row.argmax())


def test_reference_matches_loop(device):
    b, v, max_new = 7, 300, 5
    scores, eos, pad = _scores(b, v, device), torch.tensor([5, 9], device=device), 1
    scores[0, 5] = 1e3  # row 0 produces an EOS
    st = _state(b, max_new, device)
    before = {k: t.clone() for k, t in st.items()}
    _call(ops.emit_tokens, scores, eos, pad, st)
    for r in range(b):
        token = _first_max(scores[r].cpu()) if bool(before["unfinished"][r]) else pad
        assert int(st["tokens"][r]) == token and int(st["out"][r, 2]) == token
        assert bool(st["unfinished"][r]) == (bool(before["unfinished"][r]) and token not in (5, 9))
    assert int(st["tokens"][1]) == v // 3 and int(st["tokens"][2]) == 0 and int(st["tokens"][4]) == v // 2
    assert int(st["tokens"][5]) == 0 and not bool(st["unfinished"][0])
    assert torch.equal(st["out"][:, [0, 1, 3, 4]], before["out"][:, [0, 1, 3, 4]])  # only column `step`
    assert bool(st["alive"][2]) and torch.equal(st["alive"][[0, 1, 3, 4]], before["alive"][[0, 1, 3, 4]])
    assert torch.equal(st["positions"], before["positions"] + 1) and torch.equal(st["q_start"], before["q_start"] + 1)
    assert int(st["decode_idx"]) == 21 and int(st["step"]) == 3


def test_alive_clears_when_every_row_has_finished(device):
    st = _state(2, 4, device, step=0)
    st["unfinished"][1] = False
    scores = torch.zeros(2, 10, device=device)
    scores[0, 3] = 1.0
    _call(ops.emit_tokens, scores, torch.tensor([3], device=device), 0, st)
    assert not bool(st["alive"][0]) and not st["unfinished"].any() and st["out"][:, 0].tolist() == [3, 0]


def test_shape_errors(device):
    st = _state(2, 4, device)
    with pytest.raises(FuseInferError):
        _call(ops.emit_tokens, torch.zeros(3, 10, device=device), torch.tensor([1], device=device), 0, st)


def test_opcheck_cpu():
    st = _state(3, 16, step=0)  # (opcheck calls the op several times: each advances step)
    args = (_scores(3, 100), torch.tensor([2]), 1, *(st[k] for k in STATE))
    torch.library.opcheck(torch.ops.fuseinfer.emit_tokens.default, args)


# ---- property tests against the reference (hypothesis) ----

@st.composite
def emit_cases(draw, device):
    """(scores, eos, pad, state): batch 1 to many, vocabularies from 1 token to OPT's 50272 (on CUDA) with ties,
    NaN and all -inf rows, EOS lists empty or not (some tokens the rows will choose), any rows already finished,
    any step within the output."""
    torch.manual_seed(draw(st.integers(0, 2**32 - 1)))  # the tensors follow from the drawn seed (replayable)
    b = draw(st.one_of(st.just(1), st.integers(2, 8), st.integers(9, 64)))
    v = draw(st.one_of(st.integers(1, 300), st.integers(301, 5000 if device == "cpu" else 60000),
                       st.just(50272 if device == "cuda" else 2051)))
    scores = torch.randn(b, v, device=device)
    for r in range(b):
        kind = draw(st.sampled_from(["plain", "plain", "tie", "nan", "neg_inf", "peak"]))
        if kind == "tie":
            i, j = sorted(draw(st.lists(st.integers(0, v - 1), min_size=2, max_size=2)))
            scores[r, i] = scores[r, j] = 100.0
        elif kind == "nan":
            scores[r, draw(st.integers(0, v - 1))] = float("nan")
        elif kind == "neg_inf":
            scores[r] = float("-inf")
        elif kind == "peak":
            scores[r, draw(st.integers(0, v - 1))] = 1e4
    chosen = [_first_max(scores[r].cpu()) for r in range(b)]
    eos = draw(st.lists(st.sampled_from(chosen) | st.integers(0, v - 1), max_size=3))
    max_new = draw(st.integers(1, 40))
    state = _state(b, max_new, device, step=draw(st.integers(0, max_new - 1)))
    state["unfinished"] = torch.tensor(draw(st.lists(st.booleans(), min_size=b, max_size=b)), device=device)
    return scores, torch.tensor(eos, dtype=torch.long, device=device), draw(st.integers(0, 3)), state


@pytest.mark.parametrize("device", DEVICES)
def test_emit_tokens_matches_reference_property(device):
    """Exact: the op's state after one call equals the reference's, whose tokens follow the per-row rule."""
    @examples(device, cpu=40, cuda=150)
    @given(case=emit_cases(device))
    def check(case):
        scores, eos, pad, ours = case
        ref = {k: t.clone() for k, t in ours.items()}
        before = {k: t.clone() for k, t in ours.items()}
        _call(ops.emit_tokens, scores, eos, pad, ours)
        _call(ops.emit_tokens_ref, scores, eos, pad, ref)
        for k in STATE[:-1]:  # (scratch is the kernel's)
            assert torch.equal(ours[k], ref[k]), k
        step = int(before["step"])
        for r in range(scores.shape[0]):
            token = _first_max(scores[r].cpu()) if bool(before["unfinished"][r]) else pad
            assert int(ours["out"][r, step]) == token
            assert bool(ours["unfinished"][r]) == (bool(before["unfinished"][r]) and token not in eos.tolist())
        assert bool(ours["alive"][step]) == bool(ours["unfinished"].any())
    check()


@pytest.mark.parametrize("device", DEVICES)
def test_emit_tokens_opcheck_property(device):
    @examples(device, cpu=3, cuda=3)
    @given(case=emit_cases(device))
    def check(case):
        scores, eos, pad, state = case
        state["out"] = torch.zeros(scores.shape[0], 64, dtype=torch.long, device=device)  # room for opcheck's calls
        state["alive"] = torch.ones(64, dtype=torch.bool, device=device)
        state["step"].zero_()
        torch.library.opcheck(torch.ops.fuseinfer.emit_tokens.default,
                              (scores, eos, pad, *(state[k] for k in STATE)))
    check()


# ---- CUDA kernel ----

@pytest.mark.gpu
@pytest.mark.parametrize("b,v", [(1, 50272), (3, 1000), (8, 50272), (32, 8191), (6, 123), (2, 7)])
def test_kernel_matches_reference(b, v):
    require_kernel()
    for trial in range(3):  # repeated launches: the kernel's ticket must reset itself
        scores, eos = _scores(b, v, "cuda"), torch.tensor([3, v - 2], device="cuda")
        scores[0, 3] = 1e3 if trial == 1 else scores[0, 3]  # trial 1: row 0 produces an EOS
        ours, ref = _state(b, 6, "cuda"), _state(b, 6, "cuda")
        _call(ops.emit_tokens, scores, eos, 1, ours)
        _call(ops.emit_tokens_ref, scores, eos, 1, ref)
        for k in ("tokens", "positions", "q_start", "decode_idx", "step", "unfinished", "out", "alive"):
            assert torch.equal(ours[k], ref[k]), k


@pytest.mark.gpu
def test_kernel_in_cuda_graph_and_opcheck():
    require_kernel()
    b, v, max_new = 4, 5000, 8
    scores = torch.randn(b, v, device="cuda")
    st = _state(b, max_new, "cuda", step=0)
    eos = torch.empty(0, dtype=torch.long, device="cuda")
    _call(ops.emit_tokens, scores, eos, 0, st)  # warm-up outside the graph
    st["step"].zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _call(ops.emit_tokens, scores, eos, 0, st)
    expected = torch.where(st["unfinished"], scores.argmax(-1), 0)
    for _ in range(max_new):
        graph.replay()
    assert torch.equal(st["out"], expected[:, None].expand(b, max_new)) and int(st["step"]) == max_new
    st = _state(b, 16, "cuda", step=0)
    args = (scores, eos, 0, *(st[k] for k in STATE))
    torch.library.opcheck(torch.ops.fuseinfer.emit_tokens.default, args)


@pytest.mark.gpu
@pytest.mark.parametrize("step", [-1, 6])
def test_kernel_step_outside_the_output_writes_no_slot(step):
    """A step outside [0, max_new) (graph replays past the last token, or a bad input) records no token and no
    alive flag (no write out of bounds), and still advances the counters."""
    require_kernel()
    b, v, max_new = 3, 1000, 6
    st = _state(b, max_new, "cuda", step=step)
    _call(ops.emit_tokens, torch.randn(b, v, device="cuda"), torch.tensor([3], device="cuda"), 1, st)
    assert bool((st["out"] == -7).all()) and bool(st["alive"].all())
    assert int(st["step"]) == step + 1 and int(st["decode_idx"]) == 21
