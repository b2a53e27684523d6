"""Export manifests: schema-checked reads (no raw KeyError or TypeError for any damage), file names confined to the
export folder, and the weights hash that identifies the model over every element (blake2b and the device-side
checksum), also where the eval reuses exports (--onnx-dir)."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import random_opt
from fuseinfer.export import ExportError, to_onnx
from fuseinfer.export import manifest as mf

pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install -e .[export])")


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    model = random_opt()
    directory = tmp_path_factory.mktemp("m") / "x"
    return model, to_onnx(model, directory), directory


def _write(directory, manifest):
    (directory / mf.MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture
def copy_of(export, tmp_path):
    import shutil

    _, manifest, directory = export
    shutil.copytree(directory, tmp_path / "x")
    return manifest, tmp_path / "x"


KEYS = [(k,) for k in mf.SCHEMA_KEYS] + [("model", k) for k in mf.SCHEMA_KEYS["model"]]
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=False), st.text(max_size=5),
                   st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(),
                                                                        max_size=2))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.lists(st.tuples(st.sampled_from(KEYS), st.one_of(st.just("delete"), VALUES)),
                        min_size=1, max_size=3))
def test_damaged_manifest_is_one_export_error(copy_of, changes):
    manifest, directory = copy_of
    damaged = copy.deepcopy(manifest)
    for path, value in changes:
        parent = damaged
        for key in path[:-1]:
            parent = parent.get(key) if isinstance(parent, dict) else None
        if not isinstance(parent, dict):
            continue
        if value == "delete":
            parent.pop(path[-1], None)
        else:
            parent[path[-1]] = value
    _write(directory, damaged)
    try:
        got = mf.read(directory)
    except ExportError as exc:
        assert "\n" not in str(exc) and "re-export" in str(exc)
        return
    assert got == damaged  # accepted only when the damage kept every key and type (e.g. another valid string)


@pytest.mark.parametrize("key", ["model_file", "external_data"])
@pytest.mark.parametrize("value", ["../x.onnx", "/etc/hostname", "a/../../b", "..", ""])
def test_manifest_paths_stay_in_the_export(copy_of, key, value):
    manifest, directory = copy_of
    (directory.parent / "x.onnx").write_bytes((directory / mf.MODEL_FILE).read_bytes())  # a real file outside
    _write(directory, {**manifest, key: value})
    with pytest.raises(ExportError, match=f"{key}.*re-export"):
        mf.read(directory)


def test_manifest_path_symlinked_out_is_refused(copy_of):
    manifest, directory = copy_of
    os.replace(directory / mf.MODEL_FILE, directory.parent / "elsewhere.onnx")
    (directory / mf.MODEL_FILE).symlink_to(directory.parent / "elsewhere.onnx")
    with pytest.raises(ExportError, match="outside"):
        mf.read(directory)


def test_not_json_and_missing_file(copy_of):
    manifest, directory = copy_of
    (directory / mf.MANIFEST).write_text("{not json")
    with pytest.raises(ExportError, match="cannot be read as JSON"):
        mf.read(directory)
    _write(directory, manifest)
    (directory / mf.DATA_FILE).unlink()
    with pytest.raises(ExportError, match="missing: re-export"):
        mf.read(directory)


def test_old_manifest_says_re_export(copy_of):
    manifest, directory = copy_of
    old = copy.deepcopy(manifest)
    old["schema"] = "fuseinfer.onnx/1"
    old["model"]["weights_fingerprint"] = old["model"].pop("weights_hash")[:16]
    _write(directory, old)
    with pytest.raises(ExportError, match="older fuseinfer.*without the weights hash.*re-export"):
        mf.read(directory)


# --- the weights hash

def _changed(model, name="model.decoder.layers.0.fc1.weight", index=(37, 21), delta=0.5):
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.state_dict()[name][index] += delta
    return other


@pytest.mark.parametrize("method", mf.HASH_METHODS)
def test_one_middle_element_changes_the_hash(method):
    model = random_opt()
    base = mf.weights_hash(model, method)
    assert base.startswith(method + ":") and base == mf.weights_hash(copy.deepcopy(model), method)
    assert mf.weights_hash(_changed(model), method) != base
    assert mf.weights_hash(_changed(model, delta=1e-6), method) != base  # the smallest change, a few ulps


@settings(max_examples=12, deadline=None)
@given(row=st.integers(0, 127), col=st.integers(0, 63), bit=st.integers(0, 31))
def test_checksum_detects_any_single_bit_flip(row, col, bit):
    model = _MODEL
    other = copy.deepcopy(model)
    w = other.state_dict()["model.decoder.layers.1.fc1.weight"]
    bits = w.view(torch.int32)
    bits[row, col] ^= (1 << bit) if bit < 31 else -(1 << 31)
    assert mf.weights_hash(other, "checksum") != _BASE


_MODEL = random_opt()
_BASE = mf.weights_hash(_MODEL, "checksum")


def test_export_for_another_model_is_refused(export):
    """A model that differs from the exported one only away from each tensor's ends (the old fingerprint's
    blind spot) is refused, by OrtDecoder and by the eval's --onnx-dir lookup."""
    from fuseinfer.export import OrtDecoder

    model, _, directory = export
    other = _changed(model)
    with pytest.raises(ExportError, match="other weights"):
        OrtDecoder(directory, "cpu", model=other)
    OrtDecoder(directory, "cpu", model=model)


def test_onnx_dir_reuse_checks_every_weight(export, monkeypatch):
    from fuseinfer.export.backends import export_dir_for

    model, _, directory = export
    found, temporary = export_dir_for(model, "fused", torch.float32, onnx_dir=str(directory.parent))
    assert (found, temporary) == (directory, False)
    elsewhere, _ = export_dir_for(_changed(model), "fused", torch.float32, onnx_dir=str(directory.parent))
    assert elsewhere != directory and not elsewhere.exists()


@pytest.mark.gpu
def test_checksum_is_the_same_on_gpu_and_cpu():
    model = random_opt(dtype=torch.float16)
    on_gpu = copy.deepcopy(model).cuda()
    assert mf.weights_hash(on_gpu).startswith("checksum:")
    assert mf.weights_hash(on_gpu) == mf.weights_hash(model, "checksum")
    assert mf.weights_hash(_changed(model).cuda()) != mf.weights_hash(on_gpu)


def test_config_hash_is_the_one_earlier_exports_recorded(tiny_model_path):
    """The fields behind the config hash come from the model family; the hash of a given config stays what the
    manifests of earlier exports hold (else every earlier export would read as stale)."""
    from transformers import AutoConfig

    assert mf.config_hash(AutoConfig.from_pretrained(tiny_model_path)) == "f7443aa2929b877f"


def test_config_hash_of_a_family_without_export_is_one_error():
    from transformers import GPT2Config

    with pytest.raises(ExportError, match="no graph for 'gpt2'"):
        mf.config_hash(GPT2Config())
