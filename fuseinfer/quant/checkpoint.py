"""Quantized checkpoints: one format written by ``save_quantized`` and by a quantized model's ``save_pretrained``,
read by ``load_quantized`` and by ``AutoModelForCausalLM.from_pretrained`` (through ``quant/hf_quantizer.py``).

Format (a Hugging Face model folder, ready for ``push_to_hub``): ``config.json`` is the model's config with a
``quantization_config`` whose ``quant_method`` is ``"fuseinfer"`` (the scheme's ``describe()``: bits, granularity,
scale dtype, rounding; the PatchConfig ops; the quantized module names; the model's dtype; the fuseinfer version;
the weights' content hash), and ``model.safetensors`` the patched model's state dict (int8 ``qweight`` and fp32
``scale`` per quantized linear, the fused q/k/v as the attention module's ``qkv_proj``; everything else in the
model's dtype; tied tensors stored once). SmoothQuant W8A8 models save the same way: int8 ``weight_q`` and fp32
``weight_scale`` (N, 1) per linear, their biases, and the LayerNorms with the smoothing factors already folded in;
the record holds alpha and the calibration source.

The layout exists only in a patched model, so every reader builds the model on the meta device, applies ``patch``
with the recorded ops and the scheme's config in its empty-layout form (``_empty``: int8 / scale tensors laid out,
nothing quantized, calibrated or smoothed), and only then loads the tensors. ``load_quantized`` (``quant/loading.py``,
the module that patches: this one imports nothing that does) does this itself;
``from_pretrained`` does it in the quantizer's ``_process_model_before_weight_loading``. Both check, before any
tensor is allocated: the record's fields by type (``check_record``), the stored tensors' names, dtypes and shapes
against the patched model (``check_tensors``), and the content hash of the stored bytes (``weights_digest``).

A plain OPT must not take these files for its own weights (transformers only warns about an unknown
``quant_method`` and would initialise the missing fp16 weights at random): the file also holds a one-element
tensor under a plain linear's weight name (``GUARD_FIELD`` records which), whose wrong shape makes transformers
without fuseinfer refuse with a size mismatch. fuseinfer's readers skip it.

Only safetensors and JSON are read: no pickles, no code (a config's ``auto_map`` is never followed).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from fuseinfer.core.errors import FuseInferError
from fuseinfer.core.files import atomic_file

CONFIG_KEY = "quantization_config"
QUANT_METHOD = "fuseinfer"
WEIGHTS = "model.safetensors"
GUARD_FIELD = "plain_load_guard"
HASH_FIELD = "weights_sha256"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# safetensors' dtype names of the dtypes a quantized model holds
ST_DTYPES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64",
             torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
             torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3"}


# ---------------------------------------------------------------------------------------------------------- saving

def save_quantized(model, directory) -> Path:
    """Write the quantized (patched) ``model`` to ``directory`` (created; existing files of the format replaced)."""
    from safetensors.torch import save_file

    from fuseinfer.core.state import patch_state, unwrapped

    model = unwrapped(model)
    state = patch_state(model)
    if state is None or state.config.quant is None:
        raise FuseInferError("save_quantized takes a model quantized by fuseinfer.patch(model, fuseinfer.PatchConfig("
                             "quant=fuseinfer.Int8WeightOnly(), fuseinfer.SmoothQuantW8A8() or "
                             "fuseinfer.Float8())); this one is not quantized")
    if getattr(model, "config", None) is None:
        raise FuseInferError("save_quantized needs a Hugging Face model with a config")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = _unique_tensors(model)
    quant = _record(model, state, tensors)
    tensors[quant[GUARD_FIELD]] = torch.zeros(1, dtype=torch.int8)
    digest = {}

    def write_weights(tmp: Path) -> None:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        digest[HASH_FIELD] = weights_digest(tmp)  # of the bytes written, read back

    config = model.config.to_dict()
    config.pop("_attn_implementation_internal", None)
    config["_attn_implementation"] = None
    config["dtype"] = quant["dtype"]  # (else transformers would open the weights to find it, before the quantizer)
    _write_atomic(directory / WEIGHTS, write_weights)
    config[CONFIG_KEY] = {**quant, **digest}
    # (a crash between the two writes leaves a config whose hash does not match the weights: refused on load)
    _write_atomic(directory / "config.json",
                  lambda tmp: tmp.write_text(json.dumps(config, indent=2, sort_keys=True, default=str)))
    return directory


def _write_atomic(path: Path, write) -> None:
    """``write(tmp)`` to a temporary sibling of ``path``, then rename it over ``path`` (never half-written; the
    temporary is removed on any failure or signal). Only the format's own files are replaced: a folder that also
    holds a tokenizer or a README keeps them, as transformers' ``save_pretrained`` does."""
    with atomic_file(path, overwrite=True, flag="the checkpoint file") as tmp:
        write(tmp)


def _record(model, state, tensors: dict) -> dict:
    """The ``quantization_config`` of a patched quantized model (without the hash, computed once written)."""
    from fuseinfer.core.version import __version__

    quant, report = state.config.quant, state.report.quant
    modules = [e.name for e in report.entries]
    return {
        "quant_method": QUANT_METHOD, **quant.describe(), "ops": list(state.config.ops), "modules": modules,
        "fuseinfer_version": __version__, "architectures": [type(model).__name__],
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        GUARD_FIELD: _guard_name(modules, tensors),
        **({"calibration_source": report.calibration_source, "calibration_samples": report.calibration_samples}
           if getattr(report, "calibration_source", "") else {}),
    }


def _guard_name(modules: list[str], tensors: dict) -> str:
    """A weight name of the plain model that the quantized one lacks (its linear is stored as int8 + scale)."""
    names = [f"{m}.weight" for m in modules if not m.endswith("qkv_proj") and f"{m}.weight" not in tensors]
    if not names:
        raise FuseInferError("save_quantized found no quantized linear of the plain model to mark the checkpoint "
                             "with (none of this model's quantized modules is a plain linear of the unquantized one)")
    return names[0]


def _names_by_tensor(model) -> list[list[str]]:
    """The state dict's names grouped by tensor object (tied weights share a group)."""
    groups: dict[int, list] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(name)
    return list(groups.values())


def _unique_tensors(model) -> dict:
    """The state dict with each tied tensor once (under its first name in sorted order, as safetensors does)."""
    return {min(names): _tensor(model, min(names)).detach().contiguous() for names in _names_by_tensor(model)}


# ------------------------------------------------------------------------------------------------- reading / checks

def weights_digest(path) -> str:
    """sha256 over every tensor of a safetensors file in name order (its name, dtype, shape and the sha256 of its
    stored bytes); the tensors are hashed in parallel threads (hashlib releases the GIL) from a memory map."""
    header, start = read_header(path)
    names = sorted(header)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        try:
            def one(name):
                begin, end = header[name]["data_offsets"]
                return hashlib.sha256(view[start + begin:start + end]).digest()

            with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
                parts = list(pool.map(one, names))
        finally:
            view.release()
    h = hashlib.sha256()
    for name, part in zip(names, parts):
        h.update(json.dumps([name, header[name]["dtype"], header[name]["shape"]]).encode() + part)
    return h.hexdigest()


def read_header(path) -> tuple[dict, int]:
    """A safetensors file's tensor entries (name -> dtype, shape, data_offsets) and where their data starts."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            raise FuseInferError(f"{path} is not a safetensors file (bad header length)")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            header = None
    if not isinstance(header, dict):
        raise FuseInferError(f"{path} is not a safetensors file (unreadable header)")
    header.pop("__metadata__", None)
    for name, e in header.items():
        ok = isinstance(e, dict) and isinstance(e.get("dtype"), str) and isinstance(e.get("shape"), list) \
            and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2 \
            and all(isinstance(x, int) and x >= 0 for x in e["shape"] + e["data_offsets"]) \
            and e["data_offsets"][0] <= e["data_offsets"][1] <= size - 8 - n
        if not ok:
            raise FuseInferError(f"{path} is corrupt: tensor {name!r} has a malformed header entry")
    return header, 8 + n


def _field(record: dict, name: str, kinds, what: str, default=None, required=False):
    """``record[name]`` if it is of ``kinds`` (bool is not an int here), else a FuseInferError naming the field."""
    if name not in record:
        if required:
            raise FuseInferError(f"quantization_config.{name} is missing (expected {what}): not a checkpoint written "
                                 "by fuseinfer.save_quantized")
        return default
    v = record[name]
    if isinstance(v, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)) \
            or not isinstance(v, kinds):
        raise FuseInferError(f"quantization_config.{name} must be {what}, got {v!r}")
    return v


def check_record(record) -> dict:
    """The checkpoint's ``quantization_config``, every field fuseinfer reads checked by type and value; returns
    them normalised (FuseInferError naming the field otherwise)."""
    from fuseinfer.core.config import OPS
    from fuseinfer.core.quant_config import Float8, Int8WeightOnly, SmoothQuantW8A8

    if not isinstance(record, dict):
        raise FuseInferError(f"quantization_config must be a JSON object, got {type(record).__name__}")
    if record.get("quant_method") != QUANT_METHOD:
        raise FuseInferError(f"quantization_config.quant_method is {record.get('quant_method')!r}, not "
                             f"{QUANT_METHOD!r}: not a fuseinfer checkpoint")
    schemes = (Int8WeightOnly.scheme, SmoothQuantW8A8.scheme, Float8.scheme)
    scheme = _field(record, "scheme", str, f"one of {list(schemes)}", required=True)
    if scheme not in schemes:
        raise FuseInferError(f"quantization_config.scheme {scheme!r} is not supported by this fuseinfer (supported: "
                             f"{', '.join(map(repr, schemes))})")
    ops = _field(record, "ops", list, f"a list of op names from {list(OPS)}", required=True)
    if not all(isinstance(op, str) and op in OPS for op in ops):
        raise FuseInferError(f"quantization_config.ops must be a list of op names from {list(OPS)}, got {ops!r}")
    dtype = _field(record, "dtype", str, f"one of {list(DTYPES)}", required=True)
    if dtype not in DTYPES:
        raise FuseInferError(f"quantization_config.dtype must be one of {list(DTYPES)}, got {dtype!r}")
    modules = _field(record, "modules", list, "a list of module names", required=True)
    if not modules or not all(isinstance(m, str) and m for m in modules):
        raise FuseInferError(f"quantization_config.modules must be a non-empty list of module names, got "
                             f"{modules!r}")
    guard = _field(record, GUARD_FIELD, str, "a tensor name", required=True)
    digest = _field(record, HASH_FIELD, str, "a 64-digit hex string", required=True)
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise FuseInferError(f"quantization_config.{HASH_FIELD} must be a 64-digit hex string, got {digest!r}")
    lm_head = _field(record, "include_lm_head", bool, "true or false", default=False)
    archs = _field(record, "architectures", list, "a list of class names", default=[])
    if not all(isinstance(a, str) for a in archs):
        raise FuseInferError(f"quantization_config.architectures must be a list of class names, got {archs!r}")
    out = {"scheme": scheme, "ops": tuple(ops), "dtype": DTYPES[dtype], "modules": modules, "guard": guard,
           "digest": digest, "include_lm_head": lm_head, "architectures": archs}
    if scheme == SmoothQuantW8A8.scheme:
        alpha = _field(record, "alpha", (int, float), "a number in [0, 1]", default=0.5)
        if not 0 <= alpha <= 1:
            raise FuseInferError(f"quantization_config.alpha must be a number in [0, 1], got {alpha!r}")
        out["alpha"] = float(alpha)
        out.update(_static_input_fields(record))
    if scheme == Float8.scheme:  # (None: not smoothed)
        alpha = _field(record, "alpha", (int, float, type(None)), "null or a number in [0, 1]", default=None)
        if alpha is not None and not 0 <= alpha <= 1:
            raise FuseInferError(f"quantization_config.alpha must be null or a number in [0, 1], got {alpha!r}")
        out["alpha"] = None if alpha is None else float(alpha)
        out.update(_static_input_fields(record))
    return out


def _static_input_fields(record: dict) -> dict:
    """The record's static-input choices (absent: a checkpoint from before the option, dynamic), checked."""
    from fuseinfer.core.quant_config import STATIC_INPUT_FIELDS, STATIC_INPUT_MODES

    out = {}
    for name in STATIC_INPUT_FIELDS:
        mode = _field(record, name, str, f"one of {list(STATIC_INPUT_MODES)}", default="dynamic")
        if mode not in STATIC_INPUT_MODES:
            raise FuseInferError(f"quantization_config.{name} must be one of {list(STATIC_INPUT_MODES)}, got "
                                 f"{mode!r}")
        out[name] = mode
    return out


def empty_layout(checked: dict):
    """The config that lays out the checkpoint's scheme with empty tensors (``_empty``: no quantization, and for
    SmoothQuant no calibration or smoothing; the saved tensors hold their results)."""
    from fuseinfer.core.quant_config import Float8, Int8WeightOnly, SmoothQuantW8A8

    if checked["scheme"] == Int8WeightOnly.scheme:
        return dataclasses.replace(Int8WeightOnly(include_lm_head=checked["include_lm_head"]), _empty=True)
    if checked["include_lm_head"]:
        raise FuseInferError(f"quantization_config.include_lm_head must be false for {checked['scheme']} "
                             "checkpoints")
    scheme = Float8 if checked["scheme"] == Float8.scheme else SmoothQuantW8A8
    return dataclasses.replace(scheme(alpha=checked["alpha"], fc2_input=checked["fc2_input"],
                                      out_proj_input=checked["out_proj_input"]), _empty=True)


def _tensor_groups(model) -> list[list[str]]:
    """The state dict's names grouped by tensor: tied ones share a group (the same object, or tied later by
    transformers' ``all_tied_weights_keys`` when the model was just built on the meta device)."""
    by_name = {n: names for names in _names_by_tensor(model) for n in names}
    for a, b in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        if a in by_name and b in by_name and by_name[a] is not by_name[b]:
            merged = by_name[a] + by_name[b]
            for n in merged:
                by_name[n] = merged
    return list({id(names): names for names in by_name.values()}.values())


def check_tensors(path, model, checked: dict) -> None:
    """The stored tensors against the patched (meta) ``model``: every tensor present (tied ones under any of their
    names), none extra, each of the model's dtype and shape; then the content hash. Reads the file's header and
    bytes only (no allocation)."""
    header, _ = read_header(path)
    guard = header.pop(checked["guard"], None)
    if guard is None or guard["shape"] != [1]:
        raise FuseInferError(f"{path} lacks the tensor {checked['guard']!r} that fuseinfer.save_quantized writes: "
                             "not a fuseinfer checkpoint, or a damaged one")
    problems, known = [], set()
    for names in _tensor_groups(model):
        known.update(names)
        stored = [n for n in names if n in header]
        if not stored:
            problems.append(f"missing {names[0]}")
            continue
        t = _tensor(model, names[0])
        for n in stored:
            e = header[n]
            if e["dtype"] != ST_DTYPES.get(t.dtype):
                problems.append(f"{n} is {e['dtype']}, the model needs {ST_DTYPES.get(t.dtype, t.dtype)}")
            elif tuple(e["shape"]) != tuple(t.shape):
                problems.append(f"{n} has shape {tuple(e['shape'])}, the model needs {tuple(t.shape)}")
    problems += [f"unexpected {n}" for n in sorted(set(header) - known)]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise FuseInferError(f"{path} does not fit the quantized model: {'; '.join(problems[:3])}{more}")
    if weights_digest(path) != checked["digest"]:
        raise FuseInferError(f"{path} does not match the content hash in config.json (corrupted or changed since "
                             "it was saved): save the quantized model again")


def _tensor(model, name: str):
    module, _, leaf = name.rpartition(".")
    owner = model.get_submodule(module)
    return owner._parameters[leaf] if leaf in owner._parameters else owner._buffers[leaf]


def read_checkpoint(directory: Path) -> tuple[dict, dict]:
    """config.json (without its quantization_config) and the checked record, or one FuseInferError line."""
    cfg_path, weights = directory / "config.json", directory / WEIGHTS
    if not cfg_path.is_file() or not weights.is_file():
        raise FuseInferError(f"{directory} is not a fuseinfer quantized checkpoint (needs config.json and {WEIGHTS}, "
                             "as fuseinfer.save_quantized writes)")
    try:
        raw = json.loads(cfg_path.read_text())
    except ValueError as exc:
        raise FuseInferError(f"{cfg_path} is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise FuseInferError(f"{cfg_path} must hold a JSON object")
    quant = raw.pop(CONFIG_KEY, None)
    if not isinstance(quant, dict) or quant.get("quant_method") != QUANT_METHOD:
        raise FuseInferError(f"{cfg_path} has no quantization_config with quant_method {QUANT_METHOD!r}: not written "
                             "by fuseinfer.save_quantized (load an unquantized checkpoint with from_pretrained, then "
                             "fuseinfer.patch it)")
    return raw, check_record(quant)
