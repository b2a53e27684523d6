"""Runs an evaluation: validates the settings, prepares the data once, then runs each backend in isolation.

Isolation: every backend loads a fresh model; between backends unreachable tensors are collected and the CUDA
cache emptied, and peak-memory counters are reset before each phase, so each backend's memory is its own.
A backend that cannot run (missing package, compile failure, out of memory) gets a row saying why; the others
still run. Problems with the settings, the model name or the data raise :class:`EvalError` before any backend.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from fuseinfer.core.data import shared_dir
from fuseinfer.core.extension import extension_status
from fuseinfer.eval.backends import BACKENDS
from fuseinfer.harness import data as data_mod
from fuseinfer.harness.backends import Backend, BackendOptions
from fuseinfer.harness.devices import DTYPES, resolve_device
from fuseinfer.harness.environment import environment
from fuseinfer.harness.errors import EvalError
from fuseinfer.harness.metrics import derive
from fuseinfer.harness.models import ModelSource, checkpoint_scheme, load_config, load_tokenizer, resolve_model
from fuseinfer.harness.perplexity import Window, gptq_windows, perplexity, sliding_windows
from fuseinfer.harness.timing import (
    StepClock,
    allocated_mib,
    copy_bandwidth_gbps,
    cpu_threads,
    free_memory,
    peak_memory,
    reset_peak,
    spread_warnings,
    summarize,
    synchronize,
    time_call,
)

DEFAULT_BACKENDS = ("eager", "compile", "fuseinfer")
# on CPU torch.compile's timings measure Inductor's CPU code and its compile time, not what fuseinfer is for
DEFAULT_BACKENDS_CPU = ("eager", "fuseinfer")
DEFAULT_CPU_WINDOWS = 8  # perplexity windows of a run without --model on CPU (a few minutes on 2 cores)
# prompt_len, gen_len, warmup, repeats: GPU defaults measure a realistic generation; CPU ones keep a smoke run short
LATENCY_DEFAULTS = {"cuda": dict(prompt_len=512, gen_len=128, warmup=2, repeats=10),
                    "cpu": dict(prompt_len=128, gen_len=32, warmup=1, repeats=5)}
FIRST_DECODE_STEPS = 3  # reduce-overhead compiles on call 1, records the CUDA graph on call 2, replays from 3


@dataclass(frozen=True)
class Settings:
    """Everything a run depends on; None means 'derive it': device cuda if present; dtype fp16 on cuda, fp32 on
    cpu; prompt_len / gen_len / warmup / repeats from ``LATENCY_DEFAULTS`` for the device; seq_len the model's
    max_position_embeddings."""

    model: str | None = None  # None: default_model() for the device
    backends: tuple[str, ...] | None = None  # None: DEFAULT_BACKENDS on CUDA, DEFAULT_BACKENDS_CPU on CPU
    dtype: str | None = None
    device: str | None = None
    batch_size: int = 1
    prompt_len: int | None = None
    gen_len: int | None = None
    warmup: int | None = None
    repeats: int | None = None
    seq_len: int | None = None
    stride: int | None = None
    max_windows: int | None = None
    data_dir: str | None = None
    seed: int = 0
    skip_ppl: bool = False
    skip_latency: bool = False
    debug: bool = False  # re-raise a backend's error instead of reporting it in its row
    tp: int = 1  # tensor-parallel ranks (torchrun --nproc-per-node tp); fuseinfer/eval/backends/parallel.py
    # the backends' options (BackendOptions; None: the knob of the same meaning)
    onnx_dir: str | None = None  # ort / ort-plain / tensorrt: keep and reuse exports here
    calibration_data: str | None = None  # fuseinfer-w8a8: calibration text, folder or saved statistics
    calibration_samples: int | None = None  # fuseinfer-w8a8: calibration windows of 512 tokens


def backend_options(s: Settings) -> BackendOptions:
    """What the settings say to the backends that take options (the data folder: fuseinfer-w8a8's calibration)."""
    return BackendOptions(onnx_dir=s.onnx_dir, calibration_data=s.calibration_data,
                          calibration_samples=s.calibration_samples, data_dir=s.data_dir)


@dataclass
class Plan:
    """Validated settings with everything shared by the backends."""

    settings: Settings
    device: torch.device
    dtype: torch.dtype
    source: ModelSource
    config: object
    seq_len: int
    prompt: torch.Tensor  # (B, P) int64 random token ids on CPU, the same for every backend
    windows: list[Window] | None = None
    ppl_note: str | None = None
    data_info: dict | None = None
    messages: list[str] = field(default_factory=list)  # shown once the plan is valid (an error stays one line)
    warnings: list[str] = field(default_factory=list)


def _backend_names(names) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in names if n.strip()))
    unknown = [n for n in names if n not in BACKENDS]
    if unknown or not names:
        raise EvalError(f"unknown backend {', '.join(map(repr, unknown)) or '(none given)'}: "
                        f"choose from {', '.join(BACKENDS)}")
    return names


def _tp_device(tp: int, device: str | None) -> torch.device:
    from fuseinfer.eval.backends.parallel import tp_device

    return tp_device(tp, device)


def _tp_backend(cls, tp: int):
    if tp == 1:
        return cls
    from fuseinfer.eval.backends.parallel import tp_backend

    return tp_backend(cls, tp)


def _check_sizes(s: Settings, max_positions: int) -> None:
    if s.skip_latency and s.skip_ppl:
        raise EvalError("--skip-latency and --skip-ppl together leave nothing to measure: drop one of them")
    for flag, value, low in (("--batch-size", s.batch_size, 1), ("--prompt-len", s.prompt_len, 1),
                             ("--gen-len", s.gen_len, 1), ("--repeats", s.repeats, 1), ("--warmup", s.warmup, 0),
                             ("--seq-len", s.seq_len, 2), ("--stride", s.stride, 1),
                             ("--max-windows", s.max_windows, 1), ("--calibration-samples", s.calibration_samples, 1)):
        if value is not None and value < low:
            raise EvalError(f"{flag} must be at least {low}, got {value}")
    if not s.skip_latency and s.prompt_len + s.gen_len > max_positions:
        raise EvalError(f"--prompt-len + --gen-len = {s.prompt_len + s.gen_len} exceeds the model's "
                        f"{max_positions} positions")
    if s.seq_len is not None and s.seq_len > max_positions:
        raise EvalError(f"--seq-len {s.seq_len} exceeds the model's {max_positions} positions")
    window = s.seq_len or max_positions
    if s.stride is not None and s.stride > window:
        raise EvalError(f"--stride {s.stride} is larger than the window length {window} (--seq-len): lower --stride")


def _prepare_data(plan: Plan) -> None:
    """Tokenize the evaluation text once and cut it into windows; or say why perplexity is not computed."""
    s = plan.settings
    if s.skip_ppl:
        plan.ppl_note = "skipped (--skip-ppl)"
        return
    if plan.source.random_weights:
        plan.ppl_note = "not meaningful: random weights"
        return
    tokenizer = load_tokenizer(plan.source)
    if tokenizer is None:
        plan.ppl_note = f"skipped: no tokenizer found for {plan.source.path}"
        return
    text = data_mod.load_eval_text(s.data_dir)
    ids = data_mod.tokenize(tokenizer, text.text)  # (1, N)
    if s.stride is None:
        plan.windows = gptq_windows(ids, plan.seq_len, s.max_windows)
    else:
        plan.windows = sliding_windows(ids, plan.seq_len, s.stride, s.max_windows)
    if not plan.windows:
        raise EvalError(f"the text has {ids.shape[1]} tokens, fewer than one window of {plan.seq_len}: "
                        "lower --seq-len")
    plan.data_info = {"source": text.source, "rows": text.rows, "chars": len(text.text), "sha256": text.sha256,
                      "tokens": ids.shape[1], "protocol": "gptq" if s.stride is None else "sliding",
                      "seq_len": plan.seq_len, "stride": s.stride, "windows": len(plan.windows)}
    plan.messages.append(f"data: {text.source} ({text.rows} rows, {len(text.text):,} chars, {ids.shape[1]:,} "
                         f"tokens) -> {len(plan.windows)} windows of {plan.seq_len} tokens "
                         f"({plan.data_info['protocol']} protocol)")


def default_model(device: torch.device) -> tuple[str, str | None, str]:
    """(model spec, data dir or None, why) for a run without --model: the shared trained tiny OPT with the local
    WikiText-2 where they are found (so perplexity means something), else a random config sized to the device."""
    shared = shared_dir()
    tiny, data = shared / "models" / "opt-wt2-tiny", shared / "data" / "wikitext-2-raw"
    if (tiny / "config.json").is_file():
        return str(tiny), str(data) if (data / "wiki.test.raw").is_file() else None, f"the shared tiny OPT ({tiny})"
    spec = "random:opt-1.3b" if device.type == "cuda" else "random:opt-125m"
    return spec, None, f"{spec}, sized to the {device.type.upper()} ({tiny} not found: perplexity skipped)"


def kernel_warning(names, device: torch.device) -> str | None:
    """Why the fuseinfer rows measure correctness, not speed, on ``device`` (no kernels run there), or None."""
    if not any(n.startswith("fuseinfer") for n in names):
        return None
    status = extension_status(device)
    if device.type == "cuda" and status == "built":
        return None
    why = "this is a CPU run" if device.type == "cpu" else f"the CUDA extension is {status}"
    return (f"fuseinfer's CUDA kernels do not run here ({why}): its rows run the ops' PyTorch references, a check of "
            "correctness, not of speed; on a CUDA machine `pip install --no-build-isolation -e .` builds the kernels")


def make_plan(s: Settings) -> Plan:
    """Validate ``s`` and load what every backend shares; raises :class:`EvalError` on any problem."""
    if s.tp < 1:
        raise EvalError(f"--tp must be at least 1, got {s.tp}")
    device = resolve_device(s.device) if s.tp == 1 else _tp_device(s.tp, s.device)
    defaulted = []
    if s.model is None:
        spec, data_dir, why = default_model(device)
        s = Settings(**{**asdict(s), "model": spec, "data_dir": s.data_dir or data_dir,
                        "max_windows": s.max_windows or (DEFAULT_CPU_WINDOWS if device.type == "cpu" else None)})
        defaulted.append(f"no --model: {why}")
    if s.backends is None:
        s = Settings(**{**asdict(s), "backends": DEFAULT_BACKENDS if device.type == "cuda" else DEFAULT_BACKENDS_CPU})
    names = _backend_names(s.backends)
    dtype_name = s.dtype or ("fp16" if device.type == "cuda" else "fp32")
    if dtype_name not in DTYPES:
        raise EvalError(f"unknown dtype {dtype_name!r}: choose from {', '.join(DTYPES)}")
    defaults = {k: v for k, v in LATENCY_DEFAULTS[device.type].items() if getattr(s, k) is None}
    s = Settings(**{**asdict(s), **defaults, "backends": names, "dtype": dtype_name, "device": str(device)})
    source = resolve_model(s.model)
    config = load_config(source)
    scheme = checkpoint_scheme(config)
    if scheme is not None and names != ("fuseinfer",):
        raise EvalError(f"{source.path!r} is a fuseinfer quantized checkpoint ({scheme}): it holds int8 weights "
                        "only, so only the fuseinfer backend runs it (pass --backends fuseinfer); to compare with "
                        "the other backends, give the unquantized model it came from")
    _check_sizes(s, config.max_position_embeddings)
    prompt = torch.randint(0, config.vocab_size, (s.batch_size, s.prompt_len),
                           generator=torch.Generator().manual_seed(s.seed))  # (B, P)
    plan = Plan(s, device, DTYPES[dtype_name], source, config, s.seq_len or config.max_position_embeddings, prompt)
    plan.messages.append(f"model: {source.spec} -> {source.path}"
                         + (" (random weights)" if source.random_weights else ""))
    plan.messages += defaulted
    if device.type == "cpu" and "compile" in names:
        plan.warnings.append("torch.compile on CPU: its timings measure Inductor's CPU code (and minutes of "
                             "compiling), not GPU speed")
    warning = kernel_warning(names, device)
    if warning:
        plan.warnings.append(warning)
    if device.type == "cpu" and dtype_name == "fp16":
        plan.warnings.append("fp16 on CPU runs, but slowly (many CPU kernels upcast); fp32 or bf16 are faster")
    _prepare_data(plan)
    return plan


def _timed(fn, device: torch.device):
    """(fn's result, milliseconds it took)."""
    result = []
    ms = time_call(lambda: result.append(fn()), device)
    return result[0], ms


def _decode(backend: Backend, tokens: torch.Tensor, steps: int, device: torch.device):
    """``steps`` greedy decode steps from tokens (B, 1); returns (tokens (B, steps), ms of each step)."""
    synchronize(device)
    clock, out = StepClock(device), []
    clock.mark()
    for _ in range(steps):
        tokens = backend.decode_step(tokens)  # (B, 1)
        clock.mark()
        out.append(tokens)
    return torch.cat(out, dim=1), clock.intervals()


def _generate(backend: Backend, prompt: torch.Tensor, steps: int, device: torch.device):
    """Prefill then ``steps`` decode steps; returns (tokens (B, 1 + steps), ms of each decode step)."""
    first = backend.prefill(prompt)  # (B, 1)
    rest, step_ms = _decode(backend, first, steps, device)
    return torch.cat([first, rest], dim=1), step_ms


def measure_latency(backend: Backend, plan: Plan, ui) -> tuple[dict, torch.Tensor]:
    """Prefill and decode timings; returns (row fields, greedy tokens (B, 1 + G) of the first timed run)."""
    s, device = plan.settings, plan.device
    prompt = plan.prompt.to(device)
    backend.start(s.batch_size, s.prompt_len + s.gen_len)
    with ui.task(f"{backend.name}: timing", 1 + s.warmup + 2 * s.repeats) as advance:
        first_tokens, prefill_ms = _timed(lambda: backend.prefill(prompt), device)  # includes any compilation
        _, first_steps = _decode(backend, first_tokens, min(FIRST_DECODE_STEPS, s.gen_len), device)
        first_call_s = {"prefill": prefill_ms / 1e3, "decode": sum(first_steps) / 1e3}
        advance()
        for _ in range(s.warmup):
            _generate(backend, prompt, s.gen_len, device)
            advance()
        prefill = []
        for _ in range(s.repeats):
            prefill.append(_timed(lambda: backend.prefill(prompt), device)[1])
            advance()
        decode, generated = [], None
        for _ in range(s.repeats):
            tokens, step_ms = _generate(backend, prompt, s.gen_len, device)
            decode += step_ms
            generated = tokens.cpu() if generated is None else generated
            advance()
    backend.end()
    return {"prefill_ms": summarize(prefill), "decode_ms_per_token": summarize(decode),
            "first_call_s": first_call_s}, generated


def measure_perplexity(backend: Backend, plan: Plan, ui) -> dict:
    """Perplexity over the plan's windows; the first window's time (compilation included) is reported apart."""
    first_ms = []

    def loss(input_ids, labels):
        if first_ms:
            return backend.loss(input_ids, labels)
        value, ms = _timed(lambda: backend.loss(input_ids, labels), plan.device)
        first_ms.append(ms)
        return value

    start = time.perf_counter()
    with ui.task(f"{backend.name}: perplexity", len(plan.windows)) as advance:
        result = perplexity(loss, plan.windows, plan.device, on_window=advance)
    return {"ppl": result.ppl, "nll": result.nll, "ppl_windows": result.windows,
            "ppl_s": time.perf_counter() - start, "ppl_first_call_s": first_ms[0] / 1e3}


def _empty_row(cls: type[Backend], ppl_note: str | None) -> dict:
    return {"name": cls.name, "summary": cls.summary, "status": "ok", "error": None, "ppl": None,
            "ppl_note": ppl_note, "prefill_ms": None, "decode_ms_per_token": None, "peak_memory": None,
            "first_call_s": None, "greedy_match_eager": None}


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _memory_fields(prefix: str, device: torch.device) -> dict:
    peak = peak_memory(device) or {}
    return {f"{prefix}{key}": value for key, value in peak.items()}


def run_backend(cls: type[Backend], plan: Plan, ui) -> tuple[dict, object, torch.Tensor | None]:
    """One backend, isolated: returns (its row, its model stats or None, its greedy tokens or None)."""
    s, device = plan.settings, plan.device
    row = _empty_row(cls, plan.ppl_note)
    reason = cls.unavailable_reason(device)
    if reason:
        row.update(status="unavailable", error=f"cannot run here: {reason}")
        return row, None, None
    free_memory(device)
    reset_peak(device)
    backend, generated = cls(plan.source, plan.config, plan.dtype, device, s.seed, backend_options(s)), None
    memory = {}
    try:
        with torch.no_grad():
            ui.info(f"{cls.name}: loading {plan.source.spec}")
            start = time.perf_counter()
            backend.load()
            row["load_s"] = time.perf_counter() - start
            row.update(backend.details())
            memory["weights_mib"] = allocated_mib(device)
            if not s.skip_latency:
                reset_peak(device)
                fields, generated = measure_latency(backend, plan, ui)
                row.update(fields)
                row.update(backend.details())  # (what the timed runs took, e.g. the fast-decode path)
                memory.update(_memory_fields("", device))
            if plan.windows:
                free_memory(device)
                reset_peak(device)
                row.update(measure_perplexity(backend, plan, ui))
                memory.update(_memory_fields("ppl_", device))
    except EvalError:
        raise
    except Exception as exc:  # compile failures, OOM, missing kernels: reported in the row, the others go on
        if s.debug or s.tp > 1:  # (under --tp a rank that went on would leave its peers waiting in a collective)
            raise
        row.update(status="error", error=_one_line(exc))
        ui.warn(f"{cls.name}: {row['error']}")
    finally:
        row["peak_memory"] = memory if device.type == "cuda" else None
        stats = getattr(backend, "stats", None)
        backend.close()
        del backend
        free_memory(device)
    return row, stats, generated


def _model_info(plan: Plan, stats) -> dict:
    cfg = plan.config
    info = {"spec": plan.source.spec, "path": plan.source.path, "kind": plan.source.kind,
            "random_weights": plan.source.random_weights, "model_type": cfg.model_type,
            "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "heads": cfg.num_attention_heads,
            "vocab": cfg.vocab_size, "max_positions": cfg.max_position_embeddings}
    if stats is not None:
        info.update(params=stats.params, weight_bytes_per_token=stats.weight_bytes_per_token)
    return info


def _greedy_match(tokens: torch.Tensor | None, reference: torch.Tensor | None) -> float | None:
    """Fraction of greedy tokens equal to eager's (one early mismatch changes all later tokens)."""
    if tokens is None or reference is None:
        return None
    return (tokens == reference).double().mean().item()


def run(settings: Settings, ui) -> dict:
    """Run the whole evaluation; returns the results (what ``--output`` writes)."""
    plan = make_plan(settings)
    for message in plan.warnings:
        ui.warn(message)
    for message in plan.messages:
        ui.info(message)
    s = plan.settings
    rows, tokens, stats = {}, {}, None
    # every CUDA call of the run (streams, events, graphs, kernels) on the chosen GPU, e.g. --device cuda:1
    with torch.cuda.device(plan.device) if plan.device.type == "cuda" else contextlib.nullcontext(), \
            cpu_threads(plan.device) as threads:
        if threads:
            ui.info(threads)
        env = environment(plan.device)  # (cpu_threads: the count the timings ran at)
        copy_gbps = None if s.skip_latency else copy_bandwidth_gbps(plan.device)
        for name in s.backends:
            rows[name], backend_stats, tokens[name] = run_backend(_tp_backend(BACKENDS[name], s.tp), plan, ui)
            stats = stats or backend_stats
    for message in spread_warnings(rows):
        ui.warn(message)
        plan.warnings.append(message)
    for name, row in rows.items():
        if stats is not None:  # (a backend that stores weights differently, e.g. int8, states its bytes per token)
            own = replace(stats, weight_bytes_per_token=row["weight_bytes_per_token"]) \
                if row.get("weight_bytes_per_token") else stats
            row.update(derive(row, own, s.batch_size, s.prompt_len, s.gen_len, copy_gbps, rows.get("eager")))
        if name != "eager":
            row["greedy_match_eager"] = _greedy_match(tokens[name], tokens.get("eager"))
    return {"schema": "fuseinfer.eval/1", "settings": {**asdict(s), "seq_len": plan.seq_len},
            "environment": env, "model": _model_info(plan, stats), "data": plan.data_info,
            "ppl_note": plan.ppl_note, "copy_gbps": copy_gbps, "warnings": list(plan.warnings), "backends": rows}
