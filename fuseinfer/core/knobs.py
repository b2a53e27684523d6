"""Every ``FUSEINFER_*`` environment variable fuseinfer reads, in one table: name, default, when it is read, meaning.

The runtime-policy knobs (decode kernel, CUDA graphs, graph steps, prefill path, tensor-parallel graphs) are only
the defaults of :class:`fuseinfer.RuntimeConfig`'s fields (``Knob.field``), read when a RuntimeConfig is built
(``PatchConfig()`` builds one): a patched model runs with its config, not with the environment of the moment.
The extension's switches (``extension=True``) are process-wide: a launch mode, a debugging or benchmarking switch,
or a cache of tuned choices shared by every model in the process.

Python code reads a knob with :func:`get` (validated against the knob's choices, one clear error otherwise).
The CUDA extension reads none itself: :func:`push` hands the run-time switches to it as arguments
(the op ``torch.ops.fuseinfer_C.set_knobs``) when the extension loads, and again whenever a knob is changed through
:func:`override`. ``docs/env.md`` is generated from this table (``python -m fuseinfer.core.knobs > docs/env.md``) and a
test checks that it is current and that no other module calls ``os.environ`` for a ``FUSEINFER_`` name.

A CLI flag that stands for a knob goes through :func:`from_flag` (the value handed on, e.g. in the eval's settings,
with ``set_knob=False``; else also set as the knob): the flag wins over the environment and, where the two
disagree, says so on stderr (never silently). A path knob that must exist (``must_exist``) pointing at
nothing is an error naming the knob. ``FUSEINFER_*`` names in the environment that are not in the table
(misspellings) are reported once, with the closest known name, at the first knob read.
"""
from __future__ import annotations

import contextlib
import difflib
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from fuseinfer.core.errors import FuseInferError


@dataclass(frozen=True)
class Knob:
    name: str
    default: str | None  # None: unset (a path the reader looks for elsewhere)
    when: str  # "build", "import", "config" (a RuntimeConfig is built), "call": when the value is read
    meaning: str
    choices: tuple[str, ...] | None = None  # None: free-form (a path, a number checked by its reader)
    extension: bool = False  # handed to the CUDA extension by push()
    must_exist: bool = False  # a path that, when set, must name an existing file or folder
    field: str | None = None  # the RuntimeConfig field this knob is the default of


KNOBS: dict[str, Knob] = {k.name: k for k in (
    Knob("FUSEINFER_BUILD_CUDA", "auto", "build",
         "`auto`: build the CUDA extension when torch has CUDA, nvcc is found and a GPU is visible or "
         "`FUSEINFER_CUDA_ARCH` is given; `1`: build it or fail; `0`: never", ("auto", "0", "1")),
    Knob("FUSEINFER_CUDA_ARCH", "TORCH_CUDA_ARCH_LIST if set, else the visible GPUs' (9.0a on H100/H200)", "build",
         "compute capabilities to compile for (`;`-separated), e.g. `8.0;9.0a`; the wgmma kernels need `9.0a` "
         "and no plain `9.0` beside it"),
    Knob("FUSEINFER_CUTLASS", "auto", "build",
         "`auto`: a build for `9.0a` needs CUTLASS's headers (the W8A8 int8 GEMM) and stops without them; `0`: build "
         "without that GEMM (W8A8 prefill then runs `torch._int_mm`, slower than fp16)", ("auto", "0")),
    Knob("FUSEINFER_CUTLASS_DIR", "the installed nvidia-cutlass package", "build",
         "CUTLASS include directory for the sm_90 int8 GEMM"),
    Knob("FUSEINFER_DISABLE_CUDA", "0", "import", "`1`: ignore a built extension (every op runs its reference)",
         ("0", "1")),
    Knob("FUSEINFER_PDL", "1", "import",
         "`0`: launch kernels without programmatic dependent launch", ("0", "1"), extension=True),
    Knob("FUSEINFER_ATTN_SM90", "1", "call",
         "`0`: run the mma.sync attention prefill instead of the wgmma one on sm_90", ("0", "1"), extension=True),
    Knob("FUSEINFER_GEMM_TUNE", "1", "call",
         "`0`: take cuBLASLt's first heuristic choice for prefill-sized linears instead of timing 8 candidates "
         "once per problem", ("0", "1"), extension=True),
    Knob("FUSEINFER_DECODE_TRACE", "0", "import",
         "`1`: the one-kernel decode step records per-phase timestamps, for profiling the step", ("0", "1"),
         extension=True),
    Knob("FUSEINFER_W8A8_TILE", "auto", "call",
         "the W8A8 CUTLASS GEMM's tile configuration: `auto` by M, or `small` / `medium` / `large` forced (benchmarks)",
         ("auto", "small", "medium", "large"), extension=True),
    Knob("FUSEINFER_GEMV_EPILOGUES", "1", "call",
         "`0`: the decode GEMV's fused epilogues off (benchmarks): a gate/up linear with activation `silu_mul` runs "
         "the GEMV and then `silu_mul`, the q/k/v linear with the rotary and cache write (`linear_rope_append`) the "
         "GEMV and then `qkv_rope_append`: two kernels each instead of one; `rms_norm_linear` / "
         "`rms_norm_linear_rope_append` run `add_rms_norm` and then the GEMV, `layer_norm_linear` / "
         "`layer_norm_linear_append` `add_layer_norm` and then the GEMV", ("0", "1"), extension=True),
    Knob("FUSEINFER_SPLITKV_SPLITS", "0", "call",
         "split-KV decode attention's split count: `0` chosen by the kernel from the keys, the grid and the SMs, `N` forced "
         "to N (at most one split per block iteration's keys; benchmarks)", extension=True),
    Knob("FUSEINFER_SILU_GEMM", "0", "call",
         "`1`: a gate/up linear with activation `silu_mul` at prefill sizes runs the sm_90 GEMM with SiLU(gate) * up in "
         "its epilogue instead of cuBLASLt's GEMM and then `silu_mul` (off by default: 0.99-1.11x the pair's time at "
         "2048-8192 rows of the Llama MLPs measured, slower at fewer rows and at Qwen2.5-1.5B's; see docs/results.md)",
         ("0", "1"), extension=True),
    Knob("FUSEINFER_QKV_GEMM", "0", "call",
         "`1`: the q/k/v linear with the rotary and the k / v write (`linear_rope_append`) at prefill sizes runs the "
         "sm_90 GEMM with the rotary, the split and the write in its epilogue instead of cuBLASLt's GEMM and then "
         "`qkv_rope_append` (off by default: 1.0-2.0x the pair's time measured, about equal only at 2048-8192 rows of "
         "Llama-3.2-1B, Llama-3.1-8B and OPT-1.3b; see docs/results.md)", ("0", "1"), extension=True),
    Knob("FUSEINFER_ATTN_FP8", "0", "call",
         "`1`: prefill attention on sm_90 (fp16 / bf16, more than 16 queries) quantizes q per row and k, v per "
         "128-key tile to float8 e4m3 and runs Q K^T and P V on FP8 tensor cores (off by default; accuracy and "
         "speed in docs/results.md)", ("0", "1"), extension=True),
    Knob("FUSEINFER_DECODE_KERNEL", "auto", "config",
         "fast decode's step as one persistent kernel: `auto` where measured faster (OPT: 1-2 rows; int8 weight-only "
         "models up to hidden size 2048), `1` wherever it applies (`on`), `0` never (`off`)", ("auto", "0", "1"),
         field="decode_kernel"),
    Knob("FUSEINFER_DECODE_GRAPH_STEPS", "16", "config",
         "decode steps in fast decode's longer CUDA graph (`1`: one step per replay); a positive integer",
         field="graph_steps"),
    Knob("FUSEINFER_CUDA_GRAPHS", "1", "config", "`0`: fast decode runs its step (and prefill) eagerly, no CUDA graphs",
         ("0", "1"), field="cuda_graphs"),
    Knob("FUSEINFER_TP_GRAPHS", "1", "config",
         "`0`: a tensor-parallel model's decode step runs eagerly (its CUDA graphs hold NCCL all-reduces)", ("0", "1"),
         field="tp_graphs"),
    Knob("FUSEINFER_PREFILL", "auto", "config",
         "fast decode's prefill and the patched model's own forward (docs/prefill.md): `auto` (CUDA graphs per "
         "prompt-length bucket up to "
         "`AUTO_GRAPH_MAX_TOKENS`, else the lean layer loop), `graph` (graphs wherever they apply), `lean` (the "
         "loop, no graphs) or `module` (the patched modules)", ("auto", "graph", "lean", "module"), field="prefill"),
    Knob("FUSEINFER_KV_CACHE", "auto", "config",
         "fast decode's KV cache: `auto` (the model's dtype) or `fp8` (e4m3 keys and values with per-head scales, "
         "half the bytes of fp16; docs/quantization.md)", ("auto", "fp8"), field="kv_cache"),
    Knob("FUSEINFER_SHARED", "../shared", "call",
         "the shared assets folder (tests, .ci/run, the eval's default model): models/opt-wt2-tiny and "
         "data/wikitext-2-raw (the WikiText-2 files, found there when `FUSEINFER_DATA_DIR` is unset); a relative "
         "path is taken from the repository root"),
    Knob("FUSEINFER_DATA_DIR", None, "call",
         "folder with wiki.test.raw / wiki.valid.raw for the eval's perplexity, SmoothQuant calibration and the "
         "profiler (`--data-dir`); unset: `$FUSEINFER_SHARED/data/wikitext-2-raw` where it holds them, else the "
         "`datasets` library", must_exist=True),
    Knob("FUSEINFER_ONNX_DIR", None, "call",
         "default of the eval's `--onnx-dir`: its `ort` backends export under (and reuse from) this folder, one "
         "sub-folder per model; unset: a temporary export per run"),
    Knob("FUSEINFER_CALIBRATION_DATA", None, "call",
         "default of the eval's `--calibration-data`: its `fuseinfer-w8a8`, `fuseinfer-w8a8-static` and "
         "`fuseinfer-fp8-static` backends' calibration text file, folder with wiki.valid.raw, or saved SmoothQuant statistics (`.safetensors`); "
         "unset: wiki.valid.raw found as `--data-dir` / `FUSEINFER_DATA_DIR` say", must_exist=True),
    Knob("FUSEINFER_CALIBRATION_SAMPLES", "128", "call",
         "default of the eval's `--calibration-samples`: its `fuseinfer-w8a8`, `fuseinfer-w8a8-static` and "
         "`fuseinfer-fp8-static` backends' calibration windows of 512 tokens"),
)}

# Read by the project's benchmark and development scripts and its test suite (and documented there), not by the
# package: known names, so that setting one is not reported as a misspelling.
SCRIPT_NAMES = frozenset({"FUSEINFER_BENCH_DIR", "FUSEINFER_NVCC", "FUSEINFER_GPU_TRANSFORMERS",
                          "FUSEINFER_TEST_FAILURES"})


PREFIX = "FUSEINFER_"
_unknown_checked = False  # the environment's FUSEINFER_* names are checked once, at the first knob read


def unknown_names(environ=None) -> dict[str, str | None]:
    """``FUSEINFER_*`` names in the environment that are not knobs -> the closest knob name (None: none close)."""
    environ = os.environ if environ is None else environ
    return {n: next(iter(difflib.get_close_matches(n, KNOBS, n=1, cutoff=0.6)), None)
            for n in sorted(environ) if n.startswith(PREFIX) and n not in KNOBS and n not in SCRIPT_NAMES}


def check_unknown() -> None:
    """Warn once per process about misspelt ``FUSEINFER_*`` names (a knob that is set but never read)."""
    global _unknown_checked
    if _unknown_checked:
        return
    _unknown_checked = True
    unknown = unknown_names()
    if unknown:
        listed = "; ".join(n + (f" (did you mean {m}?)" if m else "") for n, m in unknown.items())
        warnings.warn(f"unknown fuseinfer environment variable(s), ignored: {listed}; the known ones are listed "
                      "in docs/env.md", UserWarning, stacklevel=3)


def _check_value(knob: Knob, value: str, named: str) -> None:
    """``value`` of ``knob`` as given by ``named`` (the variable, or a flag standing for it), or an error."""
    if knob.choices is not None and value not in knob.choices:
        raise FuseInferError(f"{named} must be one of {', '.join(knob.choices)}, got {value!r}")
    if knob.must_exist and not Path(value).expanduser().exists():
        raise FuseInferError(f"{named} {value} does not exist: point {named} at an existing file or folder, or "
                             f"leave it unset")


def get(name: str) -> str | None:
    """The knob's value from the environment (its default when unset), checked against its choices (and, for a
    path that must exist, checked to exist)."""
    check_unknown()
    knob = KNOBS[name]
    value = os.environ.get(name)
    if value is None:
        return knob.default
    _check_value(knob, value, name)
    return value


def from_flag(name: str, flag: str, value, note=None, set_knob: bool = True) -> str | None:
    """The setting a CLI flag ``flag`` and the knob ``name`` both name: the flag's ``value`` when given -- then,
    with ``set_knob``, set as the knob for this process and the ones it starts (without, the caller hands the value
    on itself), and where the environment held another value, ``note`` (default: a line on stderr) says it was
    overridden -- else the knob's value. Either is checked as :func:`get` checks it, the error naming whichever
    gave it."""
    if value is None:
        return get(name)
    value = str(value)
    _check_value(KNOBS[name], value, flag)
    before = os.environ.get(name)
    if before is not None and before != value:
        (note or _stderr)(f"{flag} {value} overrides {name}={before}")
    if set_knob:
        set_value(name, value)
    return value



def _stderr(message: str) -> None:
    print(f"note: {message}", file=sys.stderr)


def set_value(name: str, value: str) -> None:
    """Set a knob for this process and the processes it starts (e.g. a CLI flag that stands for one)."""
    if name not in KNOBS:
        raise FuseInferError(f"unknown knob {name}; see fuseinfer.core.knobs.KNOBS")
    os.environ[name] = value
    if KNOBS[name].extension:
        push()


def get_int(name: str, minimum: int = 1) -> int:
    """An integer knob (e.g. FUSEINFER_DECODE_GRAPH_STEPS), at least ``minimum``."""
    value = get(name)
    if not value.isdigit() or int(value) < minimum:
        raise FuseInferError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def changed_switches() -> dict[str, str]:
    """The extension's switches set to other than their defaults (e.g. ``{"FUSEINFER_ATTN_FP8": "1"}``): what a
    measurement's record names, since they change which kernels run."""
    values = {k.name: get(k.name) for k in KNOBS.values() if k.extension and k.default is not None}
    return {name: value for name, value in values.items() if value != KNOBS[name].default}


def extension_values() -> dict[str, int]:
    """The run-time switches the CUDA extension takes, as integers (a switch's choice by its index; a number,
    where the knob has no choices, checked to be a non-negative integer)."""
    return {k.name: _extension_value(k) for k in KNOBS.values() if k.extension}


def _extension_value(knob: Knob) -> int:
    if knob.choices is None:
        return get_int(knob.name, minimum=0)
    value = get(knob.name)
    return int(value) if value.isdigit() else knob.choices.index(value)


_extension = None  # the loaded extension's ops, attached by _ext.py (knobs imports nothing of fuseinfer's)


def attach(ext) -> None:
    """Called by ``_ext.py`` once the extension is loaded: hands it the switches now and at every override."""
    global _extension
    _extension = ext
    push()


def push() -> None:
    """Hand the extension's switches to it (the op ``fuseinfer_C::set_knobs``); a no-op without the extension."""
    if _extension is not None and hasattr(_extension, "set_knobs"):
        _extension.set_knobs(extension_values())


@contextlib.contextmanager
def override(**values: str):
    """Within the block, the knobs ``values`` (names without the ``FUSEINFER_`` prefix, e.g. ``ATTN_SM90="0"``)
    take these values, in the environment and in the extension."""
    names = {f"FUSEINFER_{k}": str(v) for k, v in values.items()}
    unknown = [n for n in names if n not in KNOBS]
    if unknown:
        raise FuseInferError(f"unknown knob(s) {unknown}; see fuseinfer.core.knobs.KNOBS")
    old = {n: os.environ.get(n) for n in names}
    os.environ.update(names)
    try:
        push()
        yield
    finally:
        for n, v in old.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v
        push()


def markdown() -> str:
    """The knobs table of docs/env.md."""
    lines = ["# Environment variables", "",
             "Generated from `fuseinfer/core/knobs.py` (`python -m fuseinfer.core.knobs > docs/env.md`); a test checks it is "
             "current.", "",
             "The variables read at `config` are defaults only: each is the default of a field of "
             "`fuseinfer.RuntimeConfig` (the `RuntimeConfig` column), read when a RuntimeConfig is built -- "
             "`fuseinfer.PatchConfig()` builds one, so at `fuseinfer.patch` unless a config is given. A patched "
             "model runs with the RuntimeConfig it was patched with (`PatchConfig(runtime=RuntimeConfig(...))`, or "
             "`fuseinfer.runtime.set_runtime(model, ...)` later), whatever the environment says afterwards; a field "
             "given explicitly wins over its variable. The others are read at build time, at import, or at each "
             "call, and apply to the whole process.", "",
             "| variable | default | read at | RuntimeConfig | meaning |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| `{k.name}` | {'unset' if k.default is None else f'`{k.default}`'} | {k.when} | "
              f"{f'`{k.field}`' if k.field else ''} | {k.meaning} |" for k in KNOBS.values()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
