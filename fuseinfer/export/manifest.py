"""``fuseinfer_onnx.json``: what an export directory holds, how to run it, and which model it was made from.

The model identity is two hashes: ``config_hash`` over the configuration fields that shape the graph, and
``weights_fingerprint`` over every parameter's name, shape and first and last elements (cheap, and it changes when
a checkpoint is retrained or a random model is drawn with another seed). A runtime that is handed both the model
and a directory refuses a directory made from another model (see :func:`check_matches`).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from .errors import ExportError

MANIFEST = "fuseinfer_onnx.json"
SCHEMA = "fuseinfer.onnx/1"
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
DTYPE_NAMES = {torch.float16: "fp16", torch.float32: "fp32", torch.bfloat16: "bf16"}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}
# the OPT configuration fields the exported graph depends on (others, e.g. transformers_version, do not matter)
CONFIG_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "ffn_dim", "num_attention_heads",
                 "max_position_embeddings", "word_embed_proj_dim", "do_layer_norm_before",
                 "_remove_final_layer_norm", "activation_function", "enable_bias", "layer_norm_elementwise_affine",
                 "pad_token_id")


def config_hash(config) -> str:
    fields = {k: getattr(config, k, None) for k in CONFIG_FIELDS}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


@torch.no_grad()
def weights_fingerprint(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        flat = p.detach().reshape(-1)
        ends = torch.cat([flat[:8], flat[-8:]]).float().cpu()  # 16 values: a few bytes per tensor
        h.update(f"{name}{tuple(p.shape)}".encode())
        h.update(ends.numpy().tobytes())
    return h.hexdigest()[:16]


def write(directory: Path, manifest: dict) -> None:
    (Path(directory) / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def read(directory) -> dict:
    """The manifest of an export directory; ExportError when it is not one."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise ExportError(f"{directory} is not a fuseinfer ONNX export (no {MANIFEST}); export one with "
                          "python -m fuseinfer.export onnx --model ... --out DIR")
    manifest = json.loads(path.read_text())
    if manifest.get("schema") != SCHEMA:
        raise ExportError(f"{path} has schema {manifest.get('schema')!r}, this fuseinfer reads {SCHEMA!r}: "
                          "re-export with python -m fuseinfer.export onnx ... --overwrite")
    if not (directory / manifest["model_file"]).is_file():
        raise ExportError(f"{directory / manifest['model_file']} is missing: re-export the directory")
    return manifest


def check_matches(manifest: dict, directory, model=None, config=None, flavour=None, dtype=None) -> None:
    """Raise ExportError when ``directory`` was not exported from this model / flavour / dtype."""
    reexport = f"re-export it: python -m fuseinfer.export onnx --model ... --out {directory} --overwrite"
    cfg = config if config is not None else getattr(model, "config", None)
    if cfg is not None and manifest["model"]["config_hash"] != config_hash(cfg):
        raise ExportError(f"the graph in {directory} was exported from another model configuration (config hash "
                          f"{manifest['model']['config_hash']} != {config_hash(cfg)} of this model); {reexport}")
    if model is not None and manifest["model"]["weights_fingerprint"] != weights_fingerprint(model):
        raise ExportError(f"the graph in {directory} holds other weights than this model (fingerprint "
                          f"{manifest['model']['weights_fingerprint']} != {weights_fingerprint(model)}: older "
                          f"checkpoint or another seed); {reexport}")
    if flavour is not None and manifest["flavour"] != flavour:
        raise ExportError(f"{directory} holds the {manifest['flavour']!r} flavour, {flavour!r} was asked for; "
                          f"use another directory or {reexport}")
    if dtype is not None and manifest["dtype"] != DTYPE_NAMES[dtype]:
        raise ExportError(f"{directory} holds a {manifest['dtype']} graph, {DTYPE_NAMES[dtype]} was asked for; "
                          f"use another directory or {reexport}")
