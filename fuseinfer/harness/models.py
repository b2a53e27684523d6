"""Model resolution and loading: short names, hub ids, local directories and ``random:<name>``.

``random:`` builds the model from its configuration with random weights (drawn with a fixed seed, on the target
device, in the target dtype), for latency and memory only. Each model family's published configurations are built
in (``ModelFamily.random_configs``, e.g. ``random:opt-1.3b``), so those names work with no network and no cache.
"""
from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass

import torch
from torch import nn

from fuseinfer import models
from fuseinfer.harness.errors import EvalError


def published_names() -> dict[str, str]:
    """Every family's published configuration (``ModelFamily.random_configs``) by short name (the hub id's part
    after the '/', e.g. ``opt-1.3b``): short name -> hub id."""
    return {hub_id.rsplit("/", 1)[-1].lower(): hub_id for hub_id in models.random_configs()}


SHORT_NAMES = tuple(published_names())  # (for --help texts; resolution reads the registry each time)
RANDOM_PREFIX = "random:"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: ``spec`` as typed; ``path`` a hub id or a directory; ``kind`` 'hub' or 'local'."""

    spec: str
    path: str
    kind: str
    random_weights: bool = False


def _bad_name(spec: str) -> EvalError:
    return EvalError(f"unknown model {spec!r}: use a short name ({', '.join(published_names())}), a Hugging Face "
                     "hub id (org/name), a local directory, or random:<name> for random weights")


def resolve_model(spec: str) -> ModelSource:
    """Map what the user typed to a :class:`ModelSource`; raises :class:`EvalError` for a name that is none."""
    random_weights = spec.startswith(RANDOM_PREFIX)
    name = spec[len(RANDOM_PREFIX):] if random_weights else spec
    short = published_names()
    if name.lower() in short:
        return ModelSource(spec, short[name.lower()], "hub", random_weights)
    if os.path.isdir(os.path.expanduser(name)):
        return ModelSource(spec, os.path.abspath(os.path.expanduser(name)), "local", random_weights)
    if os.path.isfile(os.path.expanduser(name)):
        raise EvalError(f"--model {name!r} is a file: pass the folder that holds config.json and the weights")
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise EvalError(f"model directory {name!r} does not exist")
    if _HUB_ID.match(name):
        return ModelSource(spec, name, "hub", random_weights)
    raise _bad_name(spec)


def _load_failed(source: ModelSource, exc: Exception) -> EvalError:
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if source.kind == "local":
        return EvalError(f"could not load {source.path!r} ({reason}); it should hold a Hugging Face model "
                         "(config.json and weights)")
    hint = f" or random:{source.path.rsplit('/', 1)[-1]} for latency and memory only" \
        if not source.random_weights and source.path in models.random_configs() else ""
    local = os.path.abspath(source.path)  # an id like models/opt-wt2-tiny may be a mistyped relative path
    return EvalError(f"could not load {source.path!r} ({reason}; no local directory {local} either); pass a local "
                     f"directory with the model (--model /path/to/{source.path.split('/')[-1]}){hint}")


def checkpoint_scheme(config) -> str | None:
    """The scheme of a fuseinfer quantized checkpoint's config (``int8_weight_only``, ``smoothquant_w8a8``), else
    None. Such a folder loads through transformers' quantizer registry already patched and quantized."""
    quant = getattr(config, "quantization_config", None)
    if isinstance(quant, dict) and quant.get("quant_method") == "fuseinfer":
        return str(quant.get("scheme"))
    return None


def load_config(source: ModelSource, quantized: str | None = None):
    """The model's config: built in for a family's published random models, else from the hub, cache or directory.

    A fuseinfer quantized checkpoint is accepted only where ``quantized`` is None (the caller runs it as it is);
    otherwise ``quantized`` says why this command needs the unquantized model, and the error names the fix."""
    from transformers import AutoConfig

    table = models.random_configs()
    if source.random_weights and source.path in table:
        return models.family(table[source.path]).build_config(source.path)
    try:
        config = AutoConfig.from_pretrained(source.path)
    except Exception as exc:  # hub, network and file errors all end the run with one line
        raise _load_failed(source, exc) from None
    if models.family(config.model_type) is None:
        raise EvalError(f"{source.path!r} is a {config.model_type!r} model; fuseinfer measures the families it "
                        f"patches: {models.supported()}")
    scheme = checkpoint_scheme(config)
    if scheme is not None and quantized is not None:
        raise EvalError(f"{source.path!r} is a fuseinfer quantized checkpoint ({scheme}): {quantized}; pass the "
                        "unquantized model it came from")
    return config


def load_model(source: ModelSource, config, dtype: torch.dtype, device: torch.device, seed: int) -> nn.Module:
    """A fresh model in eval mode on ``device`` in ``dtype`` with HF's default (sdpa) attention.

    Random weights are drawn directly on the device, one parameter at a time (``fuseinfer.parallel.random_model``:
    no host copy), seeded by ``seed`` and each parameter's name.
    Checkpoints load straight to the device when accelerate is installed, else to CPU in ``dtype`` and then move.
    """
    from transformers import AutoModelForCausalLM

    if source.random_weights:  # built on meta, each parameter drawn on the device (fuseinfer/parallel)
        from fuseinfer.harness.materialize import random_model

        return random_model(config, dtype, device, seed)
    kwargs = {"device_map": {"": device}} if importlib.util.find_spec("accelerate") else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype, attn_implementation="sdpa", **kwargs)
    except Exception as exc:  # hub, network and file errors all end the run with one line
        raise _load_failed(source, exc) from None
    return model.to(device).eval()


def load_tokenizer(source: ModelSource):
    """The model's tokenizer, or None when it has none (perplexity is then skipped with a note)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source.path)
    except Exception:  # no tokenizer files, or offline without a cached copy
        return None
    # transformers 5.x gives a folder without tokenizer files an empty tokenizer (no vocabulary) instead of raising
    return tokenizer if len(tokenizer) > 1 and tokenizer("The", add_special_tokens=False)["input_ids"] else None


@dataclass(frozen=True)
class ModelStats:
    """Sizes the derived metrics need, counted on the unpatched model."""

    params: int  # unique parameters (tied embeddings once)
    matmul_params: int  # weights of the decoder's Linear layers (every prompt token goes through them)
    lm_head_params: int  # vocab x word_embed_proj_dim (run for the last prompt token only in prefill)
    weight_bytes_per_token: int  # bytes of weights one decode step reads (all but the position table)
    layers: int
    hidden: int
    element_size: int
    kv_width: int | None = None  # key/value heads x head dim of a layer's cache (None: hidden, multi-head attention)


def model_stats(model: nn.Module) -> ModelStats:
    """Parameter counts and bytes of a causal LM of a known family (its decoder layers, as the family finds them, and
    its output embeddings)."""
    family = models.family_of(model)
    _, layers = family.decoder_layers(model)
    kv_heads, head_dim = family.kv_layout(model.config)
    params = sum(p.numel() for p in model.parameters())
    linear = sum(m.weight.numel() for m in layers.modules() if isinstance(m, nn.Linear))
    partial = sum(t.numel() for t in family.row_read_tensors(model))  # a decode step reads one row of each
    element_size = next(model.parameters()).element_size()
    return ModelStats(params=params, matmul_params=linear, lm_head_params=model.get_output_embeddings().weight.numel(),
                      weight_bytes_per_token=(params - partial) * element_size,
                      layers=model.config.num_hidden_layers, hidden=model.config.hidden_size,
                      element_size=element_size, kv_width=kv_heads * head_dim)
