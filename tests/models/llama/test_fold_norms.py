"""The Llama family's RMSNorms folded into the next GEMV (``modules.FOLD_NORMS``: input_layernorm into the q/k/v
GEMV, post_attention_layernorm into gate/up, ``ops/norm_linear.py``): the same greedy tokens and logits as with the
norms run on their own, on the CPU (the references: bit for bit) and on CUDA (marked ``gpu``: the GEMV's RMSNorm
prologue, one norm kernel per step left, the final one); the folded ops are the ones called; a hooked MLP keeps its
norm."""
from __future__ import annotations

import pytest
import torch
from helpers import (assert_folded_ops_ran, fold_ids, folded_norm_kernels, folded_op_counts, hooked_module_inputs,
                     load_causal_lm, run_folded)

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
    folded = ("fuseinfer::rms_norm_linear_rope_append", "fuseinfer::rms_norm_linear")
    assert_folded_ops_ran(counts, folded, "fuseinfer::add_rms_norm", layers)


def test_a_hooked_mlp_keeps_its_norm(tiny_llama_path, monkeypatch):
    """A forward hook on an MLP (added after patch) sees the normalised rows with FOLD_NORMS as without: that layer's
    post-attention norm runs on its own."""
    model = load_causal_lm(tiny_llama_path, torch.float32)
    seen = hooked_module_inputs(model, llama_modules, lambda m: m.model.layers[1].mlp, monkeypatch,
                                pre_hook=False)
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
    layers = model.config.num_hidden_layers
    norms, tokens = folded_norm_kernels(model, llama_modules, "RmsNorm", monkeypatch)
    assert norms == {False: 2 * layers + 1, True: 1}, norms
    assert torch.equal(tokens[True], tokens[False])
