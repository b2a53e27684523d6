"""fuseinfer::sample_tokens (fuseinfer/ops/sample_tokens.py): the warpers' kept sets against transformers' warpers
and a float64 per-row oracle (ties at every cut-off, -inf entries; hypothesis), the Philox stream against the
published known-answer vectors, the draw's distribution (chi-square, with a check that the test rejects a wrong
distribution), determinism, opcheck, emit_tokens with chosen tokens; the kernel's algorithm emulated in NumPy (its
selection levels, tie scan and draw layout; its block reductions lane by lane) against the oracle and the
reference on the CPU, and the cluster kernel's (skipped levels, per-CTA tie cut) against the five levels'; on a GPU
the kernel's kept set and tokens against the reference across vocabularies up to Qwen2's, its draws' distribution
and a CUDA graph replay; the cluster kernel (sm_90) at the batch sizes and vocabularies where the host picks it, at
every cluster size, and which kernel ran."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import examples, given, require_kernel, st

from fuseinfer import FuseInferError, ops
from fuseinfer.ops.sample_tokens import philox4x32, philox_uniform, sample_tokens_ref, warp_ref

KINDS = ("normal", "fp16", "integers", "neg_inf", "peak", "all_neg_inf")


def _rows(kinds, v: int, gen: torch.Generator) -> torch.Tensor:
    """(len(kinds), v) fp32 logits: 'normal' (no ties), 'fp16' (rounded to fp16: ties as an fp16 model's logits
    have), 'integers' (few distinct values: ties at every cut-off), 'neg_inf' (a third banned, as processors do),
    'peak' (one token holds nearly all the mass), 'all_neg_inf' (nothing left)."""
    rows = []
    for kind in kinds:
        r = torch.randn(v, generator=gen) * 3
        if kind == "fp16":
            r = r.half().float()
        elif kind == "integers":
            r = torch.randint(-4, 5, (v,), generator=gen).float()
        elif kind == "neg_inf":
            r[torch.rand(v, generator=gen) < 0.33] = float("-inf")
        elif kind == "peak":
            r[int(torch.randint(v, (1,), generator=gen))] = 40.0
        elif kind == "all_neg_inf":
            r = torch.full((v,), float("-inf"))
        rows.append(r)
    return torch.stack(rows)


def _oracle(row: torch.Tensor, temperature, top_k, top_p, min_p, tol_p: float = 1e-5, tol_min: float = 1e-5):
    """(kept, ambiguous) (V,) bool for one row, in float64 with an explicit (value, index) order: the warpers'
    rule written out. ``ambiguous``: tokens whose cumulative probability (top-p) or probability ratio (min-p) lies
    within the relative tolerance of the cut-off, where float32 rounding may decide either way."""
    v = row.numel()
    z = row / temperature if temperature != 1.0 else row  # (the fp32 division the op makes)
    z = z.double()
    kept = torch.ones(v, dtype=torch.bool)
    amb = torch.zeros(v, dtype=torch.bool)
    if not torch.isfinite(z).any():
        return kept, amb
    if top_k and top_k < v:
        kth = z.sort(descending=True).values[top_k - 1]
        kept &= z >= kth
    if top_p is not None and top_p < 1.0:
        zz = torch.where(kept, z, float("-inf"))
        idx = torch.from_numpy(np.lexsort((np.arange(v), zz.numpy())))  # ascending, ties by index (stable)
        cum = torch.softmax(zz, 0)[idx].cumsum(0)
        drop = cum <= 1 - top_p
        drop[-1] = False
        kept[idx[drop]] = False
        amb[idx[(cum - (1 - top_p)).abs() <= tol_p * (1 - top_p)]] = True  # (float32 sums: relative error)
    if min_p is not None and min_p > 0:
        zz = torch.where(kept, z, float("-inf"))
        ratio = torch.exp(zz - zz.max())
        amb |= kept & ((ratio - min_p).abs() <= tol_min * min_p)
        kept &= ratio >= min_p
    return kept, amb


def _check_kept(kept: torch.Tensor, rows: torch.Tensor, params, tol_p=1e-5, tol_min=1e-5, kinds=None) -> None:
    """kept (B, V) bool equals the oracle's on the finite logits (a -inf one has no probability either way)
    except on its ambiguous tokens (few). kinds: the rows' kinds (_rows), for the failure message, which lists
    every failing row."""
    failures = []
    for r in range(rows.shape[0]):
        want, amb = _oracle(rows[r], *params, tol_p=tol_p, tol_min=tol_min)
        finite = torch.isfinite(rows[r])
        got = kept[r].cpu()
        wrong = ((got & finite) != (want & finite)) & ~amb
        where = dict(row=r, kind=kinds[r] if kinds else None)
        if wrong.any():
            failures.append(dict(where, n_wrong=int(wrong.sum()), first_wrong=wrong.nonzero()[:6].flatten().tolist(),
                                 last_wrong=wrong.nonzero()[-2:].flatten().tolist(),
                                 kept_not_wanted=int((wrong & got).sum()), wanted_not_kept=int((wrong & want).sum()),
                                 want_kept=int((want & finite).sum()), got_kept=int((got & finite).sum()),
                                 finite=int(finite.sum())))
        if int(amb.sum()) > max(8, rows.shape[1] // 50):  # (the tolerance must not hide a class of tokens)
            failures.append(dict(where, ambiguous=int(amb.sum())))
    assert not failures, dict(v=rows.shape[1], params=dict(zip(("temperature", "top_k", "top_p", "min_p"), params)),
                              failures=failures)


# ---- the warpers ----

@st.composite
def warp_cases(draw):
    torch.manual_seed(draw(st.integers(0, 2**32 - 1)))
    v = draw(st.one_of(st.integers(1, 40), st.integers(41, 2000)))
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=4))
    rows = _rows(kinds, v, torch.Generator().manual_seed(draw(st.integers(0, 2**31))))
    temperature = draw(st.sampled_from([1.0, 0.7, 1.3, 0.05]))
    top_k = draw(st.sampled_from([None, 1, 2, 5, 50, 5000]))
    top_p = draw(st.sampled_from([None, 1.0, 0.0, 0.3, 0.9, 0.999]))
    min_p = draw(st.sampled_from([None, 0.0, 0.05, 0.5]))
    return rows, (temperature, top_k, top_p, min_p)


@examples("cpu", cpu=60, cuda=60)
@given(case=warp_cases())
def test_warp_ref_kept_set_matches_oracle(case):
    rows, params = case
    _check_kept(torch.isfinite(warp_ref(rows, *params)), rows, params)


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [(0.7, None, 0.9, None), (1.3, 40, 0.8, None),
                                                           (1.0, 5, None, 0.1), (0.5, 100, 0.95, 0.02)])
def test_warp_ref_equals_transformers_warpers(temperature, top_k, top_p, min_p):
    """Exactly transformers' warpers (no ties in these rows, where an unstable sort could order them otherwise)."""
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(1)) * 4
    want = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        want = TopKLogitsWarper(top_k)(None, want)
    if top_p is not None:
        want = TopPLogitsWarper(top_p)(None, want)
    if min_p is not None:
        want = MinPLogitsWarper(min_p)(None, want)
    assert torch.equal(warp_ref(logits, temperature, top_k, top_p, min_p), want)


def test_ties_at_the_cut_offs_resolve_as_transformers():
    """top-k keeps every token equal to the k-th value; top-p drops the lowest indices of a tied group first (the
    stable ascending sort's cumulative sum: 0.25, 0.5 are <= 0.5)."""
    kept = torch.isfinite(warp_ref(torch.tensor([[3.0, 1.0, 3.0, 3.0]]), top_k=2))
    assert kept.tolist() == [[True, False, True, True]]
    kept = torch.isfinite(warp_ref(torch.tensor([[1.0, 1.0, 1.0, 1.0]]), top_p=0.5))
    assert kept.tolist() == [[False, False, True, True]]
    kept = torch.isfinite(warp_ref(torch.tensor([[2.0, 1.0, 1.0, 5.0]]), top_p=0.0))  # keeps the top token only
    assert kept.tolist() == [[False, False, False, True]]


# ---- the draw ----

def test_philox_known_answers():
    """Random123's known-answer vectors of Philox4x32-10."""
    t = lambda *xs: tuple(torch.tensor(x) for x in xs)  # noqa: E731
    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, want in cases:
        assert tuple(int(w) for w in philox4x32(t(*counter), t(*key))) == want


def test_uniforms_lie_strictly_inside_zero_one_and_depend_on_every_input():
    seed, off = torch.tensor([12345]), torch.tensor([3])
    u = philox_uniform(seed, off, 3, 4001)
    assert u.shape == (3, 4001) and bool((u > 0).all() and (u < 1).all())
    assert abs(float(u.mean()) - 0.5) < 0.01
    for other in (philox_uniform(seed + 1, off, 3, 4001), philox_uniform(seed, off + 1, 3, 4001),
                  philox_uniform(seed, off + 2**32, 3, 4001)):
        assert (other != u).float().mean() > 0.99
    assert (u[0] != u[1]).float().mean() > 0.99  # rows: other streams
    assert torch.equal(philox_uniform(seed, off, 3, 4001), u)


def chi2_limit(df: int, z: float = 3.7) -> float:
    """An upper quantile of chi-square(df) (Wilson-Hilferty; z = 3.7: ~1e-4 of false alarms)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, int]:
    """(statistic, degrees of freedom, draws outside the support) of drawn tokens against probabilities (V,);
    categories expected fewer than 5 times are pooled."""
    n = tokens.numel()
    counts = torch.bincount(tokens.cpu(), minlength=probs.numel()).double()
    probs = probs.double().cpu()
    outside = int(counts[probs == 0].sum())
    big = probs * n >= 5
    obs = torch.cat([counts[big], counts[~big & (probs > 0)].sum()[None]])
    exp = torch.cat([probs[big] * n, (probs[~big & (probs > 0)] * n).sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return float(((obs - exp) ** 2 / exp).sum()), int(keep.sum()) - 1, outside


def _draws(fn, row: torch.Tensor, n: int, params, device="cpu") -> torch.Tensor:
    """n draws of one row: n copies of it (each row its own Philox stream) at one seed and offset."""
    rows = row.to(device)[None].expand(n, -1).contiguous()
    seed, off = torch.tensor([2024], device=device), torch.tensor([7], device=device)
    return fn(rows, seed, off, *params)


@pytest.mark.parametrize("params", [(0.7, 8, 0.9, 0.0), (1.0, 0, 1.0, 0.0), (1.3, 0, 0.8, 0.05)])
def test_reference_draws_follow_the_warped_distribution(params):
    row = torch.randn(24, generator=torch.Generator().manual_seed(5)) * 2
    tokens = _draws(sample_tokens_ref, row, 20000, params)
    temperature, top_k, top_p, min_p = params
    probs = warp_ref(row[None], temperature, top_k or None, top_p if top_p < 1 else None, min_p or None)[0]
    stat, df, outside = chi2(tokens, probs.softmax(0))
    assert outside == 0 and stat < chi2_limit(df), (stat, df)
    # the test can fail: the same draws against another temperature's distribution are rejected
    wrong = warp_ref(row[None], temperature * 1.25, top_k or None, top_p if top_p < 1 else None, min_p or None)[0]
    assert chi2(tokens, wrong.softmax(0))[0] > chi2_limit(df)


def test_draws_are_a_function_of_seed_and_offset():
    rows = torch.randn(64, 500, generator=torch.Generator().manual_seed(0))
    a = sample_tokens_ref(rows, torch.tensor([1]), torch.tensor([0]), 1.0, 0, 0.9, 0.0)
    assert torch.equal(a, sample_tokens_ref(rows, torch.tensor([1]), torch.tensor([0]), 1.0, 0, 0.9, 0.0))
    assert not torch.equal(a, sample_tokens_ref(rows, torch.tensor([2]), torch.tensor([0]), 1.0, 0, 0.9, 0.0))
    assert not torch.equal(a, sample_tokens_ref(rows, torch.tensor([1]), torch.tensor([1]), 1.0, 0, 0.9, 0.0))
    assert torch.equal(ops.sample_tokens(rows, torch.tensor([1]), torch.tensor([0]), top_p=0.9), a)
    # top-k 1: the argmax, whatever the draw; an all -inf row: token 0
    rows[3] = float("-inf")
    top1 = ops.sample_tokens(rows, torch.tensor([9]), torch.tensor([4]), 0.7, top_k=1)
    assert torch.equal(top1[torch.arange(64) != 3], rows.argmax(-1)[torch.arange(64) != 3]) and int(top1[3]) == 0


def test_bad_input_is_one_clear_error():
    with pytest.raises(FuseInferError, match="sample_tokens"):
        ops.sample_tokens(torch.zeros(2, 5, dtype=torch.float16), torch.tensor([1]), torch.tensor([0]))
    with pytest.raises(FuseInferError, match="temperature"):
        ops.sample_tokens(torch.zeros(2, 5), torch.tensor([1]), torch.tensor([0]), temperature=0.0)


def test_opcheck_cpu():
    rows = _rows(("normal", "fp16", "neg_inf"), 300, torch.Generator().manual_seed(0))
    torch.library.opcheck(torch.ops.fuseinfer.sample_tokens.default,
                          (rows, torch.tensor([3]), torch.tensor([1]), 0.8, 20, 0.9, 0.01))


def _emit_state(b, max_new, device):
    return [torch.zeros(b, 1, dtype=torch.long, device=device), torch.zeros(b, 1, dtype=torch.long, device=device),
            torch.zeros(b, dtype=torch.int32, device=device), torch.zeros(1, dtype=torch.long, device=device),
            torch.zeros(1, dtype=torch.long, device=device), torch.tensor([True, True, False], device=device),
            torch.full((b, max_new), -1, dtype=torch.long, device=device),
            torch.ones(max_new, dtype=torch.bool, device=device), ops.emit_tokens_scratch(b, device)]


def test_emit_tokens_records_chosen_tokens(device="cpu"):
    scores = torch.randn(3, 50, device=device)
    chosen = torch.tensor([4, 7, 9], device=device)
    st_ = _emit_state(3, 4, device)
    ops.emit_tokens(scores, torch.tensor([7], device=device), 1, *st_, chosen)
    assert st_[6][:, 0].tolist() == [4, 7, 1] and st_[0].flatten().tolist() == [4, 7, 1]  # row 2 had finished
    assert st_[5].tolist() == [True, False, False] and int(st_[4]) == 1  # row 1 produced the EOS
    with pytest.raises(FuseInferError):
        ops.emit_tokens(scores, torch.tensor([7], device=device), 1, *st_, chosen[:2])
    torch.library.opcheck(torch.ops.fuseinfer.emit_tokens.default,
                          (scores, torch.tensor([7], device=device), 1, *_emit_state(3, 16, device), chosen))


def _check_tokens(tokens, kept, rows, seed, off, params, kinds, allowed: int = 0) -> int:
    """tokens (B,) equal sample_tokens_ref's on the rows whose kept set (B, V) is the reference's, but on at most
    `allowed` rows (a near-tie of two Gumbel keys, whose logarithms round otherwise on a GPU); returns how many
    rows' kept sets are the fp32 reference's (the others differ within rounding at a cut-off)."""
    temperature, top_k, top_p, min_p = params
    seed, off, tokens = seed.cpu(), off.cpu(), tokens.cpu()
    ref = sample_tokens_ref(rows, seed, off, temperature, top_k or 0, 1.0 if top_p is None else top_p,
                            0.0 if min_p is None else min_p)
    warped = warp_ref(rows, *params)  # (B, V)
    same_kept = ((kept.cpu() & torch.isfinite(rows)) == torch.isfinite(warped)).all(-1)
    wrong = (tokens != ref) & same_kept
    gumbel = warped - torch.log(-torch.log(philox_uniform(seed, off, *rows.shape)))  # (B, V)
    at = tokens[:, None].clamp(0, rows.shape[1] - 1)  # (B, 1)
    assert int(wrong.sum()) <= allowed, dict(
        v=rows.shape[1], params=params, wrong_rows=wrong.nonzero().flatten().tolist(), kinds=kinds,
        tokens=tokens.tolist(), ref=ref.tolist(), same_kept=same_kept.tolist(),
        ref_key=gumbel.amax(-1).tolist(), got_key=gumbel.gather(1, at)[:, 0].tolist(),  # (got < ref: not the argmax)
        got_kept_by_ref=torch.isfinite(warped.gather(1, at)[:, 0]).tolist())
    return int(same_kept.sum())


# ---- CUDA kernel ----

def _kernel_kept(rows, seed, off, params):
    from fuseinfer.core.extension import extension

    temperature, top_k, top_p, min_p = params
    return extension().sample_tokens_kept(rows, seed, off, temperature, top_k or 0,
                                          1.0 if top_p is None else top_p, 0.0 if min_p is None else min_p)


@pytest.mark.gpu
@pytest.mark.parametrize("v", [1000, 50272, 151936])
@pytest.mark.parametrize("top_k", [None, 1, 50])
@pytest.mark.parametrize("top_p", [None, 0.9, 0.999])
@pytest.mark.parametrize("min_p", [None, 0.05])
def test_kernel_kept_set_and_tokens_match_reference(v, top_k, top_p, min_p):
    """The kernel keeps the reference's tokens (but where float rounding decides a cut-off) and draws the
    reference's token from the same Philox numbers (but at a near-tie of two Gumbel keys)."""
    require_kernel()
    gen = torch.Generator().manual_seed(v + (top_k or 0))
    kinds = KINDS + ("fp16", "integers", "normal")
    rows = _rows(kinds, v, gen)
    params = (0.7, top_k, top_p, min_p)
    seed, off = torch.tensor([77], device="cuda"), torch.tensor([5], device="cuda")
    tokens, kept = _kernel_kept(rows.cuda(), seed, off, params)
    # (fp32 sums of up to 152k probabilities in two orders: a looser tolerance at the top-p cut-off)
    _check_kept(kept, rows, params, tol_p=2e-4, tol_min=1e-5, kinds=kinds)
    assert torch.equal(ops.sample_tokens(rows.cuda(), seed, off, *params), tokens)  # the op serves the kernel
    _check_tokens(tokens, kept, rows, seed, off, params, kinds, allowed=1)


@pytest.mark.gpu
@pytest.mark.parametrize("v,params", [(1000, (0.7, 50, 1.0, 0.0)), (1000, (1.0, 0, 0.9, 0.0)),
                                      (60000, (0.8, 0, 0.95, 0.02)), (151936, (1.2, 40, 0.9, 0.0))])
def test_kernel_draws_follow_the_warped_distribution(v, params):
    require_kernel()
    row = torch.randn(v, generator=torch.Generator().manual_seed(3)) * 2
    row[: v // 2] -= 6  # (most of the mass on a few hundred tokens: categories big enough to test)
    n = 20000 if v <= 1000 else 6000
    tokens = _draws(lambda *a: ops.sample_tokens(*a), row, n, params, device="cuda")
    temperature, top_k, top_p, min_p = params
    probs = warp_ref(row[None], temperature, top_k or None, top_p if top_p < 1 else None, min_p or None)[0].softmax(0)
    stat, df, outside = chi2(tokens, probs)
    assert outside == 0 and stat < chi2_limit(df), (stat, df)


@pytest.mark.gpu
def test_kernel_in_cuda_graph_draws_anew_per_offset_and_opcheck():
    """Replays of a captured draw read the offset from the device: each replay equals the reference at its offset."""
    require_kernel()
    rows = _rows(("normal", "fp16", "peak"), 50272, torch.Generator().manual_seed(0)).cuda()
    seed, off = torch.tensor([11], device="cuda"), torch.tensor([0], device="cuda")
    ops.sample_tokens(rows, seed, off, 0.9, top_p=0.9)  # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.sample_tokens(rows, seed, off, 0.9, top_p=0.9)
        off += 1
    got, want = [], []
    for step in range(6):
        graph.replay()
        got.append(out.cpu().clone())
        want.append(sample_tokens_ref(rows.cpu(), seed.cpu(), torch.tensor([step]), 0.9, 0, 0.9, 0.0))
    assert int(off) == 6
    assert sum(torch.equal(g, w) for g, w in zip(got, want)) >= 5 and len({tuple(g.tolist()) for g in got}) > 1
    torch.library.opcheck(torch.ops.fuseinfer.sample_tokens.default, (rows, seed, off, 0.8, 20, 0.9, 0.01))


@pytest.mark.gpu
def test_kernel_emit_tokens_records_chosen_tokens():
    require_kernel()
    test_emit_tokens_records_chosen_tokens("cuda")


def _kernel_kept_with(rows, seed, off, params, cluster: int):
    """The kernel's (tokens, kept) with the kernel chosen: cluster -1 the host's pick, 0 the one-block kernel, 2..16
    the cluster kernel at that size."""
    from fuseinfer.core.extension import extension

    temperature, top_k, top_p, min_p = params
    return extension().sample_tokens_kept_with(rows, seed, off, temperature, top_k or 0,
                                               1.0 if top_p is None else top_p, 0.0 if min_p is None else min_p,
                                               cluster)


def _require_cluster_kernel():
    require_kernel()
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the cluster kernel needs an sm_90 GPU")


# every warper alone and together, temperature != 1, min-p, top-k >= V (every token stays)
CLUSTER_PARAMS = [(1.0, 50, None, None), (0.7, None, 0.9, None), (0.7, 50, 0.9, None), (1.3, None, 0.95, 0.05),
                  (1.0, None, None, 0.1), (0.7, 1, None, None), (1.0, 10**6, 0.999, None), (0.5, 40, None, None)]


@pytest.mark.gpu
@pytest.mark.parametrize("v", [50272, 151936])
@pytest.mark.parametrize("b", [1, 3, 8, 33])
@pytest.mark.parametrize("params", CLUSTER_PARAMS)
def test_cluster_kernel_kept_set_and_tokens_match_reference(v, b, params):
    """The host's pick at the batch sizes and vocabularies the cluster kernel serves (16 CTAs a row at batch 1 to 8,
    fewer at 33 rows): the reference's kept set (but where float rounding decides a cut-off) and its draw; the same
    draw as the one-block kernel wherever both keep the same tokens."""
    _require_cluster_kernel()
    gen = torch.Generator().manual_seed(v + b + (params[1] or 0))
    kinds = [("fp16", "integers", "neg_inf", "peak", "normal", "all_neg_inf")[r % 6] for r in range(b)]
    rows = _rows(kinds, v, gen)
    seed, off = torch.tensor([123], device="cuda"), torch.tensor([9], device="cuda")
    cuda_rows = rows.cuda()
    assert extension_cluster_size(cuda_rows) > 0  # (the cluster kernel runs here)
    tokens, kept = _kernel_kept_with(cuda_rows, seed, off, params, -1)
    _check_kept(kept, rows, params, tol_p=2e-4, tol_min=1e-5, kinds=kinds)
    _check_tokens(tokens, kept, rows, seed, off, params, kinds, allowed=1)
    assert torch.equal(ops.sample_tokens(cuda_rows, seed, off, *params), tokens)  # the op takes the same kernel
    one_tokens, one_kept = _kernel_kept_with(cuda_rows, seed, off, params, 0)
    same = ((one_kept == kept) | ~torch.isfinite(cuda_rows)).all(-1)  # (B,) (-inf tokens: no probability either way)
    # (the two sum the bins' masses in other orders: a top-p cut within rounding may fall on another token)
    assert int(same.sum()) >= b - 1 - b // 8 and torch.equal(one_tokens[same], tokens[same]), (same.tolist(), kinds)


@pytest.mark.gpu
@pytest.mark.parametrize("cluster", [2, 4, 8, 16])
@pytest.mark.parametrize("v", [37, 1000, 5003])
@pytest.mark.parametrize("params", CLUSTER_PARAMS[:4])
def test_cluster_kernel_at_every_cluster_size(cluster, v, params):
    """Every cluster size on small rows (at 37 tokens and 16 CTAs, six CTAs hold no token) against the reference."""
    _require_cluster_kernel()
    kinds = list(KINDS) + ["fp16", "integers", "normal"]
    rows = _rows(kinds, v, torch.Generator().manual_seed(v + cluster))
    seed, off = torch.tensor([5], device="cuda"), torch.tensor([1], device="cuda")
    tokens, kept = _kernel_kept_with(rows.cuda(), seed, off, params, cluster)
    _check_kept(kept, rows, params, tol_p=2e-4, tol_min=1e-5, kinds=kinds)
    _check_tokens(tokens, kept, rows, seed, off, params, kinds, allowed=1)


def extension_cluster_size(scores: torch.Tensor) -> int:
    from fuseinfer.core.extension import extension

    return int(extension().sample_tokens_cluster_size(scores))


@pytest.mark.gpu
def test_cluster_kernel_runs_where_the_host_picks_it():
    """Which kernel runs (profiler kernel names): the cluster kernel at 50272 and 151936 tokens (16 CTAs a row at
    batch 1 and 8 on a 132-SM GPU, 4 at 33 rows), the one-block kernel for a small vocabulary."""
    _require_cluster_kernel()
    from helpers import cuda_kernel_names

    seed, off = torch.tensor([1], device="cuda"), torch.tensor([0], device="cuda")
    for b, v in ((1, 50272), (8, 50272), (33, 50272), (1, 151936), (8, 151936)):
        scores = torch.randn(b, v, device="cuda")
        c = extension_cluster_size(scores)
        assert c in (2, 4, 8, 16) and b * c <= max(2 * b, torch.cuda.get_device_properties(0).multi_processor_count)
        names = cuda_kernel_names(lambda: ops.sample_tokens(scores, seed, off, 0.7, top_p=0.9))
        assert any("sample_tokens_cluster_kernel" in n for n in names), names
    if torch.cuda.get_device_properties(0).multi_processor_count >= 128:
        assert extension_cluster_size(torch.empty(1, 50272, device="cuda")) == 16
        assert extension_cluster_size(torch.empty(8, 50272, device="cuda")) == 16
    small = torch.randn(2, 1000, device="cuda")
    assert extension_cluster_size(small) == 0
    names = cuda_kernel_names(lambda: ops.sample_tokens(small, seed, off, 0.7, top_p=0.9))
    assert any("sample_tokens_kernel" in n for n in names) and not any("cluster" in n for n in names), names


@pytest.mark.gpu
def test_cluster_kernel_in_cuda_graph_with_pdl():
    """The cluster kernel captured behind another kernel (a programmatic edge with PDL): the scores it reads are
    the previous kernel's output, each replay the reference's draw at its offset."""
    _require_cluster_kernel()
    rows = _rows(("normal", "fp16", "peak", "neg_inf"), 151936, torch.Generator().manual_seed(2)).cuda()
    scaled = torch.empty_like(rows)
    seed, off = torch.tensor([11], device="cuda"), torch.tensor([0], device="cuda")
    assert extension_cluster_size(rows) > 0
    ops.sample_tokens(rows, seed, off, 0.9, top_k=100, top_p=0.9)  # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.mul(rows, 1.0, out=scaled)  # (written right before the sampling kernel reads it)
        out = ops.sample_tokens(scaled, seed, off, 0.9, top_k=100, top_p=0.9)
        off += 1
    got, want = [], []
    for step in range(6):
        scaled.zero_()
        graph.replay()
        got.append(out.cpu().clone())
        want.append(sample_tokens_ref(rows.cpu(), seed.cpu(), torch.tensor([step]), 0.9, 100, 0.9, 0.0))
    assert sum(torch.equal(g, w) for g, w in zip(got, want)) >= 5 and len({tuple(g.tolist()) for g in got}) > 1


# ---- the kernel's algorithm, emulated in NumPy (CPU) ----

def _emulate_kernel_row(x: np.ndarray, row: int, seed, offset, temperature, top_k, top_p, min_p, cluster: int = 0,
                        levels_run: list | None = None):
    """(token, kept (V,) bool) of one row as csrc/sample_tokens.cu computes them, in fp32 NumPy: the keys, the
    block-wide maximum / smallest finite value / finite count (every thread's, not one warp's), the 256 value
    slices, the five selection levels of top-k (counts) and top-p (masses), the ordered scan of the tokens tied at
    v*, min-p, and the draw over groups of four tokens. Bin sums run in another order than the kernel's atomics:
    where a cut-off is within rounding the two may differ (the tests allow what they allow the kernel).
    cluster > 0: the cluster kernel of that many CTAs, which skips the levels of the key bytes the chosen bin's keys
    share (each bin's smallest and largest key), stops at a bin of one key value, and cuts the tokens tied at v* per
    CTA (_cluster_tie_keep). levels_run: the levels each selection ran are appended to it."""
    v = x.size
    f32 = np.float32
    z = (x / f32(temperature)).astype(f32) if temperature != 1.0 else x.astype(f32)
    u = z.view(np.uint32).copy()
    u[u == 0x80000000] = 0
    keys = np.where(u & 0x80000000, ~u, u | 0x80000000).astype(np.uint32)  # order_key
    val = np.where(keys & 0x80000000, keys & 0x7FFFFFFF, ~keys).astype(np.uint32).view(f32)  # key_value
    finite = (keys > 0x007FFFFF) & (keys < 0xFF800000)
    m = f32(z.max())
    if m == -np.inf:
        return 0, np.ones(v, dtype=bool)
    zmin = f32(z[finite].min())
    n_finite = int(finite.sum())
    scale = f32(255.99) / f32(m - zmin) if m > zmin else f32(0)
    if not scale <= 3.0e38:
        scale = f32(0)
    with np.errstate(invalid="ignore"):
        slices = (255 - np.minimum((m - val) * scale, f32(255)).astype(np.uint32)).astype(np.int64)

    def candidates(counted, shift, prefix, s0):  # the level's tokens and their digits (shift 32: the slices)
        if shift == 32:
            return counted, slices
        sel = counted & (slices == s0)
        if shift < 24:
            sel &= (keys >> np.uint32(shift + 8)) == np.uint32(prefix >> (shift + 8))
        return sel, ((keys >> np.uint32(shift)) & 0xFF).astype(np.int64)

    def levels(counted, pick):  # -> the exact key the five levels select; pick(counts, masses) -> (bin, below)
        if cluster:
            return skipping_levels(counted, pick)
        prefix, s0, below = 0, 0, f32(0)
        if levels_run is not None:
            levels_run.append(5)
        for level in range(5):
            shift = 32 - 8 * level
            sel, digit = candidates(counted, shift, prefix, s0)
            b, below = pick(np.bincount(digit[sel], minlength=256), sel, digit, below)
            if level == 0:
                s0 = b
            else:
                prefix |= b << shift
        return prefix, below

    def skipping_levels(counted, pick):  # the cluster kernel's: fewer levels, the same selection
        prefix, s0, below, shift, run = 0, 0, f32(0), 32, 0
        while True:
            run += 1
            sel, digit = candidates(counted, shift, prefix, s0)
            b, below = pick(np.bincount(digit[sel], minlength=256), sel, digit, below)
            in_bin = keys[sel & (digit == b)]
            kmin, kmax = int(in_bin.min()), int(in_bin.max())
            if shift == 32:
                s0 = b
            else:
                prefix |= b << shift
            if kmin == kmax:  # (csrc/sample_tokens.cu advance)
                if levels_run is not None:
                    levels_run.append(run)
                return kmin, below
            shift = ((kmin ^ kmax).bit_length() - 1) // 8 * 8
            if shift < 24:
                prefix = kmin & ~((1 << (shift + 8)) - 1) & 0xFFFFFFFF

    lo = 0
    if top_k and 0 < top_k < n_finite:
        rem = [top_k]

        def pick_count(counts, sel, digit, below):
            above = np.concatenate([np.cumsum(counts[::-1])[::-1][1:], [0]])  # keys in higher bins
            b = int(np.nonzero((above < rem[0]) & (above + counts >= rem[0]))[0][-1])
            rem[0] -= int(above[b])
            return b, below

        lo, _ = levels(finite, pick_count)
    vstar, cut, tie_keep = 0, 0, None
    if top_p is not None and top_p < 1.0:
        counted = finite & (keys >= lo)
        mass = np.exp(val - m).astype(f32)
        target = f32(f32(1.0 - top_p) * f32(mass[counted].sum(dtype=f32)))
        last = {}

        def pick_mass(counts, sel, digit, below):
            ms = np.bincount(digit[sel], weights=mass[sel], minlength=256).astype(f32)
            t = max(f32(target - below), f32(0))
            cum = np.cumsum(ms, dtype=f32)
            over = np.nonzero(cum > t)[0]
            b = int(over[0]) if over.size else int(np.nonzero(counts)[0][-1])
            last["n"] = int(counts[b])
            return b, f32(below + (cum[b - 1] if b else f32(0)))

        vstar, below = levels(counted, pick_mass)
        n = last["n"]
        pv = f32(np.exp(val[keys == np.uint32(vstar)][0] - m))  # (v* is a kept token's key)
        drop = int(min(np.floor(f32(target - below) / pv), n)) if pv > 0 else 0
        drop = max(0, min(drop, n - 1))
        if drop > 0 and not cluster:
            cut = int(np.nonzero(keys == np.uint32(vstar))[0][drop])
        elif drop > 0:
            tie_keep = _cluster_tie_keep(keys == np.uint32(vstar), drop, cluster)
    idx = np.arange(v)
    kept = (keys >= lo) & ((keys > vstar) | ((keys == vstar) & (idx >= cut)))
    if tie_keep is not None:
        kept = (keys >= lo) & ((keys > vstar) | tie_keep)
    if min_p:
        kept &= np.exp(val - m) >= f32(min_p)
    uni = philox_uniform(torch.tensor([seed]), torch.tensor([offset]), row + 1, v)[row].numpy()
    gk = (val - np.log(-np.log(uni))).astype(f32)
    cand = np.nonzero(kept)[0]
    token = int(cand[np.argmax(gk[cand])]) if cand.size else 0
    return token, kept


@examples("cpu", cpu=40, cuda=0)
@given(case=warp_cases())
def test_kernel_emulation_keeps_the_oracles_tokens_and_draws_the_references(case):
    """The kernel's algorithm (emulated) against the float64 oracle's kept set and the reference's draw."""
    rows, params = case
    temperature, top_k, top_p, min_p = params
    got = [_emulate_kernel_row(rows[r].numpy(), r, 77, 5, *params) for r in range(rows.shape[0])]
    kept = torch.from_numpy(np.stack([k for _, k in got]))
    _check_kept(kept, rows, params, tol_p=1e-4)
    tokens = torch.tensor([t for t, _ in got])
    _check_tokens(tokens, kept, rows, torch.tensor([77]), torch.tensor([5]), params, None)


@pytest.mark.parametrize("v", [1000, 5003])
@pytest.mark.parametrize("params", [(0.7, None, None, None), (0.7, 1, None, None), (0.7, 50, 0.9, None),
                                    (0.7, None, 0.9, 0.05), (1.0, None, 0.3, None), (0.7, 50, 0.999, 0.05)])
def test_kernel_emulation_on_the_gpu_tests_rows(v, params):
    """The GPU kernel test's rows (every kind: ties at every cut-off) through the emulated kernel."""
    kinds = KINDS + ("fp16", "integers", "normal")
    rows = _rows(kinds, v, torch.Generator().manual_seed(v + (params[1] or 0)))
    got = [_emulate_kernel_row(rows[r].numpy(), r, 77, 5, *params) for r in range(rows.shape[0])]
    kept = torch.from_numpy(np.stack([k for _, k in got]))
    _check_kept(kept, rows, params, tol_p=1e-4, kinds=kinds)
    tokens = torch.tensor([t for t, _ in got])
    same = _check_tokens(tokens, kept, rows, torch.tensor([77]), torch.tensor([5]), params, kinds)
    assert same >= rows.shape[0] - 1, dict(v=v, params=params, same=same)  # (the token check compared rows)


def _block_max_emulated(values: np.ndarray, fixed: bool = True) -> np.ndarray:
    """Each of 1024 threads' result of the kernel's block_max (csrc/sample_tokens.cu), lane by lane: a warp's
    xor-shuffle maximum, lane 0 of warp w stores it in sh[w], a barrier, then (fixed) every warp's lane j reads
    sh[j] and reduces again; (not fixed: the former code) only warp 0's lanes read sh[lane], the others -inf, and
    each thread took lane 0's value of its OWN warp (a shuffle never crosses warps)."""
    warps = values.reshape(32, 32)  # (warp, lane)
    sh = warps.max(1)  # (32,) one partial per warp
    if fixed:
        second = np.broadcast_to(sh[None, :], (32, 32))  # lane j of every warp reads sh[j]
    else:
        second = np.full((32, 32), -np.inf)
        second[0] = sh  # threadIdx.x < 32: warp 0 only
    per_warp = second.max(1)  # (32,) the xor reduction: the same in every lane of a warp
    return np.repeat(per_warp, 32)  # (1024,) (not fixed: __shfl_sync(v, 0) is lane 0 of the same warp)


def test_block_reductions_give_every_thread_the_result():
    """Every thread of the block needs the row maximum (and the finite count): one that got -inf took the empty-row
    exit and left its tokens' kept flags and its draw out (the kernel's first GPU run)."""
    vals = np.random.default_rng(0).standard_normal(1024)
    assert (_block_max_emulated(vals) == vals.max()).all()
    assert not (_block_max_emulated(vals, fixed=False) == vals.max()).all()  # (the check catches the former code)


def _cluster_chunk(v: int, c: int) -> int:
    """csrc/sample_tokens.cu cluster_chunk: the tokens a CTA of a c-CTA cluster takes (a multiple of 4)."""
    return (-(-v // c) + 3) // 4 * 4


def _cluster_tie_keep(eq: np.ndarray, drop: int, c: int) -> np.ndarray:
    """(V,) bool: which tokens tied at v* stay, as the cluster kernel decides it: CTA r counts its tied tokens (its
    last level's bin of v*), reads every CTA's count, and cuts its own: local = drop - (tied tokens in the CTAs
    before it); local <= 0: all of its tied tokens stay, local >= its count: none, else from its local-th on."""
    v = eq.size
    chunk = _cluster_chunk(v, c)
    tied = [int(eq[r * chunk:(r + 1) * chunk].sum()) for r in range(c)]
    keep = np.zeros(v, dtype=bool)
    for r in range(c):
        begin, n = r * chunk, max(0, min(v - r * chunk, chunk))
        local = drop - sum(tied[:r])
        if local <= 0:
            cut = 0
        elif local >= tied[r]:
            cut = 2**31 - 1
        else:
            cut = begin + int(np.nonzero(eq[begin:begin + n])[0][local])
        idx = np.arange(begin, begin + n)
        keep[begin:begin + n] = eq[begin:begin + n] & (idx >= cut)
    return keep


@given(v=st.integers(1, 3000), c=st.sampled_from([2, 4, 8, 16]), density=st.sampled_from([0.001, 0.05, 0.5, 1.0]),
       seed=st.integers(0, 2**31), frac=st.floats(0, 1))
def test_cluster_tie_cut_keeps_the_tied_tokens_from_the_drop_th_on(v, c, density, seed, frac):
    """The cluster kernel's per-CTA cut of the tokens tied at v* keeps, over the whole row, the tied tokens from the
    drop-th (in index order) on: the one-block kernel's and the stable sort's rule. The CTAs' slices cover the row
    in groups of four (the draw's Philox groups never straddle two CTAs)."""
    chunk = _cluster_chunk(v, c)
    assert chunk % 4 == 0 and chunk * c >= v and chunk * (c - 1) < v + 4 * c
    eq = np.random.default_rng(seed).random(v) < density
    count = int(eq.sum())
    if count < 2:
        return
    drop = 1 + int(frac * (count - 2))  # 1 .. count - 1 (the kernel scans only for drop > 0; one always stays)
    pos = np.nonzero(eq)[0]
    want = eq & (np.arange(v) >= pos[drop])
    assert (_cluster_tie_keep(eq, drop, c) == want).all()


@examples("cpu", cpu=40, cuda=0)
@given(case=warp_cases(), c=st.sampled_from([2, 4, 16]))
def test_cluster_emulation_selects_what_the_five_levels_select(case, c):
    """The cluster kernel's algorithm (emulated: skipped levels, the per-CTA tie cut) keeps exactly the tokens the
    one-block kernel's five levels keep and draws the same token (the same bin sums here: skipping a level, or
    stopping at a bin of one key value, must change nothing), and the oracle's and the reference's."""
    rows, params = case
    for r in range(rows.shape[0]):
        x = rows[r].numpy()
        run5, runc = [], []
        t5, k5 = _emulate_kernel_row(x, r, 77, 5, *params, levels_run=run5)
        tc, kc = _emulate_kernel_row(x, r, 77, 5, *params, cluster=c, levels_run=runc)
        assert t5 == tc and (k5 == kc).all(), dict(row=r, params=params, differ=np.nonzero(k5 != kc)[0][:8])
        assert len(runc) == len(run5) and all(1 <= n <= 5 for n in runc)


@pytest.mark.parametrize("v", [5003, 12007])
@pytest.mark.parametrize("params", [(0.7, 50, None, None), (0.7, None, 0.9, None), (1.0, 50, 0.9, None),
                                    (1.0, None, 0.3, 0.05)])
def test_cluster_emulation_on_the_gpu_tests_rows_runs_fewer_levels(v, params):
    """The GPU kernel test's rows (ties at every cut-off) through the emulated cluster kernel: the oracle's kept set,
    the reference's draw, the one-block kernel's choices, and fewer levels than five on most selections."""
    kinds = KINDS + ("fp16", "integers", "normal")
    rows = _rows(kinds, v, torch.Generator().manual_seed(v + (params[1] or 0)))
    run = []
    got = [_emulate_kernel_row(rows[r].numpy(), r, 77, 5, *params, cluster=16, levels_run=run)
           for r in range(rows.shape[0])]
    kept = torch.from_numpy(np.stack([k for _, k in got]))
    _check_kept(kept, rows, params, tol_p=1e-4, kinds=kinds)
    tokens = torch.tensor([t for t, _ in got])
    same = _check_tokens(tokens, kept, rows, torch.tensor([77]), torch.tensor([5]), params, kinds)
    assert same >= rows.shape[0] - 1, dict(v=v, params=params, same=same)
    for r in range(rows.shape[0]):
        t5, k5 = _emulate_kernel_row(rows[r].numpy(), r, 77, 5, *params)
        assert t5 == int(tokens[r]) and (k5 == kept[r].numpy()).all(), dict(row=r, kind=kinds[r])
    assert sum(run) < 5 * len(run) * 0.8, run  # (the skipping saves levels on these rows)
