"""fuseinfer.patch on models placed by accelerate: hooked modules run fused under their hooks, offloaded ones are
skipped with the reason, unpatch restores the hooks exactly; fast decode on hooked and offloaded models."""
from __future__ import annotations

import copy

import pytest
import torch

import fuseinfer
from fuseinfer.core import placement
from fuseinfer.runtime.cache import SplitKVCache
from conftest import random_opt

accelerate_hooks = pytest.importorskip("accelerate.hooks")


def _model(layers=3):
    model = random_opt(seed=0, num_hidden_layers=layers)
    with torch.no_grad():  # non-zero biases, so a bias added twice or not at all shows
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.add_(0.05 * torch.randn_like(p))
    return model


def _hook(module, **kwargs):
    accelerate_hooks.add_hook_to_module(module, accelerate_hooks.AlignDevicesHook(execution_device="cpu", **kwargs))


def _placed(model, offload_layer: int | None = 1):
    """Hooks as dispatch_model places them: one AlignDevicesHook per block (CPU execution device), the final
    LayerNorm hooked on its own, and (offload_layer) a layer offloaded to a weights map."""
    layers = model.model.decoder.layers
    for i, layer in enumerate(layers):
        _hook(layer, io_same_device=i == 0, place_submodules=True)
    _hook(model.model.decoder.final_layer_norm)
    if offload_layer is not None:
        layer = layers[offload_layer]
        weights = {k: v.clone() for k, v in layer.state_dict().items()}
        accelerate_hooks.attach_align_device_hook(layer, execution_device="cpu", offload=True, weights_map=weights)
    return model


def _hook_state(model):
    return {name: (m.__dict__.get("_hf_hook"), m.__dict__.get("_old_forward"), m.__dict__.get("forward"), type(m))
            for name, m in model.named_modules()}


def test_hooked_and_offloaded_layers_are_patched_and_unpatched_exactly():
    plain = _model()
    model = _placed(copy.deepcopy(plain))
    ids = torch.randint(2, 512, (2, 11))
    expected = plain(ids).logits
    assert model.model.decoder.layers[1].fc1.weight.is_meta  # offloaded: on meta between calls
    before = _hook_state(model)
    report = fuseinfer.patch(model)
    swapped = {s.name for s in report.swaps}
    assert {"model.decoder.layers.0", "model.decoder.layers.2", "model.decoder.layers.0.self_attn",
            "model.decoder.final_layer_norm"} <= swapped
    skipped = dict(report.skipped)
    assert "model.decoder.layers.1" not in swapped and "offloaded by accelerate (cpu)" in skipped[
        "model.decoder.layers.1"]
    assert "fused q/k/v buffer" in skipped["model.decoder.layers.1.self_attn"]
    assert report.placement["model.decoder.layers.0"] == "cpu"
    assert report.placement["model.decoder.layers.1"] == "cpu, offloaded to cpu"
    assert "placement (accelerate)" in str(report)
    layer0 = model.model.decoder.layers[0]
    assert layer0._old_forward.__func__ is type(layer0).forward  # the hook calls the fused forward
    torch.testing.assert_close(model(ids).logits, expected, atol=1e-5, rtol=1e-5)
    fuseinfer.unpatch(model)
    after = _hook_state(model)
    assert after.keys() == before.keys()
    for name in before:  # the same hook objects, bound methods and wrappers, and the original classes
        assert all(a is b for a, b in zip(after[name], before[name])), name
    torch.testing.assert_close(model(ids).logits, expected, atol=1e-5, rtol=1e-5)


def test_fast_decode_on_hooked_model_and_offload_falls_back(caplog):
    plain, ids = _model(), torch.randint(2, 512, (2, 7))
    hooked = _placed(copy.deepcopy(plain), offload_layer=None)
    fuseinfer.patch(plain)
    fuseinfer.patch(hooked)
    expected = fuseinfer.generate(plain, ids, max_new_tokens=5)
    assert torch.equal(fuseinfer.generate(hooked, ids, max_new_tokens=5), expected)
    assert torch.equal(hooked.generate(ids, max_new_tokens=5, do_sample=False), expected)
    offloaded = _placed(_model())
    fuseinfer.patch(offloaded)
    with pytest.raises(fuseinfer.FuseInferError, match="accelerate offloads part of the model"):
        fuseinfer.generate(offloaded, ids, max_new_tokens=5)
    with caplog.at_level("WARNING", logger="fuseinfer"):
        out = offloaded.generate(ids, max_new_tokens=5, do_sample=False)  # transformers' generate, one warning
    assert torch.equal(out, expected)
    assert "accelerate offloads" in caplog.text


def test_meta_weights_without_offload_keep_the_load_message():
    model = _model()
    with torch.device("meta"):
        model.model.decoder.layers[0].fc1.weight = torch.nn.Parameter(torch.empty(128, 64))
    with pytest.raises(fuseinfer.FuseInferError, match="meta device: load real weights.*no accelerate hook offloads it"):
        fuseinfer.patch(model)
    assert fuseinfer.patch_state(model) is None


def test_forward_replaced_without_accelerate_is_skipped():
    model = _model(2)
    layer = model.model.decoder.layers[1]
    layer.forward = lambda *a, **k: type(layer).forward(layer, *a, **k)
    report = fuseinfer.patch(model)
    assert "not by an accelerate hook" in dict(report.skipped)["model.decoder.layers.1"]
    fuseinfer.unpatch(model)


def test_split_kv_cache_writes_like_the_static_cache():
    from fuseinfer.runtime import StaticKVCache

    static = StaticKVCache(2, 2, 4, 8, 16, torch.float32, torch.device("cpu"))
    split = SplitKVCache([torch.device("cpu")] * 2, 2, 4, 8, 16, torch.float32)
    k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 3, 8)
    for cache in (static, split):
        cache.write_idx = torch.tensor([4, 5, 6])
        cache.update(k, v, 1)
    assert torch.equal(static.keys[1], split.keys[1]) and torch.equal(static.values[1], split.values[1])


def test_dispatch_model_with_disk_offload(tmp_path):
    """accelerate's dispatch_model, as from_pretrained(device_map=...) calls it: a hook on each block plus passive
    execution-device hooks on every submodule (which the fused forward may bypass), one layer offloaded to disk."""
    from accelerate import dispatch_model

    plain = _model(3)
    device_map = {"model.decoder.embed_tokens": "cpu", "model.decoder.embed_positions": "cpu", "lm_head": "cpu",
                  "model.decoder.final_layer_norm": "cpu", "model.decoder.layers.0": "cpu",
                  "model.decoder.layers.1": "disk", "model.decoder.layers.2": "cpu"}
    model = dispatch_model(copy.deepcopy(plain), device_map, main_device="cpu", offload_dir=str(tmp_path))
    assert placement.passive_hook(model.model.decoder.layers[0].fc1)  # dispatch_model hooks every submodule
    ids = torch.randint(2, 512, (2, 9))
    before = _hook_state(model)
    report = fuseinfer.patch(model)
    swapped = {s.name for s in report.swaps}
    assert {"model.decoder.layers.0", "model.decoder.layers.0.self_attn", "model.decoder.layers.2"} <= swapped
    assert "offloaded by accelerate (disk)" in dict(report.skipped)["model.decoder.layers.1"]
    torch.testing.assert_close(model(ids).logits, plain(ids).logits, atol=1e-5, rtol=1e-5)
    fuseinfer.unpatch(model)
    after = _hook_state(model)
    assert all(all(a is b for a, b in zip(after[n], before[n])) for n in before)
