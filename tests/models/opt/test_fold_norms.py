"""The OPT family's pre-LN LayerNorms folded into the next GEMV (``modules.FOLD_NORMS``: self_attn_layer_norm into the
q/k/v GEMV with its cache write, final_layer_norm into fc1 + ReLU, ``ops/layer_norm_linear.py``), fp32 / bf16 and
int8 weight-only (W8A16): the same greedy tokens and logits as with the norms run on their own, on the CPU (the
references: bit for bit) and on CUDA (marked ``gpu``: the GEMV's LayerNorm prologue, one norm kernel per step left,
the final one); the folded ops are the ones called; a hooked attention keeps its norm."""
from __future__ import annotations

import pytest
import torch
from helpers import (assert_folded_ops_ran, fold_ids, folded_norm_kernels, folded_op_counts, hooked_module_inputs,
                     load_causal_lm, run_folded)

import fuseinfer
from fuseinfer.models.opt import modules as opt_modules

QUANT = {"fp": None, "w8a16": fuseinfer.PatchConfig(quant=fuseinfer.Int8WeightOnly(keep_original="cpu"))}


@pytest.mark.parametrize("quant", ["fp", "w8a16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_folded_norms_change_no_token_on_cpu(tiny_model_path, dtype, quant, monkeypatch):
    model = load_causal_lm(tiny_model_path, dtype)
    ids, mask = fold_ids(model)
    off = run_folded(model, ids, mask, opt_modules, False, monkeypatch, QUANT[quant])
    on = run_folded(model, ids, mask, opt_modules, True, monkeypatch, QUANT[quant])
    assert torch.equal(on[0], off[0])
    assert torch.equal(on[1], off[1])  # the references round alike: bit for bit


@pytest.mark.parametrize("quant", ["fp", "w8a16"])
def test_the_folded_ops_run(tiny_model_path, quant, monkeypatch):
    """With FOLD_NORMS, decoding calls layer_norm_linear_append and layer_norm_linear (once per layer and step) and
    add_layer_norm less often; without, never the folded ops."""
    model = load_causal_lm(tiny_model_path, torch.float32)
    ids, mask = fold_ids(model, rows=1, length=6)
    layers = model.config.num_hidden_layers
    counts = folded_op_counts(model, ids, mask, opt_modules, monkeypatch, QUANT[quant])
    folded = ("fuseinfer::layer_norm_linear_append", "fuseinfer::layer_norm_linear")
    assert_folded_ops_ran(counts, folded, "fuseinfer::add_layer_norm", layers)


def test_a_hooked_attention_keeps_its_norm(tiny_model_path, monkeypatch):
    """A forward pre-hook on an attention module (added after patch) sees the normalised rows with FOLD_NORMS as
    without: that layer's norms run on their own."""
    model = load_causal_lm(tiny_model_path, torch.float32)
    seen = hooked_module_inputs(model, opt_modules, lambda m: m.model.decoder.layers[1].self_attn, monkeypatch,
                                pre_hook=True)
    assert torch.equal(seen[True], seen[False])


# ---- CUDA ----

@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["fp", "w8a16"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_folded_norms_change_no_token_on_cuda(tiny_model_path, dtype, quant, monkeypatch):
    """The GEMV's LayerNorm prologue against the norm kernel then the GEMV: the same greedy tokens (CUDA graphs), and
    one eager decode step's logits over transformers' cache (fc1's norm folded) within a rounding step (the
    prologue's fp32 sums run in another order)."""
    model = load_causal_lm(tiny_model_path, dtype, "cuda")
    ids, mask = fold_ids(model, device="cuda")
    off = run_folded(model, ids, mask, opt_modules, False, monkeypatch, QUANT[quant])
    on = run_folded(model, ids, mask, opt_modules, True, monkeypatch, QUANT[quant])
    assert torch.equal(on[0], off[0])
    torch.testing.assert_close(on[1], off[1], rtol=0, atol=4 * torch.finfo(dtype).eps * off[1].abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["fp", "w8a16"])
def test_a_folded_decode_step_runs_one_norm_kernel(tiny_model_path, quant, monkeypatch):
    """Per-op decode steps (no CUDA graphs, so the profiler sees each kernel; the one-kernel step off) launch the
    final LayerNorm's kernel alone with FOLD_NORMS, 2 per layer + 1 without; the tokens agree."""
    model = load_causal_lm(tiny_model_path, torch.float16, "cuda")
    layers = model.config.num_hidden_layers
    norms, tokens = folded_norm_kernels(model, opt_modules, "LayerNorm", monkeypatch,
                                        None if quant == "fp" else QUANT[quant].quant)
    assert norms == {False: 2 * layers + 1, True: 1}, norms
    assert torch.equal(tokens[True], tokens[False])
