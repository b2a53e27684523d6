"""CUDA kernels and the patched model on the GPU. Marked ``gpu``: skipped (and reported as skipped) without one.

Low-precision rule (flash-attention's): |ours - ref_fp32| <= 2 * |torch_lowprec - ref_fp32| (max over the
tensor, plus a tiny absolute slack for exact-zero cases), where ref_fp32 runs the reference on the same
inputs upcast to fp32 and torch_lowprec is plain PyTorch in the low-precision dtype.
"""
from __future__ import annotations

import pytest
import torch
from conftest import loss_and_grads, random_opt, traced_by_compile

import fuseinfer
from fuseinfer import ops
from fuseinfer.ops.attention import allowed_mask

pytestmark = pytest.mark.gpu
LOWP = [torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _seed():
    """Each test's random inputs do not depend on which tests ran before it (a failure reproduces alone)."""
    torch.manual_seed(0)


def assert_lowp_close(ours, torch_lowp, ref32, what=""):
    ours_err = (ours.float() - ref32).abs().max().item()
    torch_err = (torch_lowp.float() - ref32).abs().max().item()
    assert ours_err <= 2 * torch_err + 1e-6, f"{what}: ours {ours_err:.3g} vs torch {torch_err:.3g}"


def paths_taken(call):
    """call()'s result and the extension's paths it took ({name: calls}, csrc/fuseinfer.h path_counts): a test that
    means to exercise one kernel asserts it, since a silent fallback to another would pass the numerical checks."""
    from fuseinfer._ext import extension
    before = extension().path_counts()
    out = call()
    after = extension().path_counts()
    return out, {name: after[name] - before[name] for name in after if after[name] != before[name]}


def test_extension_is_built():
    assert fuseinfer.cuda_extension_available(), fuseinfer.extension_status()
    assert fuseinfer.extension_status(torch.device("cuda")) == "built"  # its kernels load on this GPU


def record_kernel_calls(monkeypatch) -> list[str]:
    """The list that the extension's kernel entry points append their names to while the test runs."""
    from fuseinfer import _ext

    class Recording:  # the loaded extension, noting every kernel an op calls
        def __init__(self, ext):
            self.ext = ext

        def __getattr__(self, name):
            attr = getattr(self.ext, name)
            if name not in ("add_layer_norm", "linear_epilogue", "attention", "kv_cache_append", "decode_step",
                            "emit_tokens"):
                return attr
            return lambda *args, **kwargs: calls.append(name) or attr(*args, **kwargs)

    calls = []
    monkeypatch.setattr(_ext, "_ext", Recording(_ext.extension()))
    return calls


def test_gpu_without_kernels_runs_the_references(monkeypatch):
    """A GPU whose architecture the build left out (simulated): every op runs its reference, and the patch report
    says why instead of a 'no kernel image' error at the first call."""
    from fuseinfer import _ext

    calls = record_kernel_calls(monkeypatch)
    monkeypatch.setattr(_ext, "_no_kernels", {torch.cuda.current_device(): "no kernels for this test's GPU"})
    model = random_opt(dtype=torch.float16, device="cuda")
    ids = torch.randint(3, model.config.vocab_size, (2, 17), device="cuda")
    ref = model(ids).logits
    report = fuseinfer.patch(model)
    assert "no kernels for this test's GPU" in report.extension
    assert {b for s in report.swaps for b in s.ops.values()} <= {"reference", "sdpa (no fuseinfer kernels here)"}
    torch.testing.assert_close(model(ids).logits, ref, rtol=2e-2, atol=2e-2)
    assert fuseinfer.generate(model, ids, max_new_tokens=3).shape == (2, 20)  # the fast path, per op, too
    assert calls == []


# ---- residual add + LayerNorm ----

LN_SHAPES = [(113, 123), (3, 5, 96), (9, 256), (64, 2048), (5, 5120), (7, 4097), (2, 16384)]


@pytest.mark.parametrize("shape", LN_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, *LOWP])
@pytest.mark.parametrize("residual,affine", [(True, True), (False, True), (True, False)])
def test_add_layer_norm_kernel(shape, dtype, residual, affine):
    n = shape[-1]
    x = torch.randn(shape, device="cuda", dtype=dtype)
    r = torch.randn(shape, device="cuda", dtype=dtype) if residual else None
    w = torch.randn(n, device="cuda", dtype=dtype) if affine else None
    b = torch.randn(n, device="cuda", dtype=dtype) if affine else None
    y, s = ops.add_layer_norm(x, r, w, b, 1e-5, store_sum=True)
    torch.testing.assert_close(s, x if r is None else x + r, rtol=0, atol=0)  # one rounding, like torch
    up = lambda t: None if t is None else t.float()  # noqa: E731
    ref32 = ops.add_layer_norm_ref(up(x), up(r), up(w), up(b), 1e-5, False)[0]
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref32, rtol=1e-5, atol=1e-5)
    else:
        assert_lowp_close(y, ops.add_layer_norm_ref(x, r, w, b, 1e-5, False)[0], ref32, "layer_norm")
    assert ops.add_layer_norm(x, r, w, b, 1e-5, store_sum=False)[1].numel() == 0


# ---- GEMM with fused epilogues ----

# M <= 16 runs the skinny kernel: one n-tile (M <= 8) and two (M 9-16), a partial last k-block (K = 96,
# 1000), more 16-row tiles than SMs (N = 4000, 6144) and many k-blocks per warp (K = 8192).
@pytest.mark.parametrize("mnk", [(1, 2048, 2048), (7, 123, 96), (16, 6144, 2048), (12, 4000, 1000),
                                 (3, 2056, 8192), (113, 6144, 2048), (2048, 8192, 2048), (32, 2048, 8192)])
@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("epilogue", ["bias", "bias_relu", "bias_residual", "none"])
def test_linear_epilogue_kernel(mnk, dtype, epilogue):
    m, n, k = mnk
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype) * k ** -0.5
    b = torch.randn(n, device="cuda", dtype=dtype) if epilogue != "none" else None
    r = torch.randn(m, n, device="cuda", dtype=dtype) if epilogue == "bias_residual" else None
    act = "relu" if epilogue == "bias_relu" else "none"
    ours, paths = paths_taken(lambda: ops.linear_epilogue(x, w, b, r, act))
    if m <= 16:
        assert paths == {"linear.skinny": 1}, paths
    else:
        assert sum(paths.values()) == 1 and set(paths) <= {"linear.lt_heuristic", "linear.lt_tuned",
                                                            "linear.lt_cached"}, paths
    up = lambda t: None if t is None else t.float()  # noqa: E731
    ref32 = ops.linear_epilogue_ref(x.float(), w.float(), up(b), up(r), act)
    assert_lowp_close(ours, ops.linear_epilogue_ref(x, w, b, r, act), ref32, f"linear {mnk} {epilogue}")


@pytest.mark.parametrize("m", [1, 16])
def test_linear_chain_waits_for_its_input(m):
    """Each GEMV reads the previous one's output (x and residual). Under PDL the next kernel starts before the
    previous ends, so a missing wait would read stale inputs: the chain must meet the low-precision rule against
    the fp32 chain, eagerly and replayed in a CUDA graph (which must also match the eager run bit for bit)."""
    torch.manual_seed(0)
    ws = [torch.randn(2048, 2048, device="cuda", dtype=torch.float16) * 0.5 * 2048 ** -0.5 for _ in range(12)]
    x = torch.randn(m, 2048, device="cuda", dtype=torch.float16)

    def chain(h, linear):
        for w in ws:
            h = linear(h, w)
        return h

    ours = lambda h, w: ops.linear_epilogue(h, w, None, h)  # noqa: E731
    torch_lowp = chain(x, lambda h, w: torch.nn.functional.linear(h, w) + h)
    ref32 = chain(x.float(), lambda h, w: torch.nn.functional.linear(h, w.float()) + h)
    eager = chain(x, ours)
    assert_lowp_close(eager, torch_lowp, ref32, f"linear chain m={m}")
    static_x = x.clone()
    chain(static_x, ours)  # warm-up before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(static_x, ours)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


def test_gemv_requests_its_weights_before_the_pdl_wait():
    """The skinny GEMV's first two k-blocks of weights are loaded before griddepcontrol.wait (ACQBULK in sm_90
    SASS), so that they stream while the kernel before finishes. ptxas once sank the first k-block's loads below the
    wait after an unrelated source change in the epilogue (4-13 points of copy lost, docs/notes.md); this reads the built
    kernels' SASS so that such a change fails here and not only in a benchmark."""
    import re
    import shutil
    import subprocess
    from pathlib import Path

    from torch.utils.cpp_extension import CUDA_HOME

    import fuseinfer._C

    cuobjdump = shutil.which("cuobjdump") or (CUDA_HOME and shutil.which(str(Path(CUDA_HOME) / "bin" / "cuobjdump")))
    if not cuobjdump:
        pytest.skip("cuobjdump not found (CUDA toolkit bin not on PATH)")
    sass = subprocess.run([cuobjdump, "-sass", fuseinfer._C.__file__], capture_output=True, text=True,
                          check=True).stdout
    kernels, arch, name = {}, 0, None  # mangled name -> its SASS lines, for sm_90 and later
    for line in sass.splitlines():
        if m := re.search(r"arch = sm_(\d+)", line):
            arch, name = int(m.group(1)), None
        elif m := re.search(r"Function : (\S+)", line):
            name = m.group(1) if arch >= 90 and "skinny_linear_kernel" in m.group(1) else None
            if name:
                kernels[name] = []
        elif name:
            kernels[name].append(line)
    assert len(kernels) == 8, sorted(kernels)  # {fp16, bf16} x {one, two n-tiles} x {TAIL, not}
    for name, lines in kernels.items():
        n_tiles = int(re.search(r"skinny_linear_kernelI\w+?Li([12])ELb[01]E", name).group(1))
        wait = next((i for i, line in enumerate(lines) if "ACQBULK" in line), None)
        assert wait is not None, f"{name}: no griddepcontrol.wait (ACQBULK) in its SASS"
        loads = sum("LDG.E.NA." in line for line in lines[:wait])  # w's L1-bypassing loads; x's are LDG.E.128
        unroll = 4 if n_tiles == 1 else 2  # skinny_unroll: k-steps per k-block, two 16-byte loads per k-step
        assert loads >= 2 * 2 * unroll, f"{name}: {loads} weight loads before the wait, want {4 * unroll}"


@pytest.mark.parametrize("tune", ["1", "0"])
def test_linear_prefill_algorithm_choice(tune, set_knob):
    """A prefill-sized problem's cuBLASLt algorithm is chosen at its first call: timed among the heuristic's
    candidates when that call is eager (FUSEINFER_GEMM_TUNE on), the heuristic's first choice under CUDA-graph
    capture (where timing would break the capture) or with tuning off. Each problem here is new to the process
    (M differs per parameter): first seen inside a capture, which must succeed and replay correctly, then eagerly,
    where it is tuned (or not) and must meet the low-precision rule as well."""
    set_knob("FUSEINFER_GEMM_TUNE", tune)
    torch.manual_seed(1)
    m, n, k = (777 if tune == "1" else 779), 1024, 1536
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    w = torch.randn(n, k, device="cuda", dtype=torch.float16) * k ** -0.5
    b = torch.randn(n, device="cuda", dtype=torch.float16)
    r = torch.randn(m, n, device="cuda", dtype=torch.float16)
    ref32 = ops.linear_epilogue_ref(x.float(), w.float(), b.float(), r.float(), "none")
    torch_lowp = ops.linear_epilogue_ref(x, w, b, r, "none")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, paths = paths_taken(lambda: ops.linear_epilogue(x, w, b, r, "none"))
    assert paths == {"linear.lt_captured": 1}, paths  # first choice, not cached: the eager call below chooses
    graph.replay()
    torch.cuda.synchronize()
    assert_lowp_close(captured, torch_lowp, ref32, f"linear m={m} captured first")
    eager, paths = paths_taken(lambda: ops.linear_epilogue(x, w, b, r, "none"))
    assert paths == {"linear.lt_tuned" if tune == "1" else "linear.lt_heuristic": 1}, paths
    assert_lowp_close(eager, torch_lowp, ref32, f"linear m={m} eager, tune={tune}")
    again, paths = paths_taken(lambda: ops.linear_epilogue(x, w, b, r, "none"))
    assert paths == {"linear.lt_cached": 1}, paths
    assert torch.equal(again, eager)


# ---- attention ----

def _attn_case(b, h, sq, skv, d, dtype, pads=None, q_start=None, strided_q=False, nan_from=None):
    if strided_q:  # q as a view into a fused (B, S, 3, H, D) projection, like the patched OPT produces
        qkv = torch.randn(b, sq, 3, h, d, device="cuda", dtype=dtype)
        q = qkv[:, :, 0].transpose(1, 2)
    else:
        q = torch.randn(b, h, sq, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(b, h, skv, d, device="cuda", dtype=dtype) for _ in range(2))
    if nan_from is not None:  # cache slots past the chunk: never written, may hold anything (must not be used)
        k[:, :, nan_from:] = float("nan")
        v[:, :, nan_from:] = float("nan")
    key_mask = None
    if pads is not None:
        key_mask = torch.arange(skv, device="cuda")[None] >= torch.tensor(pads, device="cuda")[:, None]
    qs = None if q_start is None else torch.tensor(q_start, device="cuda", dtype=torch.int32).expand(b).contiguous()
    return q, k, v, key_mask, qs


ATTN_CASES = {
    "prefill_113_pad": dict(b=3, h=4, sq=113, skv=113, pads=[0, 5, 100]),
    "prefill_2048": dict(b=2, h=8, sq=2048, skv=2048),
    "prefill_2048_pad_strided": dict(b=2, h=4, sq=2048, skv=2048, pads=[0, 1000], strided_q=True),
    "chunk_16_after_cache": dict(b=2, h=4, sq=16, skv=700, pads=[3, 0]),
    "decode_1_ctx_8192": dict(b=8, h=8, sq=1, skv=8192),
    "decode_1_pad": dict(b=3, h=4, sq=1, skv=333, pads=[0, 17, 300]),
    "decode_4_static_cache": dict(b=2, h=4, sq=4, skv=1024, q_start=500, pads=[0, 9]),
    "empty_rows": dict(b=2, h=2, sq=64, skv=64, pads=[40, 0]),
    "prefill_259_into_cache_nan_tail": dict(b=2, h=3, sq=259, skv=1024, q_start=300, pads=[0, 7], nan_from=559),
    "prefill_200_into_cache_nan_tail": dict(b=1, h=2, sq=200, skv=512, q_start=100, nan_from=300),
    # per-row q_start, one negative: row 0's first 100 queries see no key, whole warpgroups compute nothing
    "prefill_300_q_start_per_row": dict(b=2, h=3, sq=300, skv=300, q_start=[-100, 50]),
    # more work items than SMs: each block of the persistent wgmma prefill runs several, each with a NaN tail
    "prefill_384_many_items_nan_tail": dict(b=3, h=40, sq=384, skv=640, q_start=200, pads=[0, 33, 250],
                                            nan_from=584),
}


def _wgmma_available() -> bool:
    return torch.cuda.get_device_capability() == (9, 0) and fuseinfer.cuda_extension_available()


def test_wgmma_prefill_is_built_for_sm90():
    """On an H100/H200 the default build (FUSEINFER_CUDA_ARCH=9.0a) must carry the wgmma prefill and pick it."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma prefill is for sm_90 GPUs")
    from fuseinfer._ext import extension
    assert extension().attention_prefill_kernel() == "wgmma"


def _attention_paths():
    """(case, kernel): cases of more than 16 queries run a prefill kernel, wgmma or mma.sync; the others split-KV."""
    for case in sorted(ATTN_CASES):
        paths = ("wgmma", "mma_sync") if ATTN_CASES[case]["sq"] > 16 else ("split_kv",)
        yield from ((case, path) for path in paths)


@pytest.mark.parametrize("case,path", list(_attention_paths()))
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", LOWP)
def test_attention_kernel(case, path, d, dtype, set_knob):
    if path == "wgmma" and not _wgmma_available():
        pytest.skip("the wgmma prefill needs an sm_90 GPU")
    set_knob("FUSEINFER_ATTN_SM90", "0" if path == "mma_sync" else "1")
    q, k, v, key_mask, q_start = _attn_case(d=d, dtype=dtype, **ATTN_CASES[case])
    b, h, sq, _ = q.shape
    scale = d ** -0.5
    ours, paths = paths_taken(lambda: ops.attention(q, k, v, key_mask, q_start, scale))  # (B, Sq, H, D)
    assert paths == {f"attention.{path}": 1}, paths
    assert ours.shape == (b, sq, h, d) and ours.is_contiguous()
    k, v = k.nan_to_num(0.0), v.nan_to_num(0.0)  # the references multiply masked-out NaN slots by 0
    ref32 = ops.attention_ref(q.float(), k.float(), v.float(), key_mask, q_start, scale)
    allowed = allowed_mask(key_mask, q_start, b, sq, k.shape[2], q.device)  # (B, 1, Sq, Skv)
    has_key = allowed.any(-1).view(b, sq)  # (B, Sq)
    assert ours[~has_key].abs().max().item() == 0 if (~has_key).any() else True
    torch_lowp = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    torch_lowp = torch_lowp.transpose(1, 2)
    assert_lowp_close(ours[has_key], torch_lowp[has_key], ref32[has_key], case)


# ---- custom-op registrations on CUDA ----

def _opcheck_cases():
    dev = dict(device="cuda", dtype=torch.float16)
    attn = _attn_case(2, 4, 9, 9, 64, torch.float16, pads=[0, 3])  # q, k, v, key_mask, q_start
    return {
        "add_layer_norm": (torch.ops.fuseinfer.add_layer_norm.default,
                           (torch.randn(5, 123, **dev), torch.randn(5, 123, **dev), torch.randn(123, **dev),
                            torch.randn(123, **dev), 1e-5, True)),
        "add_layer_norm_strided": (torch.ops.fuseinfer.add_layer_norm.default,  # the outputs are contiguous
                                   (torch.randn(6, 5, 64, **dev).transpose(0, 1), None, torch.randn(64, **dev),
                                    torch.randn(64, **dev), 1e-5, True)),
        "linear_epilogue_strided_weight": (torch.ops.fuseinfer.linear_epilogue.default,  # runs the reference
                                           (torch.randn(3, 96, **dev), torch.randn(96, 128, **dev).t(),
                                            torch.randn(128, **dev), torch.randn(3, 128, **dev), "none")),
        "linear_epilogue": (torch.ops.fuseinfer.linear_epilogue.default,
                            (torch.randn(7, 96, **dev), torch.randn(128, 96, **dev), torch.randn(128, **dev),
                             None, "relu")),
        "attention": (torch.ops.fuseinfer.attention.default,
                      (*_attn_case(2, 4, 9, 9, 64, torch.float16, pads=[0, 3])[:4], None, 0.125)),
        # inputs that need gradients: the kernels' forward, the references' gradients
        "add_layer_norm_grad": (torch.ops.fuseinfer.add_layer_norm.default,
                                tuple(torch.randn(*s, **dev).requires_grad_() for s in ((5, 123), (5, 123), (123,),
                                                                                        (123,))) + (1e-5, True)),
        "linear_epilogue_grad": (torch.ops.fuseinfer.linear_epilogue.default,
                                 tuple(torch.randn(*s, **dev).requires_grad_() for s in ((7, 96), (128, 96), (128,),
                                                                                         (7, 128))) + ("none",)),
        "attention_grad": (torch.ops.fuseinfer.attention.default,
                           (*(t.requires_grad_() for t in attn[:3]), attn[3], None, 0.125)),
    }


@pytest.mark.parametrize("name", ["add_layer_norm", "add_layer_norm_strided", "linear_epilogue",
                                  "linear_epilogue_strided_weight", "attention", "add_layer_norm_grad",
                                  "linear_epilogue_grad", "attention_grad"])
def test_opcheck_cuda(name):
    op, args = _opcheck_cases()[name]
    torch.library.opcheck(op, args)


# ---- the patched model on CUDA ----

@pytest.mark.parametrize("variant", [{}, dict(do_layer_norm_before=False, word_embed_proj_dim=256)])
def test_patched_opt_fp16_logits_on_cuda(variant):
    cfg = dict(hidden_size=512, num_attention_heads=8, ffn_dim=2048, num_hidden_layers=4, vocab_size=4096,
               max_position_embeddings=1024, **variant)
    model32 = random_opt(device="cuda", **cfg)
    ids = torch.randint(3, 4096, (3, 257), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :100] = 0  # left padding in row 1
    with torch.no_grad():
        ref32 = model32(input_ids=ids, attention_mask=mask).logits
        model16 = model32.half()
        torch16 = model16(input_ids=ids, attention_mask=mask).logits
        report = fuseinfer.patch(model16)
        ours, paths = paths_taken(lambda: model16(input_ids=ids, attention_mask=mask).logits)
    assert report.backends == {op: {"cuda"} for op in fuseinfer.OPS}, str(report)
    assert _kernel_calls(paths) == _layer_kernel_calls(4), paths
    real = mask.bool()
    assert_lowp_close(ours[real], torch16[real], ref32[real], "patched opt fp16")


def test_patched_model_backward_on_cuda():
    """Patched, in eval mode, without torch.no_grad(): the kernels run the forward and the references' gradients
    flow back (the eager fast path, which calls the extension directly and records no graph, is not taken). fp32
    gradients equal the unpatched model's; fp16 ones are within twice PyTorch fp16's error of the fp32 ones."""
    cfg = dict(hidden_size=256, num_attention_heads=4, ffn_dim=1024, num_hidden_layers=2, vocab_size=1024,
               max_position_embeddings=512)
    ids = torch.randint(3, 1024, (2, 67), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :9] = 0

    def grads(dtype, patched):
        model = random_opt(device="cuda", dtype=dtype, **cfg)
        if patched:
            report = fuseinfer.patch(model)
            assert "cuda" in report.backends["linear"], str(report)
        else:
            model.config._attn_implementation = "eager"
        return torch.cat([g.flatten().float() for g in loss_and_grads(model, ids, mask)[1].values()])

    ref32 = grads(torch.float32, False)
    torch.testing.assert_close(grads(torch.float32, True), ref32, rtol=1e-3, atol=1e-5)
    assert_lowp_close(grads(torch.float16, True), grads(torch.float16, False), ref32, "fp16 gradients")


def test_greedy_generation_fp16_tiny_model_identical(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float16).cuda().eval()
    ids = torch.tensor([[2, 133, 2064, 16, 10, 1539, 6, 5, 1440, 9]], device="cuda") % 8192
    kwargs = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False)
    ref = model.generate(ids, **kwargs)
    fuseinfer.patch(model)
    assert torch.equal(model.generate(ids, **kwargs), ref)


def _kernel_calls(paths):
    """Attention and linear calls by kernel, from paths_taken (the cuBLASLt paths counted together)."""
    calls = {}
    for name, n in paths.items():
        kernel = "linear.cublaslt" if name.startswith("linear.lt_") else name
        calls[kernel] = calls.get(kernel, 0) + n
    return calls


def _layer_kernel_calls(layers):
    """What a patched OPT's prefill forward (more than 16 tokens) runs: per layer one attention prefill (the wgmma
    one on sm_90) and four cuBLASLt GEMMs (q/k/v fused, out_proj, fc1, fc2)."""
    attention = "attention.wgmma" if _wgmma_available() else "attention.mma_sync"
    return {attention: layers, "linear.cublaslt": 4 * layers}


def test_patched_model_under_cuda_graphs_and_compile():
    """The compiled graph calls the kernels' registered ops, which run the kernels; compiled with CUDA graphs, the
    logits are eager's."""
    model = random_opt(device="cuda", dtype=torch.float16, hidden_size=256, ffn_dim=1024)
    ids = torch.randint(3, 512, (2, 64), device="cuda")
    with torch.no_grad():
        fuseinfer.patch(model)
        eager = model(input_ids=ids).logits
        (_, code), paths = paths_taken(lambda: traced_by_compile(model, input_ids=ids))
        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        for _ in range(3):  # warm-up, record, replay
            out = compiled(input_ids=ids).logits
    for op in ("linear_epilogue", "add_layer_norm", "attention"):
        assert f"torch.ops.fuseinfer.{op}" in code, op
    assert _kernel_calls(paths) == _layer_kernel_calls(model.config.num_hidden_layers), paths
    torch.testing.assert_close(out, eager, rtol=2e-3, atol=2e-3)


def test_eager_fast_path_equals_registered_op(monkeypatch):
    """The op wrappers call the extension directly in eager mode; the dispatcher path must run the same kernel
    and give the same bits."""
    calls = record_kernel_calls(monkeypatch)
    x, r = torch.randn(9, 2048, device="cuda", dtype=torch.float16), torch.randn(9, 2048, device="cuda",
                                                                                 dtype=torch.float16)
    w, b = torch.randn(2048, device="cuda", dtype=torch.float16), torch.randn(2048, device="cuda",
                                                                              dtype=torch.float16)
    for direct, registered in zip(ops.add_layer_norm(x, r, w, b, 1e-5, True),
                                  torch.ops.fuseinfer.add_layer_norm(x, r, w, b, 1e-5, True)):
        assert torch.equal(direct, registered)
    wl = torch.randn(512, 2048, device="cuda", dtype=torch.float16)
    assert torch.equal(ops.linear_epilogue(x, wl, None, None, "relu"),
                       torch.ops.fuseinfer.linear_epilogue(x, wl, None, None, "relu"))
    q, k, v, key_mask, q_start = _attn_case(2, 4, 33, 33, 64, torch.float16, pads=[0, 5])
    assert torch.equal(ops.attention(q, k, v, key_mask, q_start, 0.125),
                       torch.ops.fuseinfer.attention(q, k, v, key_mask, q_start, 0.125))
    assert calls == ["add_layer_norm"] * 2 + ["linear_epilogue"] * 2 + ["attention"] * 2


def test_ops_take_the_reference_for_fp64(monkeypatch):
    """fp64 inputs, which the kernels do not take, run the reference on CUDA instead of failing in the extension."""
    calls = record_kernel_calls(monkeypatch)
    x64, w64 = torch.randn(9, 256, device="cuda", dtype=torch.float64), torch.randn(64, 256, device="cuda",
                                                                                  dtype=torch.float64)
    torch.testing.assert_close(ops.linear_epilogue(x64, w64), x64 @ w64.T)
    torch.testing.assert_close(ops.add_layer_norm(x64, x64)[0], torch.nn.functional.layer_norm(2 * x64, (256,)))
    assert calls == []


@pytest.mark.parametrize("dtype,d", [(torch.float32, 64), (torch.float16, 32)])
def test_attention_without_kernel_falls_back_to_sdpa_on_cuda(dtype, d, monkeypatch):
    q, k, v, key_mask, q_start = _attn_case(3, 4, 37, 37, d, dtype, pads=[0, 5, 36])
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))
    out = ops.attention(q, k, v, key_mask, q_start, d ** -0.5)
    assert calls == [1], "the fallback must run SDPA (once), not the kernel or the reference"
    ref32 = ops.attention_ref(q.float(), k.float(), v.float(), key_mask, q_start, d ** -0.5)
    assert torch.isfinite(out).all() and out[2, :36].abs().max() == 0  # row 2: queries before its only key
    torch.testing.assert_close(out.float(), ref32, rtol=2e-3 if dtype == torch.float16 else 1e-5,
                               atol=2e-3 if dtype == torch.float16 else 1e-5)
