"""accelerate placement on GPUs: a model dispatched over one or two GPUs with a CPU-offloaded layer, patched, against
the unpatched dispatched model (fp16 rule against fp32) and with fast decode."""
from __future__ import annotations

import copy

import pytest
import torch

import fuseinfer
from conftest import random_opt


def _device_map(layers: int, gpus: int, offload: int | None) -> dict:
    m = {"model.decoder.embed_tokens": 0, "model.decoder.embed_positions": 0, "lm_head": 0,
         "model.decoder.final_layer_norm": gpus - 1}
    m.update({f"model.decoder.layers.{i}": (0 if i < layers // 2 else gpus - 1) for i in range(layers)})
    if offload is not None:
        m[f"model.decoder.layers.{offload}"] = "cpu"
    return m


@pytest.mark.gpu
@pytest.mark.parametrize("gpus,offload", [(1, 1), (2, None)])
def test_dispatched_model_patched_matches_unpatched(gpus, offload):
    from accelerate import dispatch_model

    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    ref = random_opt(seed=0, num_hidden_layers=4, hidden_size=256, num_attention_heads=4, ffn_dim=1024)
    ids = torch.randint(2, 512, (2, 64))
    model = dispatch_model(copy.deepcopy(ref).half(), _device_map(4, gpus, offload))
    with torch.no_grad():
        expected = ref.cuda()(ids.cuda()).logits.float()  # the fp32 reference on one GPU
    with torch.no_grad():
        unpatched = model(ids.cuda()).logits.float()
        report = fuseinfer.patch(model)
        patched = model(ids.cuda()).logits.float()
    assert len(report.swaps) >= 5
    err, base = (patched - expected).abs().max(), (unpatched - expected).abs().max()
    assert err <= 2 * base + 1e-3, (err, base)
    if offload is None:  # fast decode: per op, eager, each layer's cache on its GPU
        out = fuseinfer.generate(model, ids.cuda(), max_new_tokens=8)
        assert out.shape == (2, 72)
        assert "eager" in next(iter(model._fuseinfer_sessions.values())).path
    else:
        assert any("offloaded by accelerate" in why for _, why in report.skipped)
    fuseinfer.unpatch(model)
