"""Loads the optional CUDA extension ``fuseinfer._C`` and says whether a CUDA kernel can serve a tensor.

Importing fuseinfer never fails because the extension is missing: without it every op runs its PyTorch
reference, and the patch report says so. Why it is missing comes from ``_build_info.json``, which setup.py writes
into the package (pip shows setup.py's own output only when the build fails): ``extension_status()`` reports it, and
the first op asked to run on a GPU without the kernels warns once.
"""
from __future__ import annotations

import importlib
import json
import warnings
from pathlib import Path

import torch

from fuseinfer.core import knobs

_ext = None  # the loaded extension's ops (Kernels), or None
_load_error: str | None = None
_no_kernels: dict[int, str | None] = {}  # CUDA device index -> None (the kernels run there) or why not
_warned = False
BUILD_INFO = Path(__file__).resolve().parent.parent / "_build_info.json"  # setup.py writes it beside the package's __init__


class Kernels:
    """The raw kernels of a loaded extension, ``torch.ops.<namespace>.<name>``, as attributes: ``ext.add_layer_norm(
    x, ...)``. Each csrc/*.cu file registers its own ops into ``fuseinfer_C`` when ``fuseinfer._C`` is imported; a
    name resolves once, on first use, to the op's single overload (an ``OpOverload``, cached as an attribute), and an
    op that is not registered (an extension older than this fuseinfer) is an AttributeError, so ``hasattr`` tests for
    it.

    Why the overload and not the packet: calls skip the packet's overload resolution. Per call on CPU (a registered
    op taking the add_layer_norm arguments): OpOverload 2.2 µs, OpOverloadPacket 2.3 µs, a pybind11 function 0.35 µs;
    the dispatcher's ~2 µs a call is the price of kernels that register themselves."""

    def __init__(self, namespace: str = "fuseinfer_C"):
        self._namespace = namespace

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            op = getattr(getattr(torch.ops, self._namespace), name).default
        except (AttributeError, RuntimeError):
            raise AttributeError(f"{self._namespace} has no op {name!r}") from None
        setattr(self, name, op)  # later lookups are plain attribute reads
        return op


def build_info() -> dict:
    """What setup.py decided when this copy was installed ({"built": bool, "reason": ..., "cuda_arch": ...,
    "cutlass": ...}), or {} for a source tree never built or a file that does not read as that."""
    try:
        info = json.loads(BUILD_INFO.read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) and isinstance(info.get("built"), bool) else {}


def _missing_reason(exc: ImportError) -> str:
    """Why fuseinfer._C did not import: the build's own reason when it was not built, else the import error."""
    info = build_info()
    if info.get("built") is False:
        return f"not built: {info.get('reason', 'no reason recorded')} (see README: Install)"
    return f"fuseinfer._C is not built ({exc})"


def extension(device: torch.device | None = None):
    """The compiled extension's kernels (``Kernels``: importing ``fuseinfer._C`` registers them), or None when it is
    not built (or FUSEINFER_DISABLE_CUDA=1) or, for a CUDA ``device``, when the build has no kernels for that GPU's
    architecture."""
    global _ext, _load_error
    if _ext is None and _load_error is None:
        if knobs.get("FUSEINFER_DISABLE_CUDA") == "1":
            _load_error = "disabled by FUSEINFER_DISABLE_CUDA=1"
        else:
            try:
                importlib.import_module("fuseinfer._C")  # its static initialisers register the ops
            except ImportError as exc:
                _load_error = _missing_reason(exc)
            else:
                _ext = Kernels()
                knobs.attach(_ext)  # the extension's run-time switches come from fuseinfer/core/knobs.py
    if _ext is None and device is not None and device.type == "cuda":
        _warn_once(_load_error)
    if _ext is not None and device is not None and device.type == "cuda":
        # once asked, one dict lookup per op call
        reason = _no_kernels[device.index] if device.index in _no_kernels else _no_kernels_reason(device)
        if reason:
            return None
    return _ext


def _warn_once(reason: str | None) -> None:
    """One warning per process that ops on a GPU run their PyTorch references (a silent slow path otherwise)."""
    global _warned
    if not _warned and knobs.get("FUSEINFER_DISABLE_CUDA") != "1":
        _warned = True
        warnings.warn(f"fuseinfer: the CUDA extension is absent ({reason}); ops on the GPU run their PyTorch "
                      "references, slower than the unpatched model", RuntimeWarning, stacklevel=3)


def _no_kernels_reason(device: torch.device) -> str | None:
    """None when the extension's kernels run on CUDA ``device``, else why not (asked once per device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _no_kernels:
        probe = getattr(_ext, "kernels_run_on", None)
        if probe is None:
            _no_kernels[index] = ("fuseinfer._C is older than this fuseinfer: rebuild it "
                                  "(pip install --no-build-isolation -e .)")
        else:
            major, minor = torch.cuda.get_device_capability(index)
            error = probe(index)  # "" when the kernels load on that GPU, else the CUDA error
            arch = f"{major}.{minor}" + ("a" if (major, minor) == (9, 0) else "")
            _no_kernels[index] = None if not error else (
                f"fuseinfer._C has no kernels for {torch.cuda.get_device_name(index)} (sm_{major}{minor}: {error}); "
                f"rebuild with FUSEINFER_CUDA_ARCH={arch} (setup.py)")
    return _no_kernels[index]


def cuda_extension_available() -> bool:
    """True when the CUDA kernels are built and run on the current CUDA device (for another GPU:
    ``extension_status(device)``)."""
    return extension() is not None and torch.cuda.is_available() and _no_kernels_reason(torch.device("cuda")) is None


def extension_status(device: torch.device | None = None) -> str:
    """One line for reports: 'built' or why the kernels are unavailable (on ``device``, when it is a GPU)."""
    if extension() is None:
        return _load_error or "not built"
    if not torch.cuda.is_available():
        return "built, but no CUDA device is visible"
    reason = _no_kernels_reason(device) if device is not None and device.type == "cuda" else None
    return f"built, but {reason}" if reason else "built"


def backend_for(t: torch.Tensor) -> str:
    """'cuda' when the op on tensor ``t`` runs our kernel, else 'reference'."""
    return "cuda" if t.is_cuda and extension(t.device) is not None else "reference"


def register_op(name: str, reference, cuda_impl, fake):
    """The custom op ``fuseinfer::<name>`` built from ``reference`` (its schema from the annotations; the CPU
    implementation), with ``cuda_impl`` for CUDA tensors and ``fake`` for tracing; -> (a callable returning the op's
    handle, the reference, the CUDA implementation): the three ``route`` takes. For ops registered per variant (one
    factory making several ops of one signature); a single op uses the decorators."""
    op = torch.library.custom_op(f"fuseinfer::{name}", reference, mutates_args=())
    op.register_kernel("cuda")(cuda_impl)
    op.register_fake(fake)
    return lambda: getattr(torch.ops.fuseinfer, name), reference, cuda_impl


def route(op, ref, cuda_impl, args: tuple, tensors: tuple):
    """Run an op on ``args``: its reference under torch.func transforms and forward-mode AD (``transformed``), the
    extension directly in eager mode on CUDA when no input needs a gradient (``eager_cuda``, over ``tensors``),
    else the registered op ``op`` (kernel or reference, with its autograd formula)."""
    if transformed():
        return ref(*args)
    if eager_cuda(*tensors):
        return cuda_impl(*args)
    return op(*args)


def transformed() -> bool:
    """True inside a torch.func transform (grad, vjp, jvp, vmap, ...) or a forward-mode AD level: the custom ops'
    autograd formulas are reverse-mode only and do not compose with those (a jvp saw a zero tangent, torch.func.grad
    an error), so the op wrappers run their plain-PyTorch references there, which do."""
    # (isinstance, not ``is not None``: under torch.compile dynamo wraps the stack's top in a variable that is never
    # None itself, so ``is not None`` was always true there and compiled graphs held the references, not the ops)
    return not isinstance(torch._C._functorch.peek_interpreter_stack(), type(None)) or \
        torch.autograd.forward_ad._current_level >= 0


def eager_cuda(t: torch.Tensor, *inputs: torch.Tensor | None) -> bool:
    """True when an op on ``t`` (and its other tensor ``inputs``) may call the extension directly instead of
    through the dispatcher.

    The registered ``fuseinfer::*`` ops are what torch.compile and opcheck see; in eager mode on CUDA the op
    wrappers skip the dispatcher's Python custom-op layer (10-30 µs a call, which dominates a prefill's
    ~170 op calls) and call the same implementation the op's CUDA kernel registration calls. A direct call
    records no autograd graph, so a call whose inputs need gradients goes through the dispatcher, where
    the op's autograd formula (next to its reference) gives the reference's gradients.
    """
    if not (t.is_cuda and extension(t.device) is not None and not torch.compiler.is_compiling()):
        return False
    return not (torch.is_grad_enabled() and any(i is not None and i.requires_grad for i in (t, *inputs)))
