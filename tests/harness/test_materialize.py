"""Big random models: built on meta, each parameter drawn on its device from a (seed, name) generator, so a shard
made alone equals the slice of the whole; the eval's --tp plumbing."""
from __future__ import annotations

import pytest
import torch

from conftest import random_opt
from fuseinfer.harness.errors import EvalError
from fuseinfer.harness.materialize import materialize, meta_model, random_init, random_model


def _config():
    return random_opt().config


def test_random_model_is_seeded_per_name_and_tied():
    a, b = random_model(_config(), torch.float32, "cpu", seed=5), random_model(_config(), torch.float32, "cpu", 5)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q) and not p.is_meta, name
    assert a.lm_head.weight is a.model.decoder.embed_tokens.weight  # tied stays tied
    other = random_model(_config(), torch.float32, "cpu", seed=6)
    assert not torch.equal(other.model.decoder.layers[0].fc1.weight, a.model.decoder.layers[0].fc1.weight)
    ln = a.model.decoder.layers[0].final_layer_norm
    assert ln.weight.mean().item() == pytest.approx(1.0, abs=0.05) and ln.bias.abs().max() > 0
    f16 = random_model(_config(), torch.float16, "cpu", seed=5)  # the same draws, rounded
    torch.testing.assert_close(f16.model.decoder.layers[1].fc2.weight.float(), a.model.decoder.layers[1].fc2.weight,
                               atol=1e-4, rtol=1e-3)


def test_a_shard_is_the_slice_of_the_whole():
    full = random_model(_config(), torch.float32, "cpu", seed=1)
    rows = lambda name: (0, 1, 2) if name.endswith("q_proj.weight") else None  # noqa: E731
    shard = materialize(meta_model(_config(), torch.float32), "cpu", random_init(1), rows)
    q_full, q_shard = full.model.decoder.layers[0].self_attn.q_proj.weight, \
        shard.model.decoder.layers[0].self_attn.q_proj.weight
    assert q_shard.shape == (32, 64) and torch.equal(q_shard, q_full[32:])
    # a shard owns its own storage: a view of the whole parameter would keep the other ranks' slices alive
    assert q_shard.untyped_storage().nbytes() == q_shard.nbytes
    assert all(p.untyped_storage().nbytes() == p.nbytes for p in shard.parameters())
    drop = materialize(meta_model(_config(), torch.float32), "cpu", random_init(1),
                       lambda n: "drop" if n.endswith("fc2.bias") else None)
    assert drop.model.decoder.layers[0].fc2.bias is None


def test_materialize_without_init_says_how():
    from fuseinfer import FuseInferError

    with pytest.raises(FuseInferError, match="no init was given"):
        materialize(meta_model(_config(), torch.float32), "cpu")


def test_eval_tp_needs_torchrun(monkeypatch):
    from fuseinfer.eval.backends.parallel import TensorParallelBackend, tp_backend, tp_device
    from fuseinfer.harness.backends import EagerBackend, FuseInferBackend

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(EvalError, match="torchrun --nproc-per-node 2"):
        tp_device(2, None)
    assert issubclass(tp_backend(FuseInferBackend, 2), TensorParallelBackend)
    assert "only the fuseinfer backend" in tp_backend(EagerBackend, 2).unavailable_reason(torch.device("cpu"))
    assert tp_backend(EagerBackend, 1) is EagerBackend


@pytest.mark.parametrize("name,near_one", [
    ("model.layers.0.input_layernorm.weight", True), ("model.layers.3.post_attention_layernorm.weight", True),
    ("model.norm.weight", True), ("model.decoder.layers.0.self_attn_layer_norm.weight", True),
    ("model.decoder.final_layer_norm.bias", False), ("model.layers.0.mlp.down_proj.weight", False),
    ("model.embed_tokens.weight", False),
])
def test_random_init_puts_every_norm_weight_near_one(name, near_one):
    """RMSNorm weights (Llama's ``*layernorm`` / ``norm``) as well as LayerNorm's: weights near 0 would make a random
    model's activations vanish layer by layer."""
    t = random_init(seed=0)(name, (256,), torch.float32, torch.device("cpu"))
    assert (abs(t.mean().item() - 1.0) < 0.01) == near_one
