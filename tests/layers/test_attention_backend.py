"""PatchConfig.attention_backend (patches/attention_backend.py) and the flash-attn-4 mapping (ops/flash_attention.py).

CPU: the config, the refusal without the package (model untouched), ``auto``'s choice, the ``sdpa`` backend against
the default, the report, the per-phase dispatch, and the mapping's index arithmetic against an emulation of
flash-attn-4's varlen semantics. GPU (``gpu``; skipped with the reason where flash-attn-4 does not import): the
package through a patched OPT, within the fp16 rule, and greedy tokens equal to the default backend's.
"""
from __future__ import annotations

import pickle

import pytest
import torch
from conftest import random_opt

import fuseinfer
from fuseinfer import FuseInferError, PatchConfig
from fuseinfer.ops import flash_attention as fa_op
from fuseinfer.ops.attention import attention_ref
from fuseinfer.layers import attention_backend as ab


@pytest.fixture
def no_flash_attn(monkeypatch):
    """flash-attn-4 as if not installed, whatever this machine has."""
    monkeypatch.setattr(fa_op, "_fa", None)
    monkeypatch.setattr(fa_op, "_fa_error", "ModuleNotFoundError: No module named 'flash_attn'")


def greedy_loop(model, ids, mask, n: int) -> torch.Tensor:
    """n greedy tokens by forward calls over transformers' DynamicCache (prefill, then one query per step), the path
    the "fuseinfer" attention serves outside fuseinfer.generate (model.generate's fallback to transformers runs the
    model's original attention implementation). Returns (B, n)."""
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        toks = [out.logits[:, -1].argmax(-1, keepdim=True)]  # (B, 1)
        for _ in range(n - 1):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            out = model(input_ids=toks[-1], attention_mask=mask, past_key_values=out.past_key_values, use_cache=True)
            toks.append(out.logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat(toks, 1)


def _padded_ids(b=3, s=12, vocab=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (b, s), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    mask[2, :2] = 0
    return ids, mask


# ---- config ----

def test_config_validates_the_backend():
    for name in ("auto", "fuseinfer", "flash_attn", "sdpa"):
        assert PatchConfig(attention_backend=name).attention_backend == name
    assert PatchConfig().attention_backend == "auto"
    with pytest.raises(FuseInferError, match="unknown PatchConfig.attention_backend 'flash'.*flash_attn"):
        PatchConfig(attention_backend="flash")
    with pytest.raises(FuseInferError, match="attention_backend"):
        PatchConfig(attention_backend=None)


def test_config_pickles_with_its_backend():
    cfg = pickle.loads(pickle.dumps(PatchConfig(ops=("attention",), attention_backend="sdpa")))
    assert cfg.attention_backend == "sdpa" and cfg.ops == ("attention",)


# ---- flash_attn / auto without the package ----

def test_flash_attn_without_the_package_is_refused_and_the_model_untouched(no_flash_attn):
    model = random_opt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    classes = [type(m) for m in model.modules()]
    impl = model.config._attn_implementation
    with pytest.raises(FuseInferError, match=r"flash-attn-4.*pip install fuseinfer\[flash-attn\]"):
        fuseinfer.patch(model, PatchConfig(attention_backend="flash_attn"))
    assert [type(m) for m in model.modules()] == classes
    assert model.config._attn_implementation == impl
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(ab.ATTR in m.__dict__ for m in model.modules())
    assert fuseinfer.patch_state(model) is None
    fuseinfer.patch(model)  # and it patches normally afterwards


def test_flash_attn_without_the_attention_op_needs_no_package(no_flash_attn):
    report = fuseinfer.patch(random_opt(), PatchConfig(ops=("linear",), attention_backend="flash_attn"))
    assert report.attention_backends == {}


def test_auto_without_the_package_runs_our_kernel(no_flash_attn, monkeypatch):
    monkeypatch.setattr(ab, "AUTO_TABLE", {("prefill", 16): "flash_attn", ("decode", 16): "flash_attn"})
    model = random_opt()  # head dim 64 / 4 = 16
    report = fuseinfer.patch(model, PatchConfig(attention_backend="auto"))
    attn = model.model.decoder.layers[0].self_attn
    assert attn.__dict__[ab.ATTR] == {"prefill": "fuseinfer", "decode": "fuseinfer"}
    assert ab.attention_for(attn, 7) is fuseinfer.ops.attention
    assert all(line.startswith("fuseinfer") for line in report.attention_backends.values()), report


def test_auto_with_an_empty_table_does_not_import_the_package(monkeypatch):
    def boom():
        raise AssertionError("auto with an empty AUTO_TABLE imported flash_attn")
    monkeypatch.setattr(ab, "load_flash_attn", boom)
    assert ab.AUTO_TABLE == {}, "AUTO_TABLE rows must come from a committed bench/results measurement"
    assert ab.resolve(PatchConfig(), 64) == {"prefill": "fuseinfer", "decode": "fuseinfer"}


def test_auto_takes_the_package_where_the_table_says_and_it_imports(monkeypatch):
    monkeypatch.setattr(ab, "AUTO_TABLE", {("decode", 64): "flash_attn"})
    monkeypatch.setattr(ab, "load_flash_attn", lambda: (object(), None))
    assert ab.resolve(PatchConfig(), 64) == {"prefill": "fuseinfer", "decode": "flash_attn"}
    assert ab.resolve(PatchConfig(), 128) == {"prefill": "fuseinfer", "decode": "fuseinfer"}


# ---- sdpa backend, report, dispatch ----

def test_sdpa_backend_logits_equal_the_default():
    ids, mask = _padded_ids()
    default, sdpa = random_opt(), random_opt()
    fuseinfer.patch(default)
    fuseinfer.patch(sdpa, PatchConfig(attention_backend="sdpa"))
    with torch.no_grad():
        ref = default(input_ids=ids, attention_mask=mask).logits
        out = sdpa(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()  # (a padded query has no key: each backend gives it its own value, 0 here for both)
    torch.testing.assert_close(out[real], ref[real], rtol=1e-5, atol=1e-5)


def test_report_names_the_backend_per_phase():
    model = random_opt()
    report = fuseinfer.patch(model, PatchConfig(attention_backend="sdpa"))
    assert set(report.attention_backends) == {"prefill", "decode"}
    assert all(v.startswith("sdpa") for v in report.attention_backends.values())
    text = str(report)
    assert "attention prefill: sdpa" in text and "attention decode: sdpa" in text
    default = fuseinfer.patch(random_opt())
    assert all(v.startswith("fuseinfer") and "[auto]" in v for v in default.attention_backends.values()), default
    fuseinfer.unpatch(model)
    assert not any(ab.ATTR in m.__dict__ for m in model.modules())


def test_each_phase_runs_its_backend(monkeypatch):
    """Forward calls over a DynamicCache: the prompt (Sq > 1) runs the prefill backend, each new token (Sq = 1) the
    decode one; and the tokens equal the default backend's."""
    calls = []

    def spy(name):
        impl = ab.IMPLS[name]

        def run(q, k, v, key_mask=None, q_start=None, scale=None):
            calls.append((name, q.shape[2]))
            return impl(q, k, v, key_mask, q_start, scale)
        return run

    monkeypatch.setattr(ab, "IMPLS", {"fuseinfer": spy("fuseinfer"), "sdpa": spy("sdpa")})
    model = random_opt()
    fuseinfer.patch(model, PatchConfig(attention_backend="sdpa"))
    for m in model.modules():  # a mixed assignment, as auto may give
        if ab.ATTR in m.__dict__:
            m.__dict__[ab.ATTR] = {"prefill": "sdpa", "decode": "fuseinfer"}
    ids, mask = _padded_ids(s=6)
    toks = greedy_loop(model, ids, mask, 4)
    layers = model.config.num_hidden_layers
    assert calls[:layers] == [("sdpa", 6)] * layers
    assert calls[layers:] == [("fuseinfer", 1)] * (3 * layers), calls
    default = random_opt()
    fuseinfer.patch(default)
    assert torch.equal(toks, greedy_loop(default, ids, mask, 4))


def test_sdpa_backend_turns_off_the_one_kernel_decode_step():
    from fuseinfer.models.opt import decode as opt_decode

    model = random_opt()
    fuseinfer.patch(model, PatchConfig(attention_backend="sdpa"))
    step, why = opt_decode.decode_step_kernel(model, cache=None)
    assert step is None and "sdpa" in why


def test_fast_generate_with_sdpa_backend_equals_default():
    ids, mask = _padded_ids(s=8)
    outs = []
    for backend in ("fuseinfer", "sdpa"):
        model = random_opt()
        fuseinfer.patch(model, PatchConfig(attention_backend=backend))
        outs.append(fuseinfer.generate(model, ids, mask, max_new_tokens=5))
    assert torch.equal(outs[0], outs[1])


# ---- the flash-attn-4 mapping's arithmetic, against an emulation of the package's varlen semantics ----

class _FakeFlashAttn:
    """flash_attn.cute's two functions as documented (flash_attn/cute/interface.py, seqlen_info.py): batch entry b's
    keys start at cu_seqlens_k[b] (0 when batched) and number seqused_k[b] (else cu_seqlens_k[b+1] - cu_seqlens_k[b]
    or all); causal is bottom-right aligned: query i sees key j iff j <= seqlen_k - seqlen_q + i; a query with no key
    gives 0. q (B, Sq, H, D); k, v (B, Skv, Hk, D) or (total, Hk, D). Returns (out, lse=None)."""

    def __init__(self):
        self.calls = []

    def flash_attn_func(self, q, k, v, softmax_scale=None, causal=False):
        self.calls.append("flash_attn_func")
        return self._run(q, k, v, None, None, softmax_scale, causal), None

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_k=None, seqused_k=None, max_seqlen_k=None,
                               softmax_scale=None, causal=False):
        self.calls.append("flash_attn_varlen_func")
        return self._run(q, k, v, cu_seqlens_k, seqused_k, softmax_scale, causal), None

    @staticmethod
    def _run(q, k, v, cu, used, scale, causal):
        out = torch.zeros_like(q)
        sq = q.shape[1]
        for b in range(q.shape[0]):
            start = 0 if cu is None else int(cu[b])
            if used is not None:
                n = int(used[b])
            else:
                n = k.shape[1] if cu is None else int(cu[b + 1]) - start
            kb = (k[b] if cu is None else k)[start:start + n].float()  # (n, Hk, D)
            vb = (v[b] if cu is None else v)[start:start + n].float()
            s = torch.einsum("qhd,khd->hqk", q[b].float(), kb) * scale  # (H, Sq, n)
            if causal:
                keep = torch.arange(n)[None] <= (n - sq + torch.arange(sq))[:, None]  # (Sq, n)
                s = s.masked_fill(~keep, float("-inf"))
            p = torch.softmax(s, -1).nan_to_num(0.0)  # rows without keys: 0
            out[b] = torch.einsum("hqk,khd->qhd", p, vb).to(q.dtype)
        return out


@pytest.fixture
def fake_fa(monkeypatch):
    fake = _FakeFlashAttn()
    monkeypatch.setattr(fa_op, "_fa", fake)
    monkeypatch.setattr(fa_op, "_fa_error", None)
    monkeypatch.setattr(fa_op, "fa_supports", lambda q: True)
    monkeypatch.setattr(fa_op, "_run_check", None)
    return fake


@pytest.mark.parametrize("sq,skv,q_start,pads", [
    (9, 9, None, None),            # dense prefill
    (1, 20, None, None),           # dense decode
    (3, 32, 10, None),             # static cache, no padding: seqused_k
    (9, 9, None, [0, 4, 9]),       # left-padded prefill, a row without keys
    (1, 20, None, [0, 3, 19]),     # left-padded decode (HF cache)
    (4, 32, 10, [0, 2, 14]),       # left-padded static cache (slots past q_start + Sq unwritten), a row without keys
])
def test_mapping_matches_the_reference(fake_fa, sq, skv, q_start, pads):
    b, h, d = 3, 2, 8
    qkv = torch.randn(b, sq, 3, h, d)
    q = qkv[:, :, 0].transpose(1, 2)  # strided (B, H, Sq, D), as the patched model passes it
    k, v = torch.randn(b, h, skv, d), torch.randn(b, h, skv, d)
    key_mask = None if pads is None else torch.arange(skv)[None] >= torch.tensor(pads)[:, None]
    if key_mask is not None and q_start is not None:
        key_mask[:, q_start + sq:] = True  # generated slots, as fuseinfer.generate's cache marks them
    qs = None if q_start is None else torch.full((b,), q_start, dtype=torch.int32)
    kind, _ = fa_op.plan(q, k, key_mask, qs)
    assert kind == ("dense" if pads is None and q_start is None else "seqused" if pads is None else "runs")
    out = fa_op.flash_attention_cuda(q, k, v, key_mask, qs, d ** -0.5)
    ref = attention_ref(q, k, v, key_mask, qs, d ** -0.5)
    assert out.shape == (b, sq, h, d) and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert fake_fa.calls, "the package was not called"


def test_mapping_sends_masks_with_holes_to_our_op(fake_fa):
    b, h, sq, skv, d = 2, 2, 1, 10, 8
    q, k, v = torch.randn(b, h, sq, d), torch.randn(b, h, skv, d), torch.randn(b, h, skv, d)
    key_mask = torch.ones(b, skv, dtype=torch.bool)
    key_mask[1, 4] = False  # a hole
    kind, why = fa_op.plan(q, k, key_mask, None)
    assert kind is None and "holes" in why
    out = fa_op.flash_attention_cuda(q, k, v, key_mask, None, d ** -0.5)
    torch.testing.assert_close(out, attention_ref(q, k, v, key_mask, None, d ** -0.5), rtol=1e-5, atol=1e-5)
    assert fake_fa.calls == []


def test_run_check_is_redone_after_the_mask_changes(fake_fa):
    key_mask = torch.ones(2, 8, dtype=torch.bool)
    assert fa_op._left_padded(key_mask, None, 1)[0]
    key_mask[0, 3] = False  # in place: a new version of the same tensor
    assert not fa_op._left_padded(key_mask, None, 1)[0]
    exact, lo, hi = fa_op._left_padded(torch.arange(8)[None].expand(2, 8) >= torch.tensor([[2], [8]]), None, 1)
    assert exact and lo.tolist() == [2, 8] and hi.tolist() == [8, 8]
    # q_start advanced by a kernel (no version bump, as fuseinfer.generate's emit_tokens does): never a stale answer
    key_mask = torch.ones(2, 16, dtype=torch.bool)
    key_mask[1, :3] = False
    q_start = torch.full((2,), 5, dtype=torch.int32)
    assert fa_op._left_padded(key_mask, q_start, 1)[2].tolist() == [6, 6]
    q_start.data.fill_(9)
    assert fa_op._left_padded(key_mask, q_start, 1)[2].tolist() == [10, 10]


def test_flash_attention_runs_the_reference_on_cpu():
    q, k, v = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    torch.testing.assert_close(fa_op.flash_attention(q, k, v), attention_ref(q, k, v, None, None, 8 ** -0.5))


# ---- GPU: the package itself ----

def assert_lowp_close(ours, torch_lowp, ref32, what=""):
    """The fp16 rule (tests/test_patching_gpu.py): |ours - ref_fp32| <= 2 * |torch_fp16 - ref_fp32| (+ tiny slack)."""
    ours_err = (ours.float() - ref32).abs().max().item()
    torch_err = (torch_lowp.float() - ref32).abs().max().item()
    assert ours_err <= 2 * torch_err + 1e-6, f"{what}: ours {ours_err:.3g} vs torch {torch_err:.3g}"


def _flash_attn_importable() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    fa, why = fa_op.load_flash_attn()
    return None if fa is not None else f"flash-attn-4 does not import: {why} (pip install fuseinfer[flash-attn])"


needs_fa = pytest.mark.skipif(_flash_attn_importable() is not None, reason=str(_flash_attn_importable()))


def _count_package_calls(monkeypatch) -> list[str]:
    """Record every call into flash_attn.cute's two functions (a silent fallback would pass the numbers)."""
    fa, _ = fa_op.load_flash_attn()
    calls = []
    for name in ("flash_attn_func", "flash_attn_varlen_func"):
        fn = getattr(fa, name)
        monkeypatch.setattr(fa, name, lambda *a, _fn=fn, _n=name, **kw: (calls.append(_n), _fn(*a, **kw))[1])
    return calls


@pytest.mark.gpu
@needs_fa
@pytest.mark.parametrize("heads", [4, 2], ids=["head_dim64", "head_dim128"])
def test_flash_attn_backend_logits_fp16_rule(heads, monkeypatch):
    cfg = dict(hidden_size=256, num_attention_heads=heads, ffn_dim=1024, num_hidden_layers=2, vocab_size=1024,
               max_position_embeddings=512)
    model32 = random_opt(device="cuda", **cfg)
    ids = torch.randint(3, 1024, (3, 131), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :40] = 0  # left padding
    with torch.no_grad():
        ref32 = model32(input_ids=ids, attention_mask=mask).logits
        model16 = model32.half()
        torch16 = model16(input_ids=ids, attention_mask=mask).logits
        report = fuseinfer.patch(model16, PatchConfig(attention_backend="flash_attn"))
        calls = _count_package_calls(monkeypatch)
        ours = model16(input_ids=ids, attention_mask=mask).logits
        padded_calls = len(calls)
        ours_unpadded = model16(input_ids=ids[[0]], attention_mask=mask[[0]]).logits
    assert all(v.startswith("flash_attn") for v in report.attention_backends.values()), str(report)
    assert padded_calls == 2 and calls[:2] == ["flash_attn_varlen_func"] * 2, calls  # the left-padded runs path
    assert calls[2:] == ["flash_attn_func"] * 2, calls  # dense
    real = mask.bool()
    assert_lowp_close(ours[real], torch16[real], ref32[real], f"flash_attn backend, {heads} heads")
    assert_lowp_close(ours_unpadded[0], torch16[0], ref32[0], f"flash_attn backend unpadded, {heads} heads")


@pytest.mark.gpu
@needs_fa
def test_flash_attn_backend_greedy_tokens_equal_default(tiny_model_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[2, 133, 2064, 16, 10, 1539, 6, 5, 1440, 9],
                        [1, 1, 1, 2, 31414, 232, 328, 740, 1140, 12]], device="cuda") % 8192
    mask = (torch.arange(10, device="cuda")[None] >= torch.tensor([[0], [3]], device="cuda")).long()
    out = {}
    for backend in ("fuseinfer", "flash_attn"):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float16).cuda().eval()
        fuseinfer.patch(model, PatchConfig(attention_backend=backend))
        calls = _count_package_calls(monkeypatch) if backend == "flash_attn" else []
        loop = greedy_loop(model, ids, mask, 24)  # eager over a DynamicCache: prefill and decode through the package
        n_loop = len(calls)
        fast = fuseinfer.generate(model, ids, mask, max_new_tokens=24)  # static cache: prefill through the package
        out[backend] = (loop, fast)
        if backend == "flash_attn":  # left-padded row 1: the varlen "runs" path, 4 layers x 24 forwards
            assert calls[:n_loop] == ["flash_attn_varlen_func"] * (4 * 24), calls[:8]
            assert "flash_attn_varlen_func" in calls[n_loop:], calls[n_loop:]
    assert torch.equal(out["flash_attn"][0], out["fuseinfer"][0])
    assert torch.equal(out["flash_attn"][1], out["fuseinfer"][1])


@pytest.mark.gpu
@needs_fa
def test_opcheck_flash_attention():
    q = torch.randn(2, 4, 33, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(2, 4, 33, 64, device="cuda", dtype=torch.float16)
    v = torch.randn(2, 4, 33, 64, device="cuda", dtype=torch.float16)
    key_mask = torch.arange(33, device="cuda")[None] >= torch.tensor([[0], [5]], device="cuda")
    torch.library.opcheck(torch.ops.fuseinfer.flash_attention.default, (q, k, v, key_mask, None, 0.125),
                          test_utils=("test_schema", "test_faketensor"))


def test_bench_auto_table_needs_every_row_of_a_class_won():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import bench_attention

    def row(mode, d, impl, ms, skv=512):
        return dict(mode=mode, B=1, H=1, Sq=1, Skv=skv, D=d, impl=impl, median_ms=ms)
    rows = [row("prefill", 64, "fuseinfer", 2.0), row("prefill", 64, "flash_attn", 1.0),
            row("prefill_padded", 64, "fuseinfer", 2.0), row("prefill_padded", 64, "flash_attn", 1.5),
            row("decode", 64, "fuseinfer", 1.0), row("decode", 64, "flash_attn", 0.5),
            row("decode", 64, "fuseinfer", 1.0, skv=8192), row("decode", 64, "flash_attn", 1.5, skv=8192),
            row("decode", 128, "fuseinfer", 1.0)]  # no flash_attn row: not won
    assert bench_attention.auto_table(rows) == {"prefill,64": "flash_attn"}
