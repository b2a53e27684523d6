"""The Llama family's RMSNorms folded into the next GEMV (``modules.FOLD_NORMS``: input_layernorm into the q/k/v
GEMV, post_attention_layernorm into gate/up, ``ops/norm_linear.py``): the same greedy tokens and logits as with the
norms run on their own, on the CPU (the references: bit for bit) and on CUDA (marked ``gpu``: the GEMV's RMSNorm
prologue, one norm kernel per step left, the final one); the folded ops are the ones called; a hooked MLP keeps its
norm."""
from __future__ import annotations

import pytest
import torch
from helpers import cuda_kernel_names, fold_ids, folded_op_counts, load_causal_lm, run_folded

import fuseinfer
from fuseinfer.models.llama import modules as llama_modules


def _run(model, ids, mask, fold: bool, monkeypatch):
    """(greedy tokens, one cached decode step's logits) with FOLD_NORMS = fold, through a fresh patch."""
    return run_folded(model, ids, mask, llama_modules, fold, monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_folded_norms_change_no_token_on_cpu(tiny_llama_path, dtype, monkeypatch):
    model = load_causal_lm(tiny_llama_path, dtype)
    ids, mask = fold_ids(model)
    off, on = _run(model, ids, mask, False, monkeypatch), _run(model, ids, mask, True, monkeypatch)
    assert torch.equal(on[0], off[0])
    assert torch.equal(on[1], off[1])  # the references round alike: bit for bit


def test_the_folded_ops_run(tiny_llama_path, monkeypatch):
    """With FOLD_NORMS, decoding calls rms_norm_linear_rope_append and rms_norm_linear (once per layer and step) and
    add_rms_norm less often; without, never the folded ops."""
    model = load_causal_lm(tiny_llama_path, torch.float32)
    ids, mask = fold_ids(model, rows=1, length=6)
    layers = model.config.num_hidden_layers
    counts = folded_op_counts(model, ids, mask, llama_modules, monkeypatch)
    on, off = counts[True], counts[False]
    assert on["fuseinfer::rms_norm_linear_rope_append"] >= 2 * layers, on
    assert on["fuseinfer::rms_norm_linear"] >= 2 * layers, on
    assert off["fuseinfer::rms_norm_linear_rope_append"] == off["fuseinfer::rms_norm_linear"] == 0, off
    folded = on["fuseinfer::rms_norm_linear_rope_append"] + on["fuseinfer::rms_norm_linear"]
    assert off["fuseinfer::add_rms_norm"] - on["fuseinfer::add_rms_norm"] == folded, (on, off)


def test_a_hooked_mlp_keeps_its_norm(tiny_llama_path, monkeypatch):
    """A forward hook on an MLP (added after patch) sees the normalised rows with FOLD_NORMS as without: that layer's
    post-attention norm runs on its own."""
    model = load_causal_lm(tiny_llama_path, torch.float32)
    ids, mask = fold_ids(model, rows=1, length=6)
    seen = {}
    for fold in (False, True):
        monkeypatch.setattr(llama_modules, "FOLD_NORMS", fold)
        monkeypatch.setattr(llama_modules, "FOLD_MAX_ROWS", 16)  # (every decode row count)
        fuseinfer.patch(model)
        handle = model.model.layers[1].mlp.register_forward_hook(
            lambda m, args, out: seen.__setitem__(fold, args[0]))  # noqa: B023
        try:
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask)
        finally:
            handle.remove()
            fuseinfer.unpatch(model)
    assert torch.equal(seen[True], seen[False])


# ---- CUDA ----

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_folded_norms_change_no_token_on_cuda(tiny_llama_path, dtype, monkeypatch):
    """The GEMV's RMSNorm prologue against the norm kernel then the GEMV: the same greedy tokens (CUDA graphs), and
    one eager decode step's logits over transformers' cache (the MLP's norm folded) within a rounding step (the
    prologue's fp32 sum of squares runs in another order)."""
    model = load_causal_lm(tiny_llama_path, dtype, "cuda")
    ids, mask = fold_ids(model, device="cuda")
    off, on = _run(model, ids, mask, False, monkeypatch), _run(model, ids, mask, True, monkeypatch)
    assert torch.equal(on[0], off[0])
    torch.testing.assert_close(on[1], off[1], rtol=0, atol=4 * torch.finfo(dtype).eps * off[1].abs().max().item())


@pytest.mark.gpu
def test_a_folded_decode_step_runs_one_norm_kernel(tiny_llama_path, monkeypatch):
    """Per-op decode steps (no CUDA graphs, so the profiler sees each kernel) launch the final norm's RMSNorm kernel
    alone with FOLD_NORMS, 2 per layer + 1 without; the tokens agree."""
    model = load_causal_lm(tiny_llama_path, torch.float16, "cuda")
    ids, mask = fold_ids(model, rows=2, device="cuda")
    layers = model.config.num_hidden_layers
    config = fuseinfer.PatchConfig(runtime=fuseinfer.RuntimeConfig(cuda_graphs=False, decode_kernel="off"))
    norms, tokens = {}, {}
    for fold in (False, True):
        monkeypatch.setattr(llama_modules, "FOLD_NORMS", fold)
        monkeypatch.setattr(llama_modules, "FOLD_MAX_ROWS", 16)  # (every decode row count)
        fuseinfer.patch(model, config)
        try:
            def gen(n):
                return fuseinfer.generate(model, ids, mask, max_new_tokens=n, min_new_tokens=n, pad_token_id=1)

            gen(3)  # warm-up
            counts = [sum("RmsNorm" in k for k in cuda_kernel_names(lambda: gen(n))) for n in (1, 3)]  # noqa: B023
            tokens[fold] = gen(3)
        finally:
            fuseinfer.unpatch(model)
        norms[fold] = (counts[1] - counts[0]) // 2  # two decode steps
    assert norms == {False: 2 * layers + 1, True: 1}, norms
    assert torch.equal(tokens[True], tokens[False])
