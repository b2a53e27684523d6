"""``profile(model, backend, phase, ...)``: profile one step of a model on a backend (and optionally a second backend
on the same inputs) and return a :class:`ProfileResult`; with ``out`` it also writes every file (report.py).

The flow per backend: load a fresh model (the eval's loading and backends), get it ready for the phase (a prefill
before decode steps), run warm-up steps (compilation, graph capture), time ``repeats`` steps without the profiler
(CUDA events / perf_counter, as the eval does), then run torch.profiler over wait / warm-up / active steps with
module ranges (modules.py), write the Chrome trace and TensorBoard log, and read the trace back (trace.py) into
tables, to which the roofline verdicts (verdict.py) are added. The profiler's overhead is the profiled step time
over the unprofiled one. A backend without a torch model gets no module ranges; an ONNX Runtime one (``ort``,
``ort-plain``) runs its profiled steps on a session with ORT's own profiler on, whose per-node times make its op,
kind and layer tables (ort_nodes.py).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from fuseinfer.core import files
from fuseinfer.models import family
from fuseinfer.harness.devices import DTYPES, resolve_device
from fuseinfer.harness.environment import environment
from fuseinfer.harness.models import ModelSource, load_config, resolve_model
from fuseinfer.harness.timing import StepClock, free_memory, summarize, synchronize, time_call
from fuseinfer.profile import ceilings as ceilings_mod
from fuseinfer.profile import ort_nodes
from fuseinfer.profile.backends import PHASES, has_phase, module_backend, resolve_backend, step_function, uses_graphs
from fuseinfer.profile.errors import ProfileError
from fuseinfer.profile.modules import ModuleRanges, OpRanges
from fuseinfer.profile.trace import GRAPH, analyze, load_events
from fuseinfer.profile.verdict import add_verdicts, verdict_table

DEFAULTS = {"cuda": dict(prompt_len=512, gen_len=32, active=3, repeats=20),
            "cpu": dict(prompt_len=32, gen_len=4, active=2, repeats=3)}
WARMUP_CALLS = 3  # untimed steps first: compilation (call 1), CUDA-graph recording (call 2), replays from call 3
# A decode warm-up round runs a whole sequence, as long as the timed and profiled steps will make it: eager's
# DynamicCache grows by torch.cat, so each step asks the allocator for blocks larger than any it has freed before --
# fresh cudaMallocs every step until a sequence of that length has run once. With 3 warm-up steps the eager OPT-1.3b
# decode step was timed at 44-83 ms on the H200 against the eval's 8.4-15.7 (whose timed steps follow two whole
# generations); a second sequence of the same length ran at 10 ms. Rounds repeat until WARMUP_S has passed.
WARMUP_S = {"cuda": 1.0, "cpu": 0.1}
WARMUP_ROUNDS = 20  # (at most)


@dataclass(frozen=True)
class ProfileSettings:
    """What a profile depends on; None means the device's default (``DEFAULTS``; dtype fp16 on CUDA, fp32 on CPU)."""

    model: str
    backend: str = "fuseinfer"
    phase: str = "prefill"
    device: str | None = None
    dtype: str | None = None
    batch_size: int = 1
    prompt_len: int | None = None
    gen_len: int | None = None
    compare: str | None = None
    wait: int = 1
    warmup: int = 1
    active: int | None = None
    repeats: int | None = None
    seed: int = 0
    tensorboard: bool = True
    nvtx: bool = True
    debug: bool = False


@dataclass
class BackendProfile:
    """One backend's profile: timings, the trace's tables (``analysis``), its files and notes."""

    name: str
    summary: str
    unprofiled_ms: dict  # {"median", "p10", "p90", "n"} of steps timed without the profiler
    analysis: dict  # trace.analyze + verdicts: ops, kernels, kinds, layers, memory, step_ms, ...
    verdicts: list = field(default_factory=list)
    details: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    files: dict = field(default_factory=dict)
    # the module-range pass (a second profiled pass with hooks; for a CUDA-graph decode the per-op step): kinds,
    # layers, step_ms, busy_ms, idle_ms, idle_label, unit, label. None: the kinds come from the un-hooked pass
    attribution: dict | None = None
    # the op rows with costs and verdicts: the un-hooked pass's, or where that step is mostly CUDA graph replays
    # (no op is recorded inside a replay) the op-by-op attribution pass's, which launches the same kernels
    costed: dict | None = None

    @property
    def profiled_ms(self) -> float:
        """Wall-clock step of the un-hooked profiled pass (the profiler's own cost included)."""
        return self.analysis["step_ms"]

    @property
    def cost_analysis(self) -> dict:
        """The analysis whose op rows carry FLOPs, bytes and verdicts (see ``costed``)."""
        return self.costed or self.analysis

    @property
    def busy_ms(self) -> float:
        """Device busy time per step of the un-hooked pass (kernel time on CUDA, op time on CPU)."""
        return self.analysis["busy_ms"]

    @property
    def step_ms(self) -> float:
        """The table's step time: the median unprofiled step, timed before any profiler ran in this process."""
        return self.unprofiled_ms["median"]

    @property
    def kinds(self) -> dict:
        """The analysis the per-module tables come from (the attribution pass where there is one)."""
        return self.attribution or self.analysis

    @property
    def overhead(self) -> float:
        """Profiled step time / unprofiled step time - 1 (the profiler's own cost, syncs at step ends included)."""
        return self.profiled_ms / self.unprofiled_ms["median"] - 1


@dataclass
class ProfileResult:
    settings: dict
    environment: dict
    ceilings: dict
    model: dict
    profiles: list[BackendProfile]
    compare: dict | None = None
    hints: list = field(default_factory=list)
    out_dir: str | None = None
    files: dict = field(default_factory=dict)

    @property
    def main(self) -> BackendProfile:
        return self.profiles[0]

    def to_dict(self) -> dict:
        d = asdict(self)
        for p, prof in zip(d["profiles"], self.profiles):
            p.update(profiled_ms=prof.profiled_ms, overhead=prof.overhead, busy_ms=prof.busy_ms, step_ms=prof.step_ms)
            if prof.costed is not None:  # (its op rows, verdicts included, are the attribution's "ops")
                p["costed"] = "attribution"
        return {"schema": "fuseinfer.profile/1", **d}


@dataclass
class _Context:
    settings: ProfileSettings
    device: torch.device
    dtype: torch.dtype
    source: ModelSource | None
    config: object
    prompt: torch.Tensor  # (B, P) int64 on CPU


def check_out_dir(out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Check that ``out`` can take a profile (new, empty, or with ``overwrite`` an earlier profile); creates
    nothing (the folder appears, whole, when the profile is written). Raises :class:`ProfileError` saying why not."""
    from fuseinfer.profile.report import MARKER

    try:
        return files.check_writable(out, folder=True, marker=MARKER, overwrite=overwrite)
    except files.WriteError as exc:
        raise ProfileError(str(exc)) from None


def _validate(s: ProfileSettings, model_given: bool) -> None:
    if s.phase not in PHASES:
        raise ProfileError(f"unknown phase {s.phase!r}: choose from {', '.join(PHASES)}")
    for flag, value, low in (("--batch-size", s.batch_size, 1), ("--prompt-len", s.prompt_len, 1),
                             ("--gen-len", s.gen_len, 1), ("--steps", s.active, 1), ("--repeats", s.repeats, 1),
                             ("--wait", s.wait, 0), ("--warmup", s.warmup, 0)):
        if value is not None and value < low:
            raise ProfileError(f"{flag} must be at least {low}, got {value}")


def _backend_cls(name: str, phase: str, device: torch.device, model: nn.Module | None):
    cls = module_backend(model, name) if model is not None else resolve_backend(name)
    if not has_phase(cls, phase):
        raise ProfileError(f"backend {name!r} has no {phase} step (it implements "
                           f"{', '.join(p for p in PHASES if has_phase(cls, p)) or 'none of the phases'}); "
                           f"choose another --phase or backend")
    reason = cls.unavailable_reason(device)
    if reason:
        raise ProfileError(f"backend {name!r} is not installed here: {reason}")
    return cls


def _context(model, s: ProfileSettings) -> _Context:
    if isinstance(model, nn.Module):
        p = next(model.parameters())
        device, dtype, source, config = p.device, p.dtype, None, model.config
        if s.device is not None and torch.device(s.device) != device:
            raise ProfileError(f"the model is on {device}, not {s.device}: move it (model.to(...)) or leave device out")
    else:
        device = resolve_device(s.device)
        name = s.dtype or ("fp16" if device.type == "cuda" else "fp32")
        if name not in DTYPES:
            raise ProfileError(f"unknown dtype {name!r}: choose from {', '.join(DTYPES)}")
        dtype, source = DTYPES[name], resolve_model(str(model))
        config = load_config(source, quantized="the profiler builds each backend from the unquantized model")
    d = DEFAULTS[device.type]
    s = ProfileSettings(**{**asdict(s), **{k: v for k, v in d.items() if getattr(s, k) is None},
                           "device": str(device), "dtype": str(dtype).removeprefix("torch.")})
    limit = config.max_position_embeddings
    if s.prompt_len + _decode_budget(s) > limit:
        raise ProfileError(f"--prompt-len {s.prompt_len} + the {_decode_budget(s)} positions the {s.phase} steps "
                           f"use exceed the model's {limit} positions: lower --prompt-len")
    prompt = torch.randint(0, config.vocab_size, (s.batch_size, s.prompt_len),
                           generator=torch.Generator().manual_seed(s.seed))  # (B, P): the eval's prompt for a seed
    return _Context(s, device, dtype, source, config, prompt)


def _decode_budget(s: ProfileSettings) -> int:
    """Positions after the prompt the steps of a run use (a decode step takes one, a generate step gen_len)."""
    if s.phase == "prefill":
        return 0
    if s.phase == "generate":
        return s.gen_len + 1
    return WARMUP_CALLS + s.repeats + s.wait + s.warmup + s.active + 2


def profile(model, backend: str | None = None, phase: str = "prefill", *, compare: str | nn.Module | None = None,
            out: str | os.PathLike | None = None, overwrite: bool = False, ui=None, **settings) -> ProfileResult:
    """Profile one ``phase`` step of ``model`` (a name as the eval takes it -- short name, hub id, folder,
    ``random:<name>`` -- or an ``nn.Module`` the caller loaded, patched or not) on ``backend``; ``compare``: a second
    backend (name, or another ``nn.Module``) profiled on the same inputs. Other settings: the fields of
    :class:`ProfileSettings`. With ``out`` every file is written there (report.py), atomically: a temporary sibling
    folder renamed into place at the end; ``overwrite`` replaces an earlier profile (never another folder).
    Raises :class:`ProfileError` for bad input, before anything is loaded."""
    from fuseinfer.profile import report
    from fuseinfer.profile.compare import compare_profiles
    from fuseinfer.profile.hints import hints_for

    given = model if isinstance(model, nn.Module) else None
    other = compare if isinstance(compare, nn.Module) else None
    if given is not None and compare is not None and other is None:
        raise ProfileError("profile(<nn.Module>, compare=...) takes another nn.Module to compare with, not a name")
    s = ProfileSettings(model=model if given is None else type(model).__name__,
                        backend=backend or ("fuseinfer" if given is None else ""), phase=phase,
                        compare=None if compare is None else (compare if other is None else "model"), **settings)
    _validate(s, given is not None)
    ctx = _context(model, s)
    s = ctx.settings
    classes = [_backend_cls(s.backend or None, s.phase, ctx.device, given)]
    if compare is not None:
        classes.append(_backend_cls(s.compare, s.phase, ctx.device, other) if other is None
                       else _backend_cls("compare", s.phase, ctx.device, other))
        if given is None and s.compare == s.backend:
            raise ProfileError(f"--compare {s.compare} is the profiled backend itself: choose another backend")
    out_dir = check_out_dir(out, overwrite) if out is not None else None
    ui = ui or _SilentUI()
    writing = files.atomic_dir(out_dir, marker=report.MARKER, overwrite=overwrite) if out_dir is not None \
        else contextlib.nullcontext(None)
    with writing as tmp, torch.cuda.device(ctx.device) if ctx.device.type == "cuda" else contextlib.nullcontext():
        ui.info("measuring the ceilings (copy bandwidth, GEMM rates, launch floor)")
        ceilings = ceilings_mod.measure(ctx.device, ctx.dtype)
        # every backend's unprofiled steps first, before any profiler session in this process: a finished
        # torch.profiler session can leave CUPTI attached (pytorch/pytorch#144455: no cuptiFinalize unless
        # TEARDOWN_CUPTI=1), which slows later launches -- the eager decode step timed after fuseinfer's profile was
        # 47 ms against the eval's 8 ms on the H200 (docs/history.md, "Profiler (H200)")
        unprofiled = [_time_backend(cls, ctx, ui) for cls in classes]
        profiles = [_profile_backend(cls, ctx, ceilings, tmp, ui, u) for cls, u in zip(classes, unprofiled)]
        result = ProfileResult(settings=asdict(s), environment=environment(ctx.device), ceilings=ceilings,
                               model=_model_info(ctx), profiles=profiles,
                               out_dir=str(out_dir) if out_dir else None)
        if len(profiles) > 1:
            result.compare = compare_profiles(profiles[0], profiles[1])
        result.hints = hints_for(result)
        if tmp is not None:
            report.write_all(result, tmp, final=out_dir)
    return result


class _SilentUI:
    def info(self, message: str) -> None:
        pass

    def warn(self, message: str) -> None:
        pass


def _model_info(ctx: _Context) -> dict:
    c = ctx.config
    return {"spec": ctx.settings.model, "path": ctx.source.path if ctx.source else None,
            "random_weights": ctx.source.random_weights if ctx.source else None, "layers": c.num_hidden_layers,
            "hidden": c.hidden_size, "ffn": family(c.model_type).intermediate_size(c), "heads": c.num_attention_heads,
            "vocab": c.vocab_size}


def _time_unprofiled(step, phase: str, device: torch.device, repeats: int) -> dict:
    """Median step time without the profiler: decode steps back to back with an event between steps (the eval's
    StepClock), prefill and generate one timed call each (the eval's time_call)."""
    if phase == "decode":
        synchronize(device)
        clock = StepClock(device)
        clock.mark()
        for _ in range(repeats):
            step()
            clock.mark()
        return summarize(clock.intervals())
    return summarize([time_call(step, device) for _ in range(repeats)])


def _ready(backend, ctx: _Context):
    """Start the backend's caches for the run, run ``prepare`` and the warm-up steps; returns the step function."""
    s = ctx.settings
    # (a prefill of the model's whole length: caches of that length, no room for a next token)
    backend.start(s.batch_size, min(s.prompt_len + max(1, _decode_budget(s)), ctx.config.max_position_embeddings))
    prepare, step = step_function(backend, s.phase, ctx.prompt.to(ctx.device), s.gen_len)
    # decode: the longest sequence the cache holds (the budget's positions, less the first token's); else a few calls
    calls = max(WARMUP_CALLS, _decode_budget(s) - 1) if s.phase == "decode" else WARMUP_CALLS
    deadline = time.perf_counter() + WARMUP_S[ctx.device.type]
    for _ in range(WARMUP_ROUNDS):  # (each round starts the sequence again: the cache never runs out)
        prepare()
        for _ in range(calls):
            step()
        synchronize(ctx.device)
        if time.perf_counter() >= deadline:
            break
    prepare()  # the steps that follow start from a fresh sequence, as the budget assumes
    return step


def _failed(cls, s: ProfileSettings, exc: Exception) -> ProfileError:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return ProfileError(f"backend {cls.name!r} failed while profiling the {s.phase} step: "
                        f"{type(exc).__name__}: {text} (rerun with --debug for the traceback)")


@contextlib.contextmanager
def _backend_errors(cls, s: ProfileSettings, backend, device):
    """Around a backend's work: a clean allocator first; any failure but a ProfileError becomes one ProfileError
    naming the backend and phase (the traceback with --debug); the backend closed and its memory freed after."""
    free_memory(device)
    try:
        yield
    except ProfileError:
        raise
    except Exception as exc:
        if s.debug:
            raise
        raise _failed(cls, s, exc) from None
    finally:
        backend.close()
        free_memory(device)


def _time_backend(cls, ctx: _Context, ui) -> dict:
    """The backend's unprofiled step (the eval's timing), on a fresh model, with no profiler and no hooks."""
    s, device = ctx.settings, ctx.device
    backend = cls(ctx.source, ctx.config, ctx.dtype, device, s.seed)
    with _backend_errors(cls, s, backend, device), torch.no_grad():
        ui.info(f"{cls.name}: loading {s.model}")
        backend.load()
        step = _ready(backend, ctx)
        ui.info(f"{cls.name}: timing {s.repeats} {s.phase} steps without the profiler")
        return _time_unprofiled(step, s.phase, device, s.repeats)


# the attribution pass of a decode that replays one CUDA graph per step: the same step op by op (the patched model's
# RuntimeConfig with these fields, fuseinfer.runtime.using_runtime)
PER_OP_STEP = {"cuda_graphs": False, "decode_kernel": "off"}
GRAPH_STEP = 0.5  # graph replays over this share of the busy time: op costs come from the op-by-op pass


def _profile_backend(cls, ctx: _Context, ceilings: dict, out_dir: Path | None, ui, unprofiled: dict) -> BackendProfile:
    """Two profiled passes on a fresh model: (1) without module hooks -- the kernel / op tables, the verdicts, the
    device busy time and the profiled wall-clock step; (2) with the module-range hooks -- the time per module kind and
    per layer (``attribution``). Hooks change what runs (they turn off fuseinfer's fast prefill; no range runs inside
    a CUDA graph), so no figure of the step comes from pass 2. A decode that replays CUDA graphs has no module inside
    its one replay: pass 2 runs the per-op step instead (``PER_OP_STEP``), labelled so."""
    from fuseinfer.runtime import using_runtime

    s, device = ctx.settings, ctx.device
    backend = cls(ctx.source, ctx.config, ctx.dtype, device, s.seed)
    notes: list[str] = []
    folder = (out_dir / _safe(cls.name)) if out_dir is not None else Path(_tmpdir()) / _safe(cls.name)
    attribution = None
    with _backend_errors(cls, s, backend, device):
        with torch.no_grad():
            ui.info(f"{cls.name}: loading {s.model} for the profiled passes")
            backend.load()
            folder.mkdir(parents=True, exist_ok=True)
            ort = ort_nodes.runs_ort(backend)
            if ort:  # (the un-hooked pass runs on a session with ORT's own profiler on: its per-node times)
                ort_nodes.start_profiling(backend, folder)
            step = _ready(backend, ctx)
            # (hooks in a compiled model would recompile or break its graphs; ONNX Runtime / TensorRT hold no torch
            # model to hook)
            hooks = backend.name != "compile" and backend.model is not None
            if backend.name == "compile":
                notes.append("torch.compile: no module ranges (hooks would change the compiled graphs); kernels are "
                             "sorted by the op or compiled region that launched them")
            elif backend.model is None and not ort:
                notes.append(f"{cls.name} runs no torch modules: no module ranges; kernels are sorted by the runtime "
                             "call that launched them")
            graphs = s.phase != "prefill" and uses_graphs(backend)
            ui.info(f"{cls.name}: profiling {s.wait} + {s.warmup} + {s.active} {s.phase} steps without module hooks")
            runs = backend.ort.runs if ort else 0
            files, cuda_memory = _run_profiler(step, backend.model, device, s, folder, False, "trace.json")
            if ort:  # (each step makes the same number of session runs: the active ones are the last)
                ort_runs = (backend.ort.runs - runs) * s.active // (s.wait + s.warmup + s.active)
                files["ort_profile"] = ort_nodes.stop_profiling(backend, folder)
            if hooks:
                label = "module ranges (hooks)"
                if graphs:
                    label = ("per-op step (RuntimeConfig(cuda_graphs=False, decode_kernel='off')): the decode step "
                             "is one CUDA graph replay, inside which no per-module attribution is possible")
                    notes.append("per-module times come from the per-op decode step (no CUDA graph, no one-kernel "
                                 "step), the same layers op by op; the step time, kernel table and busy time are "
                                 "the graph replay's")
                    backend.end()
                    with using_runtime(backend.model, **PER_OP_STEP):
                        step = _ready(backend, ctx)
                        mfiles, _ = _run_profiler(step, backend.model, device, s, folder, True, "trace_modules.json")
                else:
                    if s.phase != "decode" and _fast_prefill(backend.model):
                        label += ": the hooks turn off fast prefill (runtime/prefill.py), so this pass runs the " \
                                 "module path; the step time and kernel table come from the un-hooked pass"
                    ui.info(f"{cls.name}: profiling the {s.phase} steps again with module ranges")
                    if s.phase == "decode":  # a fresh sequence: the cache's budget covers one profiled run
                        backend.end()
                        step = _ready(backend, ctx)
                    mfiles, _ = _run_profiler(step, backend.model, device, s, folder, True, "trace_modules.json")
                files["trace_modules"] = mfiles["trace"]
        ffn = family(ctx.config.model_type).intermediate_size(ctx.config)  # the MLP's width, for the cost models
        analysis = analyze(load_events(files["trace"]), ctx.config.hidden_size, ffn)
        if "ort_profile" in files:
            kv_heads, head_dim = family(ctx.config.model_type).kv_layout(ctx.config)
            notes += ort_nodes.merge(analysis, ort_nodes.analyze_ort(
                files["ort_profile"], ort_runs, s.active, ctx.config.hidden_size, ffn,
                ctx.config.vocab_size, ctx.config.num_hidden_layers, on_cuda=device.type == "cuda",
                model_type=ctx.config.model_type,
                qkv_width=(ctx.config.num_attention_heads + 2 * kv_heads) * head_dim),
                on_cuda=device.type == "cuda")
        if hooks:
            m = analyze(load_events(files["trace_modules"]), ctx.config.hidden_size, ffn)
            attribution = {k: m[k] for k in ("unit", "kinds", "layers", "ops", "step_ms", "busy_ms", "idle_ms",
                                                  "idle_label")}
            attribution["label"] = label
            _label_kinds(analysis, m)
        if graphs:
            notes.append("decode replays CUDA graphs: in the kernel table the kernels of a replay count as 'cuda "
                         "graph replay', each with its own device time where CUPTI reports it")
        if cuda_memory:
            analysis["memory"]["cuda_stats"] = cuda_memory
        if analysis["graph_launches_without_kernels"]:
            notes.append(f"{analysis['graph_launches_without_kernels']:.0f} CUDA graph launch(es) per step whose "
                         "kernels the profiler did not report: their time shows as idle")
        add_verdicts(analysis, ceilings)
        costed = None
        replayed = sum(k["device_ms"] for k in analysis["kinds"] if k["kind"] == GRAPH)
        if hooks and replayed > GRAPH_STEP * analysis["busy_ms"]:
            add_verdicts(m, ceilings)
            costed = m
            attribution["ops"] = m["ops"]
            notes.append(f"{replayed / analysis['busy_ms']:.0%} of the step's device time is CUDA graph replays, "
                         "inside which no op is recorded: the verdicts and the roofline come from the op-by-op pass "
                         f"({label}), which launches the same kernels one by one")
        details = backend.details()
    if out_dir is None:
        shutil.rmtree(folder, ignore_errors=True)
        files = {}
    return BackendProfile(name=cls.name, summary=cls.summary, unprofiled_ms=unprofiled, analysis=analysis,
                          verdicts=verdict_table(costed or analysis), details=details, notes=notes,
                          files={k: str(v) for k, v in files.items()}, attribution=attribution, costed=costed)


def _label_kinds(analysis: dict, hooked: dict) -> None:
    """The un-hooked pass's op / kernel rows take the kind the hooked pass gave the same op with the same input
    dims (without module ranges every op is 'other'); ops only the un-hooked pass runs keep theirs."""
    kinds = {(r["op"], repr(r["dims"])): (r["kind"], r["coarse"]) for r in hooked["ops"] if r["kind"] != "other"}
    for r in analysis["ops"]:
        r["kind"], r["coarse"] = kinds.get((r["op"], repr(r["dims"])), (r["kind"], r["coarse"]))
    for r in analysis["kernels"]:
        r["kind"], r["coarse"] = kinds.get((r["op"], repr(r.get("op_dims"))), (r["kind"], r["coarse"]))


def _fast_prefill(model) -> bool:
    """Whether a patched model's prefill would take fast prefill's lean loop / graphs (which module hooks turn off)."""
    from fuseinfer.runtime.prefill import lean_reason, mode
    from fuseinfer.core.state import patch_state

    return model is not None and patch_state(model) is not None and mode(model) != "module" \
        and lean_reason(model, weights=False) is None


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _tmpdir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="fuseinfer-profile-")


def _tensorboard_copy(trace: Path, tb: Path) -> Path:
    """The trace as TensorBoard's profiler plugin reads a log dir (what torch.profiler.tensorboard_trace_handler
    writes: ``<worker>.<ms timestamp>.pt.trace.json.gz``)."""
    import gzip
    import time

    tb.mkdir(parents=True, exist_ok=True)
    path = tb / f"fuseinfer.{int(time.time() * 1000)}.pt.trace.json.gz"
    with open(trace, "rb") as src, gzip.open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return path


def _run_profiler(step, model, device: torch.device, s: ProfileSettings, folder: Path, hooks: bool,
                  name: str = "trace.json"):
    """Runs the scheduled profiler over the steps; returns ({"trace": path, "tensorboard": dir}, CUDA memory stats
    of the profiled steps or None)."""
    from torch.profiler import ProfilerActivity, schedule

    trace = folder / name
    tb = folder / ("tensorboard" if name == "trace.json" else "tensorboard_modules")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    nvtx = s.nvtx and device.type == "cuda"

    def on_ready(prof):
        prof.export_chrome_trace(str(trace))  # (a profile exports once: the TensorBoard copy is made from this file)
        if s.tensorboard:
            _tensorboard_copy(trace, tb)

    cuda_memory = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    ranges = ModuleRanges(model, nvtx=nvtx) if hooks else contextlib.nullcontext()
    with ranges, OpRanges(nvtx=nvtx), torch.profiler.profile(
            activities=activities, schedule=schedule(wait=s.wait, warmup=s.warmup, active=s.active, repeat=1),
            on_trace_ready=on_ready, record_shapes=True, profile_memory=True) as prof:
        for _ in range(s.wait + s.warmup + s.active):
            step()
            synchronize(device)  # the step's range covers its device work
            prof.step()
    if device.type == "cuda":
        cuda_memory = {"allocated_before_mib": before / 2**20,
                       "max_allocated_mib": torch.cuda.max_memory_allocated(device) / 2**20,
                       "max_reserved_mib": torch.cuda.max_memory_reserved(device) / 2**20}
    files = {"trace": trace}
    if s.tensorboard:
        files["tensorboard"] = tb
    return files, cuda_memory
