"""Every read of a quantized checkpoint is checked (property tests over the files' contents): config fields of a
wrong type or value, tensors of a wrong dtype or shape, missing or extra tensors, and changed bytes each give one
FuseInferError line, from ``load_quantized`` (the given model untouched) and from ``from_pretrained``."""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import random_opt
from helpers import given, settings, st

import fuseinfer
from fuseinfer import FuseInferError, Int8WeightOnly, PatchConfig
from fuseinfer.quant.checkpoint import HASH_FIELD, WEIGHTS, read_header, weights_digest

FEW = settings(max_examples=12, deadline=None)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    model = random_opt(seed=1)
    fuseinfer.patch(model, PatchConfig(quant=Int8WeightOnly()))
    path = tmp_path_factory.mktemp("ckpt")
    fuseinfer.save_quantized(model, path)
    return path


def _copy(saved: Path, into: str) -> Path:
    out = Path(into) / "ckpt"
    shutil.copytree(saved, out)
    return out


def _edit_config(path: Path, edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg["quantization_config"])
    (path / "config.json").write_text(json.dumps(cfg))


def _refused_everywhere(path: Path, *words) -> None:
    """load_quantized, load_quantized(model=...) (model untouched) and from_pretrained all refuse in one line."""
    from transformers import AutoModelForCausalLM

    target = random_opt(seed=9)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    for load in (lambda: fuseinfer.load_quantized(path), lambda: fuseinfer.load_quantized(path, model=target),
                 lambda: AutoModelForCausalLM.from_pretrained(path)):
        with pytest.raises(FuseInferError) as info:
            load()
        message = str(info.value)
        assert "\n" not in message and all(w in message for w in words), message
    assert fuseinfer.patch_state(target) is None and target.lm_head.weight is target.model.decoder.embed_tokens.weight
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())


_TYPES = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8),
                   st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=1))
BAD = {  # field -> values of a wrong type or value
    "scheme": _TYPES.filter(lambda v: v not in ("int8_weight_only", "smoothquant_w8a8", "float8")),
    "ops": st.one_of(st.sampled_from(["attention", "linear"]), st.lists(st.sampled_from(["attn", "", "LINEAR"]),
                                                                        min_size=1, max_size=2),
                     st.lists(st.integers(), min_size=1, max_size=2), st.none(), st.integers()),
    "dtype": st.one_of(st.sampled_from(["bogus", "int8", "float", "torch.float32", "Tensor"]), st.integers(),
                       st.none()),
    "include_lm_head": st.one_of(st.sampled_from(["false", "true", 0, 1, None, [], "no"])),
    "modules": st.one_of(st.just([]), st.text(max_size=5), st.lists(st.integers(), min_size=1, max_size=2)),
    "plain_load_guard": st.one_of(st.none(), st.integers(), st.lists(st.text(max_size=3), max_size=1)),
    HASH_FIELD: st.one_of(st.none(), st.integers(), st.text(max_size=70).filter(lambda v: len(v) != 64)),
}


@FEW
@given(data=st.data())
def test_malformed_config_fields_are_named(saved, data):
    field = data.draw(st.sampled_from(sorted(BAD)), label="field")
    value = data.draw(BAD[field], label="value")
    with tempfile.TemporaryDirectory() as tmp:
        path = _copy(saved, tmp)
        _edit_config(path, lambda q: q.__setitem__(field, value))
        _refused_everywhere(path, f"quantization_config.{field}")


@FEW
@given(field=st.sampled_from(["scheme", "ops", "dtype", "modules", "plain_load_guard", HASH_FIELD]))
def test_missing_config_fields_are_named(saved, field):
    with tempfile.TemporaryDirectory() as tmp:
        path = _copy(saved, tmp)
        _edit_config(path, lambda q: q.pop(field))
        _refused_everywhere(path, f"quantization_config.{field} is missing")


@pytest.mark.parametrize("alpha", ["0.5", -0.1, 1.5, None, True])
def test_w8a8_alpha_checked(tmp_path, alpha):
    from fuseinfer.quant.checkpoint import check_record

    record = {"quant_method": "fuseinfer", "scheme": "smoothquant_w8a8", "ops": ["linear"], "dtype": "float32",
              "modules": ["m"], "plain_load_guard": "m.weight", HASH_FIELD: "0" * 64, "alpha": alpha}
    with pytest.raises(FuseInferError, match="quantization_config.alpha must be a number in"):
        check_record(record)


def _rewrite(path: Path, change) -> None:
    """Rewrite model.safetensors with ``change(tensors)`` applied, and record the new file's hash (so that only the
    dtype / shape / name checks can catch the change)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / WEIGHTS))
    change(tensors)
    save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})
    digest = weights_digest(path / WEIGHTS)
    _edit_config(path, lambda q: q.__setitem__(HASH_FIELD, digest))


def _draw_tensor(saved: Path, data) -> tuple[dict, str]:
    """The stored header and one stored tensor's name (not the guard)."""
    header, _ = read_header(saved / WEIGHTS)
    guard = json.loads((saved / "config.json").read_text())["quantization_config"]["plain_load_guard"]
    return header, data.draw(st.sampled_from(sorted(set(header) - {guard})), label="tensor")


def _refused_after_rewrite(saved: Path, change, *words) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = _copy(saved, tmp)
        _rewrite(path, change)
        _refused_everywhere(path, *words)


@FEW
@given(data=st.data())
def test_tensors_of_a_wrong_dtype_or_shape(saved, data):
    header, name = _draw_tensor(saved, data)
    kind = data.draw(st.sampled_from(["dtype", "shape"]), label="kind")
    if kind == "dtype":
        stored = header[name]["dtype"]
        dtype = data.draw(st.sampled_from([d for d, s in [(torch.float32, "F32"), (torch.int32, "I32"),
                                                          (torch.uint8, "U8"), (torch.float16, "F16"),
                                                          (torch.int8, "I8")] if s != stored]), label="dtype")
        def change(t):
            t[name] = t[name].to(dtype)
        words = (name, "the model needs")
    else:
        grow = data.draw(st.integers(1, 3), label="grow")
        def change(t):
            t[name] = torch.cat([t[name].reshape(-1)] * 4)[:t[name].numel() + grow]
        words = (name, "has shape")
    _refused_after_rewrite(saved, change, *words)


@FEW
@given(data=st.data())
def test_missing_and_extra_tensors(saved, data):
    _, name = _draw_tensor(saved, data)
    if data.draw(st.booleans(), label="drop"):
        change, words = (lambda t: t.pop(name)), ("missing",)
    else:
        extra = name + data.draw(st.sampled_from(["_extra", ".x", "2"]), label="suffix")
        change, words = (lambda t: t.__setitem__(extra, torch.zeros(2))), ("unexpected", extra)
    _refused_after_rewrite(saved, change, *words)


@FEW
@given(data=st.data())
def test_changed_bytes_fail_the_hash(saved, data):
    header, start = read_header(saved / WEIGHTS)
    size = (saved / WEIGHTS).stat().st_size
    offset = data.draw(st.integers(start, size - 1), label="offset")
    flip = data.draw(st.integers(1, 255), label="xor")
    with tempfile.TemporaryDirectory() as tmp:
        path = _copy(saved, tmp)
        raw = bytearray((path / WEIGHTS).read_bytes())
        raw[offset] ^= flip
        (path / WEIGHTS).write_bytes(bytes(raw))
        _refused_everywhere(path, "content hash")


def test_guard_and_truncation(saved, tmp_path):
    path = _copy(saved, str(tmp_path))
    raw = (path / WEIGHTS).read_bytes()
    (path / WEIGHTS).write_bytes(raw[:-10])
    _refused_everywhere(path, "model.safetensors")
    (path / WEIGHTS).write_bytes(b"\x00" * 3)
    _refused_everywhere(path, "not a safetensors file")
