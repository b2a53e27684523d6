"""Int8 weight-only (W8A16) models through the lean prefill loop and its CUDA graphs (runtime/prefill.py).

The lean loop runs a W8A16 model's ops in the order its patched modules run them (fp16 LayerNorms, ``w8a16_linear``
for the fused q/k/v, out_proj, fc1 and fc2): the same logits and cache contents bit for bit on CPU, the same op
counts, the same greedy tokens through the lean loop and the modules; a model whose LM head is int8 keeps its
modules. On the GPU: the lean loop and the prefill graph against the modules (kernels), in fp16 and bf16.
"""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import VARIANTS, random_opt
from helpers import (assert_lean_equals_modules, assert_same_tokens_graph_lean_modules,
                     assert_same_tokens_lean_and_modules)

import fuseinfer
from fuseinfer import Int8WeightOnly, PatchConfig
from fuseinfer.runtime import prefill as pf

W8A16_VARIANTS = ["pre_ln", "post_ln_project_in_out", "no_bias", "ln_without_affine", "odd_hidden96_3heads"]


def _w8a16(variant="pre_ln", **kw):
    model = random_opt(**VARIANTS[variant], **kw).eval()
    fuseinfer.patch(model, PatchConfig(quant=Int8WeightOnly()))
    return model


def _ids(vocab, rows=2, length=24):
    return torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(0))




@pytest.mark.parametrize("variant", W8A16_VARIANTS)
def test_lean_loop_takes_w8a16_models_and_equals_the_patched_modules(variant):
    model = _w8a16(variant)
    assert_lean_equals_modules(model, _ids(model.config.vocab_size), "fuseinfer::w8a16_linear")


def test_int8_lm_head_or_swapped_linear_keeps_the_modules():
    model = random_opt().eval()
    fuseinfer.patch(model, PatchConfig(quant=Int8WeightOnly(include_lm_head=True)))
    assert "LM head" in pf.lean_reason(model)
    model = _w8a16()
    assert pf.lean_reason(model) is None  # (the plan is built here, with the patched linears)
    fc2 = model.model.decoder.layers[1].fc2
    model.model.decoder.layers[1].fc2 = copy.deepcopy(fc2)
    assert "int8 linear was replaced" in pf.lean_reason(model)
    model.model.decoder.layers[1].fc2 = fc2
    assert pf.lean_reason(model) is None
    attn = model.model.decoder.layers[0].self_attn  # a q/k/v projection swapped in: the modules run three GEMMs
    q = attn.q_proj
    attn.q_proj = torch.nn.Linear(q.embed_dim, q.embed_dim)
    assert "int8 linear was replaced" in pf.lean_reason(model)
    ids = _ids(model.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(fuseinfer.prefill(model, ids), model(input_ids=ids).logits[:, -1])
    attn.q_proj = q
    assert pf.lean_reason(model) is None


def test_generate_same_tokens_through_lean_and_module_prefill():
    model = _w8a16()
    assert_same_tokens_lean_and_modules(model, _ids(model.config.vocab_size, rows=1, length=20))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_lean_loop_and_graph_equal_the_w8a16_modules(dtype):
    from fuseinfer.runtime.cache import COUNTS

    model = random_opt(hidden_size=256, num_attention_heads=4, ffn_dim=1024, num_hidden_layers=3,
                       max_position_embeddings=512).to("cuda", dtype)
    fuseinfer.patch(model, PatchConfig(quant=Int8WeightOnly()))
    assert pf.lean_reason(model) is None
    for rows, length in ((2, 150), (1, 9)):  # the dequantize + cuBLASLt path and the GEMV (<= 16 rows)
        ids = _ids(model.config.vocab_size, rows=rows, length=length).cuda()
        with torch.no_grad():
            ref = model(input_ids=ids).logits[:, -1].float()
        ours = fuseinfer.prefill(model, ids)
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-2 * ref.abs().max().item())
        assert (ours.argmax(-1) == ref.argmax(-1)).all()
    ids = _ids(model.config.vocab_size, rows=1, length=150).cuda()
    assert_same_tokens_graph_lean_modules(model, ids)
    # a prompt of <= 16 rows runs the GEMV in the modules and the lean loop: no graph (its 128-token bucket would
    # switch the linears to the prefill GEMM)
    short = ids[:, :9]
    fuseinfer.runtime.set_runtime(model, prefill="graph")
    before = COUNTS["prefill_graph"]
    graph_tokens = fuseinfer.generate(model, short, max_new_tokens=4)
    assert COUNTS["prefill_graph"] == before
    fuseinfer.runtime.set_runtime(model, prefill="module")
    assert torch.equal(fuseinfer.generate(model, short, max_new_tokens=4), graph_tokens)
