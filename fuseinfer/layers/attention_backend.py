"""Which implementation runs the ``attention`` op, per phase: ``PatchConfig.attention_backend`` resolved at patch time.

Backends: ``fuseinfer`` (``ops.attention``: our kernel, SDPA where it has none, the reference on CPU), ``flash_attn``
(``ops.flash_attention``: the flash-attn-4 package where its API covers the call, else ``ops.attention``), ``sdpa``
(``ops.attention.attention_sdpa``: torch SDPA with the boolean mask). ``auto`` picks per (phase, head dim) from
``AUTO_TABLE``, which holds only classes where a committed benchmark (``bench/bench_attention.py``, results under
``bench/results/``) measured flash-attn-4 faster than our kernel; it is empty until then, so ``auto`` = ``fuseinfer``.

A phase is ``decode`` for calls with one query per row, ``prefill`` otherwise. The patch records the resolved names
on every attention module of the model (``ATTR``) and in ``PatchReport.attention_backends``; the ``"fuseinfer"``
attention implementation (``hf_attention.py``) looks them up on each call.
"""
from __future__ import annotations

import torch
from torch import nn

from fuseinfer.core.extension import extension
from fuseinfer.core.config import PatchConfig
from fuseinfer.core.errors import FuseInferError
from fuseinfer.ops.attention import attention, attention_sdpa, kernel_supports
from fuseinfer.ops.flash_attention import INSTALL_HINT, fa_supports, flash_attention, load_flash_attn, package_version

ATTR = "_fuseinfer_attn_backends"  # on each attention module while patched: {"prefill": name, "decode": name}
PHASES = ("prefill", "decode")

# (phase, head_dim) -> "flash_attn" where bench/results/<gpu>/attention*.json measured flash-attn-4 faster than our kernel
# over that class's shapes (bench_attention.py prints the rows to copy here). No H100 measurement yet: empty.
AUTO_TABLE: dict[tuple[str, int], str] = {}

IMPLS = {"fuseinfer": attention, "flash_attn": flash_attention, "sdpa": attention_sdpa}


def check(config: PatchConfig) -> None:
    """Raise before anything is patched when ``flash_attn`` is asked for and the package does not import."""
    if config.attention_backend == "flash_attn" and "attention" in config.ops:
        fa, why = load_flash_attn()
        if fa is None:
            raise FuseInferError(f"attention_backend='flash_attn' needs the flash-attn-4 package (import flash_attn.cute"
                                 f" failed: {why}); install it with `{INSTALL_HINT}`, or use "
                                 "attention_backend='auto' (our kernel where the package is missing)")


def resolve(config: PatchConfig, head_dim: int) -> dict[str, str]:
    """phase -> backend name for a model of this head dim (``check`` has passed)."""
    if config.attention_backend != "auto":
        return {phase: config.attention_backend for phase in PHASES}
    have_fa = load_flash_attn()[0] is not None if AUTO_TABLE else False  # (no import while the table is empty)
    return {phase: "flash_attn" if AUTO_TABLE.get((phase, head_dim)) == "flash_attn" and have_fa else "fuseinfer"
            for phase in PHASES}


def describe(names: dict[str, str], config: PatchConfig, like: torch.Tensor, head_dim: int) -> dict[str, str]:
    """phase -> one line for the report: the backend and what runs where it does not apply."""
    probe = like.new_empty(1, 1, 1, head_dim) if head_dim > 0 else like
    if not like.is_cuda:
        ours = "fuseinfer (PyTorch reference on CPU)"
    elif extension(like.device) is None:
        ours = "fuseinfer (SDPA: no fuseinfer kernels here)"
    elif not kernel_supports(probe):
        ours = f"fuseinfer (SDPA: no kernel for {like.dtype}, head dim {head_dim})"
    else:
        ours = "fuseinfer (CUDA kernel)"
    auto = " [auto]" if config.attention_backend == "auto" else ""
    out = {}
    for phase, name in names.items():
        if name == "sdpa":
            out[phase] = "sdpa (torch SDPA with a boolean mask)"
        elif name == "fuseinfer":
            why = f"; no flash-attn-4 measurement for ({phase}, head dim {head_dim}) in AUTO_TABLE" if auto else ""
            out[phase] = ours + auto + why
        elif not fa_supports(probe):  # (False on CPU)
            out[phase] = (f"flash_attn{auto} requested, but flash-attn-4 does not take {like.dtype} head dim "
                          f"{head_dim} on {like.device.type}: {ours}")
        else:
            rest = "masks with holes, fp32, gradients: " + ours
            if phase == "decode":
                rest = "inside fuseinfer.generate's CUDA graphs (no host sync to check the key mask), " + rest
            out[phase] = f"flash_attn{auto} (flash-attn-4 {package_version()}; {rest})"
    return out


def install(model: nn.Module, names: dict[str, str], attention_types: tuple) -> list[nn.Module]:
    """Record ``names`` on every attention module of ``model`` (swapped or not: all run the "fuseinfer"
    implementation); returns them for ``uninstall``."""
    mods = [m for m in model.modules() if isinstance(m, attention_types)]
    for m in mods:
        m.__dict__[ATTR] = dict(names)
    return mods


def uninstall(mods: list[nn.Module]) -> None:
    for m in mods:
        m.__dict__.pop(ATTR, None)


def attention_for(module: nn.Module, sq: int):
    """The attention op for this module and call: ``ops.attention`` unless the patch recorded another backend."""
    names = module.__dict__.get(ATTR)
    if names is None:
        return attention
    return IMPLS[names["decode" if sq == 1 else "prefill"]]


def decode_backend(model: nn.Module) -> str | None:
    """The decode backend recorded on ``model``'s attention modules (None: none recorded)."""
    return next((m.__dict__[ATTR]["decode"] for m in model.modules() if ATTR in m.__dict__), None)
