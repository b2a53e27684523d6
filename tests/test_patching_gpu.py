"""The extension and the patched model on the GPU. Marked ``gpu``: skipped (and reported as skipped) without one.
Each op's kernels are tested in tests/ops/test_<op>.py.

Low-precision rule (flash-attention's, tests/helpers.py): |ours - ref_fp32| <= 2 * |torch_lowprec - ref_fp32| (max
over the tensor, plus a tiny absolute slack for exact-zero cases), where ref_fp32 runs the reference on the same
inputs upcast to fp32 and torch_lowprec is plain PyTorch in the low-precision dtype.
"""
from __future__ import annotations

import pytest
import torch
from conftest import loss_and_grads, random_opt, traced_by_compile
from helpers import assert_lowp_close, paths_taken, record_kernel_calls, wgmma_available

import fuseinfer

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _seed():
    """Each test's random inputs do not depend on which tests ran before it (a failure reproduces alone)."""
    torch.manual_seed(0)


def test_extension_is_built():
    assert fuseinfer.cuda_extension_available(), fuseinfer.extension_status()
    assert fuseinfer.extension_status(torch.device("cuda")) == "built"  # its kernels load on this GPU


def test_gpu_without_kernels_runs_the_references(monkeypatch):
    """A GPU whose architecture the build left out (simulated): every op runs its reference, and the patch report
    says why instead of a 'no kernel image' error at the first call."""
    from fuseinfer.core import extension as _ext

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
        # (the patched modules: the model's own forward would replay a graph of the lean loop, runtime/forward.py)
        with fuseinfer.runtime.using_runtime(model16, prefill="module"):
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
    attention = "attention.wgmma" if wgmma_available() else "attention.mma_sync"
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
