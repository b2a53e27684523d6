"""The one-graph beam search's cache reorder on the GPU: it takes ``fuseinfer::kv_reorder`` (only the slots written so
far, only the rows that change parent) and its tokens equal those of the gather / scatter of every generated slot
(``beam.REORDER_KERNEL = False``) bit for bit, with and without CUDA graphs, for OPT and Llama (GQA) models."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import random_llama, random_opt
from helpers import require_kernel

import fuseinfer
from fuseinfer.runtime import beam
from fuseinfer.runtime.cache import COUNTS

pytestmark = pytest.mark.gpu

MODELS = {
    "opt": lambda: random_opt(dtype=torch.float16, device="cuda", hidden_size=256, num_attention_heads=4,
                              ffn_dim=512, vocab_size=1024, num_hidden_layers=3),
    "llama": lambda: random_llama(dtype=torch.float16, device="cuda", hidden_size=256, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=512, vocab_size=1024, num_hidden_layers=3),
}


@pytest.mark.parametrize("family", sorted(MODELS))
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("batch,beams", [(1, 4), (3, 2)])
def test_kernel_reorder_equals_the_gather(family, graphs, batch, beams, monkeypatch):
    require_kernel()
    from fuseinfer.ops.kv_reorder import available
    assert available(torch.device("cuda")), "the built extension has no kv_reorder kernel (rebuild it)"
    base = MODELS[family]()
    kernel, gather = copy.deepcopy(base), copy.deepcopy(base)
    runtime = fuseinfer.RuntimeConfig(cuda_graphs=graphs)
    for m in (kernel, gather):
        fuseinfer.patch(m, fuseinfer.PatchConfig(runtime=runtime))
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, 1024, (batch, 19), generator=g).cuda()
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :6] = 0
    kw = dict(attention_mask=mask, do_sample=False, num_beams=beams, max_new_tokens=40, min_new_tokens=40)
    before = COUNTS["beam_reorder_kernel"]
    ours = kernel.generate(ids, **kw)
    assert COUNTS["beam_reorder_kernel"] == before + 1
    monkeypatch.setattr(beam, "REORDER_KERNEL", False)
    before = COUNTS["beam_reorder_gather"]
    ref = gather.generate(ids, **kw)
    assert COUNTS["beam_reorder_gather"] == before + 1
    assert torch.equal(ours, ref)
    monkeypatch.setattr(beam, "REORDER_KERNEL", True)
    assert torch.equal(kernel.generate(ids, **kw), ours)  # a second call over the same (replayed) program
