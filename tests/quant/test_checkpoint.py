"""save_quantized / load_quantized on CPU: identical logits after a round trip, no re-quantization, the recorded
scheme, and the refusals (unquantized model, not a checkpoint, a different architecture)."""
from __future__ import annotations

import json

import pytest
import torch

import fuseinfer
from fuseinfer import FuseInferError, Int8WeightOnly, PatchConfig
from tests.conftest import random_opt


@pytest.mark.parametrize("lm_head", [False, True])
def test_round_trip_gives_identical_logits_and_tensors(tmp_path, lm_head):
    model = random_opt(dtype=torch.float16).float()  # fp32 on CPU
    ids = torch.randint(0, 512, (2, 9))
    fuseinfer.patch(model, PatchConfig(quant=Int8WeightOnly(include_lm_head=lm_head)))
    fuseinfer.save_quantized(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert cfg["scheme"] == "int8_weight_only" and cfg["rounding"] == "half_to_even" and cfg["bits"] == 8
    assert cfg["include_lm_head"] is lm_head and "model.decoder.layers.0.self_attn.qkv_proj" in cfg["modules"]
    loaded = fuseinfer.load_quantized(tmp_path)
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert lm_head or loaded.lm_head.weight is loaded.model.decoder.embed_tokens.weight
    with pytest.raises(FuseInferError, match="keep_original=None"):
        fuseinfer.unpatch(loaded)


def test_load_does_not_quantize(tmp_path, monkeypatch):
    model = random_opt()
    fuseinfer.patch(model, PatchConfig(quant=Int8WeightOnly()))
    fuseinfer.save_quantized(model, tmp_path)
    import fuseinfer.quant.weight_only as wo

    monkeypatch.setattr(wo, "quantize_per_channel", lambda w: pytest.fail("load_quantized re-quantized a weight"))
    fuseinfer.load_quantized(tmp_path)


def test_load_into_a_given_model_and_into_a_different_architecture(tmp_path):
    model = random_opt()
    ids = torch.randint(0, 512, (1, 7))
    fuseinfer.patch(model, PatchConfig(quant=Int8WeightOnly()))
    fuseinfer.save_quantized(model, tmp_path)
    same = random_opt(seed=5)
    fuseinfer.load_quantized(tmp_path, model=same)
    assert torch.equal(same(ids).logits, model(ids).logits)
    other = random_opt(hidden_size=96, num_attention_heads=3)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(FuseInferError, match="different architecture.*hidden_size: checkpoint 64, model 96"):
        fuseinfer.load_quantized(tmp_path, model=other)
    assert fuseinfer.patch_state(other) is None
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())


def test_refusals(tmp_path):
    model = random_opt()
    with pytest.raises(FuseInferError, match="this one is not quantized"):
        fuseinfer.save_quantized(model, tmp_path)
    with pytest.raises(FuseInferError, match="not a fuseinfer quantized checkpoint"):
        fuseinfer.load_quantized(tmp_path)
    model.save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(FuseInferError, match="not a fuseinfer quantized checkpoint|no quantization_config"):
        fuseinfer.load_quantized(tmp_path)


@pytest.mark.parametrize("out_proj_input,fc2_input", [("dynamic", "dynamic"), ("static", "dynamic"),
                                                      ("static", "static")])
def test_w8a8_round_trip_gives_identical_logits(tmp_path, monkeypatch, out_proj_input, fc2_input):
    """A SmoothQuant W8A8 model (calibrated on token ids, smoothed, quantized) saves and loads without calibrating
    or quantizing again: same tensors (the smoothed LayerNorms included; out_proj's / fc2's static input scales
    with out_proj_input / fc2_input "static"), identical logits, the scheme recorded."""
    from fuseinfer import SmoothQuantW8A8
    from fuseinfer.quant import smoothquant as sq

    model = random_opt(dtype=torch.float16).float()
    ids = torch.randint(0, 512, (1, 256), generator=torch.Generator().manual_seed(0))
    stats = sq.calibrate(model, ids=ids, samples=2, seq_len=128)
    fuseinfer.patch(model, PatchConfig(quant=SmoothQuantW8A8(alpha=0.5, calibration=stats,
                                                             out_proj_input=out_proj_input, fc2_input=fc2_input)))
    fuseinfer.save_quantized(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert cfg["scheme"] == "smoothquant_w8a8" and cfg["alpha"] == 0.5 and cfg["calibration_source"] == "token ids"
    assert cfg["out_proj_input"] == out_proj_input and cfg["fc2_input"] == fc2_input
    import fuseinfer.quant.w8a8 as w8

    monkeypatch.setattr(w8, "_stats", lambda *a: pytest.fail("load_quantized calibrated again"))
    monkeypatch.setattr(w8, "smooth", lambda *a: pytest.fail("load_quantized smoothed again"))
    loaded = fuseinfer.load_quantized(tmp_path)
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.endswith("qkv_proj.weight_q") for k in a)
    assert any(k.endswith("out_proj.input_scale") for k in a) == (out_proj_input == "static")
    assert any(k.endswith("fc2.input_scale") for k in a) == (fc2_input == "static")
    quant = fuseinfer.patch_state(loaded).config.quant
    assert quant.out_proj_input == out_proj_input and quant.fc2_input == fc2_input
    x = torch.randint(0, 512, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(x).logits, loaded(x).logits)
    assert "a saved W8A8 checkpoint" in str(fuseinfer.patch_report(loaded))
    with pytest.raises(FuseInferError, match="keep_original"):
        fuseinfer.unpatch(loaded)


def test_load_into_a_model_refuses_another_device(tmp_path):
    """load_quantized(model=..., device=...) loads where the model is; another device is one clear error, the model
    untouched (it used to load onto the model's device, whatever device said)."""
    model = random_opt()
    fuseinfer.patch(model, fuseinfer.PatchConfig(quant=fuseinfer.Int8WeightOnly()))
    fuseinfer.save_quantized(model, tmp_path)
    target = random_opt(seed=1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(fuseinfer.FuseInferError, match="model's own device"):
        fuseinfer.load_quantized(tmp_path, device="meta", model=target)
    assert fuseinfer.patch_state(target) is None
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())
