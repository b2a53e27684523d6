"""``fuseinfer_onnx.json``: what an export directory holds, how to run it, and which model it was made from.

Every read is checked: the JSON against :data:`SCHEMA_KEYS` (each key present, of its type; one ExportError naming
the key, never a KeyError), and the file names it gives (``model_file``, ``external_data``) confined to the export
folder (relative, no ``..``, no symlink out).

The model identity is two hashes: ``config_hash`` over the configuration fields that shape the graph, and
``weights_hash`` over every byte of every tensor of the state dict (names, dtypes and shapes included), by one of
two methods, recorded as ``<method>:<hex>`` and recomputed the same way on check:

- ``blake2b``: blake2b over the raw bytes of every tensor, on the host. Used for models on the CPU (about 2.4 s per
  GB on a 2-core host: ~6 s for a 1.3b model in fp16, small next to loading and exporting it on a CPU).
- ``checksum``: for models on a GPU, where copying every weight to the host and hashing it there would cost
  seconds per check. Each tensor's bytes, as int16 words in blocks of 65536, are reduced on the tensor's own device
  to four weighted sums per block, ``sum_i w_k[i] * x[i]`` with fixed pseudo-random weights ``1 <= w_k[i] < 2**31``,
  in exact int64 arithmetic (no overflow: |x| <= 2**15, 65536 terms), so the result is the same on any device; the
  sums are then hashed with blake2b. Guarantee: a change of any single word (any one element, any bit of it)
  changes its block's sums by ``w_k[i] * delta != 0`` and is always detected; changes of several words in one block
  go unnoticed only if all four weighted sums cancel at once (for changes not chosen against these public weights:
  about 2**-124 per block). It is an identity check against mix-ups, not a defence against forgery.

A runtime that is handed both the model and a directory refuses a directory made from another model (see
:func:`check_matches`). Manifests written before the weights hash existed (schema ``fuseinfer.onnx/1``) are refused
with one line saying to re-export.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from fuseinfer.core.files import WriteError, confined
from fuseinfer.export.errors import ExportError
from fuseinfer.export.graph import FLAVOURS
from fuseinfer.models import family

MANIFEST = "fuseinfer_onnx.json"
SCHEMA = "fuseinfer.onnx/2"
OLD_SCHEMAS = ("fuseinfer.onnx/1",)
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
DTYPE_NAMES = {torch.float16: "fp16", torch.float32: "fp32", torch.bfloat16: "bf16"}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}
HASH_METHODS = ("blake2b", "checksum")
NUMBER = (int, float)
# every key a manifest must hold and its type (a tuple: any of them; a dict: a nested object checked the same way)
SCHEMA_KEYS = {
    "schema": str, "model_file": str, "external_data": str, "flavour": str, "dtype": str, "opset": int,
    "exported_on": str, "exporter": str, "versions": dict, "inputs": list, "outputs": list, "position_ids": str,
    "attention": str, "contrib_ops": dict, "op_counts": dict, "run": str, "export_seconds": NUMBER,
    "model": {"source": str, "config_hash": str, "weights_hash": str, "layers": int, "heads": int, "head_dim": int,
              "hidden": int, "vocab": int, "max_positions": int, "pad_token_id": (int, type(None))},
}
IO_KEYS = {"name": str, "dtype": str, "shape": list}
POSITIVE = ("layers", "heads", "head_dim", "hidden", "vocab", "max_positions")


def kv_heads(manifest: dict) -> int:
    """The heads of an export's past / present tensors: ``model.kv_heads`` (grouped-query attention), else the
    attention heads (exports made before grouped-query models could be exported)."""
    m = manifest["model"]
    return m.get("kv_heads", m["heads"])


def config_hash(config) -> str:
    """A hash of the configuration fields the exported graph depends on (the model family names them; others,
    e.g. transformers_version, do not matter)."""
    kind = getattr(config, "model_type", None)
    fam = family(kind)
    if fam is None:
        raise ExportError(f"fuseinfer.export has no graph for {kind!r} models")
    fields = {k: getattr(config, k, None) for k in fam.export_config_fields()}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


BLOCK = 1 << 16  # int16 words per checksum block: 65536 * 2**15 * 2**31 < 2**63, exact in int64
_CHUNK_BLOCKS = 256  # blocks reduced at once: 16M words, 128 MiB of int64 on the tensor's device
_CHUNK_BYTES = 1 << 26  # bytes per blake2b update


def _checksum_weights() -> torch.Tensor:
    """(4, BLOCK) int64 in [1, 2**31): splitmix64 of the index, fixed forever (a hash recorded in a manifest is
    recomputed with these)."""
    x = np.arange(4 * BLOCK, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps by design
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    w = (x % np.uint64(2**31 - 1)).astype(np.int64) + 1
    return torch.from_numpy(w.reshape(4, BLOCK))


_WEIGHTS: dict = {}


def _block_sums(t: torch.Tensor) -> bytes:
    """The four weighted sums of every 65536-word block of ``t``'s bytes (the last block as if zero-padded),
    computed on ``t``'s device."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if raw.numel() % 2:
        raw = torch.cat([raw, raw.new_zeros(1)])
    words = raw.view(torch.int16)
    key = str(t.device)
    if key not in _WEIGHTS:
        _WEIGHTS[key] = _checksum_weights().to(t.device)
    w = _WEIGHTS[key]
    full = words.numel() // BLOCK * BLOCK
    blocks = words[:full].view(-1, BLOCK)
    sums = []
    for i in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        x = blocks[i:i + _CHUNK_BLOCKS].to(torch.int64)
        sums.append(torch.stack([(x * w[k]).sum(1) for k in range(w.shape[0])], 1))  # (rows, 4)
    if full < words.numel():  # zero padding would add nothing: the tail meets the first weights only
        x = words[full:].to(torch.int64)
        sums.append((w[:, :x.numel()] * x).sum(1).view(1, -1))
    return torch.cat(sums).cpu().numpy().tobytes()


def _host_bytes(t: torch.Tensor):
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    for i in range(0, raw.size, _CHUNK_BYTES):
        yield memoryview(raw[i:i + _CHUNK_BYTES])


@torch.no_grad()
def weights_hash(model: torch.nn.Module, method: str | None = None) -> str:
    """``<method>:<hex>`` over every tensor of ``model.state_dict()`` (see the module docstring); ``method``
    default: ``checksum`` when a tensor is on a GPU, else ``blake2b``."""
    # keep_vars: the tensors themselves (a patched model's plain state_dict() copies its q/k/v weights, ~30 GB at
    # OPT-66b); detached, since they are read as bytes
    state = sorted((k, t.detach()) for k, t in model.state_dict(keep_vars=True).items())
    if method is None:
        method = "checksum" if any(t.device.type != "cpu" for _, t in state) else "blake2b"
    if method not in HASH_METHODS:
        raise ExportError(f"unknown weights hash method {method!r}: re-export the model with this fuseinfer")
    h = hashlib.blake2b(method.encode(), digest_size=16)
    seen: dict[tuple, str] = {}
    for name, t in state:
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        same = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) if t.numel() else None
        if same in seen:  # a tied weight (the LM head and the embedding table): hashed once, named twice
            h.update(f"={seen[same]}\n".encode())
            continue
        if same is not None:
            seen[same] = name
        if method == "blake2b":
            for chunk in _host_bytes(t):
                h.update(chunk)
        else:
            h.update(_block_sums(t))
    return f"{method}:{h.hexdigest()}"


def write(directory: Path, manifest: dict) -> None:
    """Into a folder being written by :func:`fuseinfer.core.files.atomic_dir` (the manifest is its marker)."""
    validate(manifest, Path(directory) / MANIFEST)
    (Path(directory) / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _check_keys(obj, keys: dict, where: str, path) -> None:
    for key, kind in keys.items():
        if key not in obj:
            raise ExportError(f"{path} is not a valid export manifest: {where}{key!r} is missing; re-export the "
                              "folder")
        value = obj[key]
        if isinstance(kind, dict):
            if not isinstance(value, dict):
                raise ExportError(f"{path} is not a valid export manifest: {where}{key!r} is not an object; "
                                  "re-export the folder")
            _check_keys(value, kind, f"{where}{key}.", path)
            continue
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            raise ExportError(f"{path} is not a valid export manifest: {where}{key!r} is {type(value).__name__}, "
                              f"not {names}; re-export the folder")


def validate(manifest, path) -> None:
    """Raise ExportError unless ``manifest`` has every key of :data:`SCHEMA_KEYS` with its type and sane values."""
    if not isinstance(manifest, dict):
        raise ExportError(f"{path} is not a valid export manifest (not a JSON object); re-export the folder")
    schema = manifest.get("schema")
    if schema in OLD_SCHEMAS:
        raise ExportError(f"{path} was written by an older fuseinfer (schema {schema}, without the weights hash "
                          "that identifies the model): re-export with python -m fuseinfer.export onnx ... "
                          "--overwrite")
    if schema != SCHEMA:
        raise ExportError(f"{path} has schema {schema!r}, this fuseinfer reads {SCHEMA!r}: re-export with "
                          "python -m fuseinfer.export onnx ... --overwrite")
    _check_keys(manifest, SCHEMA_KEYS, "", path)
    bad = None
    if manifest["flavour"] not in FLAVOURS:
        bad = f"flavour {manifest['flavour']!r} is not one of {', '.join(FLAVOURS)}"
    elif manifest["dtype"] not in DTYPES:
        bad = f"dtype {manifest['dtype']!r} is not one of {', '.join(DTYPES)}"
    elif manifest["model"]["weights_hash"].partition(":")[0] not in HASH_METHODS:
        bad = f"weights_hash {manifest['model']['weights_hash']!r} names no known method"
    elif any(manifest["model"][k] < 1 for k in POSITIVE):
        bad = f"a model size ({', '.join(POSITIVE)}) is below 1"
    elif not (isinstance(kv_heads(manifest), int) and 1 <= kv_heads(manifest) <= manifest["model"]["heads"]):
        bad = f"kv_heads {kv_heads(manifest)!r} is not a head count from 1 to heads"
    for io in manifest["inputs"] + manifest["outputs"]:
        if bad is None and not isinstance(io, dict):
            bad = "an input or output is not an object"
        elif bad is None:
            _check_keys(io, IO_KEYS, "inputs/outputs.", path)
    if bad:
        raise ExportError(f"{path} is not a valid export manifest: {bad}; re-export the folder")


def read(directory) -> dict:
    """The checked manifest of an export directory; ExportError when it is not one (or a broken one)."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise ExportError(f"{directory} is not a fuseinfer ONNX export (no {MANIFEST}); export one with "
                          "python -m fuseinfer.export onnx --model ... --out DIR")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ExportError(f"{path} cannot be read as JSON ({exc}); re-export the folder") from None
    validate(manifest, path)
    for key in ("model_file", "external_data"):
        try:
            file = confined(directory, manifest[key])
        except WriteError as exc:
            raise ExportError(f"{path}: {key} {exc}; re-export the folder") from None
        if not file.is_file():
            raise ExportError(f"{file} is missing: re-export the directory")
    return manifest


def model_hash(model, manifest: dict | None = None, memo: dict | None = None) -> str:
    """``model``'s weights hash by the method ``manifest`` records (default: the model's own); ``memo``
    ({method: hash}) spares a second pass over the same, unchanged model."""
    method = manifest["model"]["weights_hash"].partition(":")[0] if manifest else None
    memo = {} if memo is None else memo
    if method is None or method not in memo:
        value = weights_hash(model, method)
        method = value.partition(":")[0]
        memo[method] = value
    return memo[method]


def check_matches(manifest: dict, directory, model=None, config=None, flavour=None, dtype=None,
                  memo: dict | None = None) -> None:
    """Raise ExportError when ``directory`` was not exported from this model / flavour / dtype."""
    reexport = f"re-export it: python -m fuseinfer.export onnx --model ... --out {directory} --overwrite"
    cfg = config if config is not None else getattr(model, "config", None)
    if cfg is not None and manifest["model"]["config_hash"] != config_hash(cfg):
        raise ExportError(f"the graph in {directory} was exported from another model configuration (config hash "
                          f"{manifest['model']['config_hash']} != {config_hash(cfg)} of this model); {reexport}")
    if model is not None and manifest["model"]["weights_hash"] != (mine := model_hash(model, manifest, memo)):
        raise ExportError(f"the graph in {directory} holds other weights than this model (weights hash "
                          f"{manifest['model']['weights_hash']} != {mine}: another checkpoint, another seed or "
                          f"changed weights); {reexport}")
    if flavour is not None and manifest["flavour"] != flavour:
        raise ExportError(f"{directory} holds the {manifest['flavour']!r} flavour, {flavour!r} was asked for; "
                          f"use another directory or {reexport}")
    if dtype is not None and manifest["dtype"] != DTYPE_NAMES[dtype]:
        raise ExportError(f"{directory} holds a {manifest['dtype']} graph, {DTYPE_NAMES[dtype]} was asked for; "
                          f"use another directory or {reexport}")
