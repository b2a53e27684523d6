"""Command line of ``python -m fuseinfer.eval``: parse flags, run, print and write the results.

Exit codes: 0 success (a backend that could not run is reported in its row), 2 bad usage, unknown model or
backend, missing data or device, an output file that cannot be written (checked before the run, where it can be)
-- always as one line on stderr, never a traceback.
"""
from __future__ import annotations

import argparse
import os
import sys

from rich.console import Console

from fuseinfer.core import files, knobs
from fuseinfer.core.errors import FuseInferError
from fuseinfer.eval.backends import BACKENDS
from fuseinfer.eval.report import output_problem, print_table, write_json, write_markdown, write_plot
from fuseinfer.eval.runner import DEFAULT_BACKENDS, DEFAULT_BACKENDS_CPU, LATENCY_DEFAULTS, Settings, run
from fuseinfer.harness.devices import DTYPES
from fuseinfer.harness.errors import EvalError
from fuseinfer.harness.models import SHORT_NAMES
from fuseinfer.harness.ui import ConsoleUI

EXAMPLE = "python -m fuseinfer.eval --model opt-1.3b --backends eager,compile,fuseinfer --dtype fp16"


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (and exit code 2, as argparse)."""

    def error(self, message):
        raise EvalError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m fuseinfer.eval",
                description="What fuseinfer.patch buys on your model and GPU: perplexity on WikiText-2, prefill "
                            "and decode latency, throughput and peak memory for each backend.",
                epilog=f"example: {EXAMPLE}")
    p.add_argument("--model",
                   help=f"short name ({', '.join(SHORT_NAMES)}), hub id, local directory, or random:<name> "
                        "(the real config with random weights: latency and memory only). Default: the shared "
                        "trained tiny OPT ($FUSEINFER_SHARED/models/opt-wt2-tiny) with the local WikiText-2 where "
                        "found, else random:opt-1.3b on CUDA / random:opt-125m on CPU: no download")
    p.add_argument("--backends",
                   help=f"comma-separated, from: {', '.join(BACKENDS)} (default: {','.join(DEFAULT_BACKENDS)} on "
                        f"CUDA, {','.join(DEFAULT_BACKENDS_CPU)} on CPU)")
    p.add_argument("--dtype", choices=list(DTYPES), help="default: fp16 on cuda, fp32 on cpu")
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when a GPU is visible)")
    p.add_argument("--batch-size", type=int, default=1)
    gpu, cpu = LATENCY_DEFAULTS["cuda"], LATENCY_DEFAULTS["cpu"]
    for flag, key, text in (("--prompt-len", "prompt_len", "prompt tokens (random ids) for latency"),
                            ("--gen-len", "gen_len", "greedy decode steps timed after each prefill"),
                            ("--warmup", "warmup", "untimed generations before timing (after the first calls)"),
                            ("--repeats", "repeats", "timed prefills, and timed generations")):
        p.add_argument(flag, type=int, help=f"{text} (default: {gpu[key]} on cuda, {cpu[key]} on cpu)")
    p.add_argument("--seq-len", type=int, help="perplexity window (default: the model's max positions)")
    p.add_argument("--stride", type=int, help="sliding-window perplexity with this stride (default: GPTQ windows)")
    p.add_argument("--max-windows", type=int, help="score at most this many windows")
    p.add_argument("--data-dir", help="folder with wiki.test.raw / wiki.valid.raw, for perplexity and calibration "
                                      "(default: $FUSEINFER_DATA_DIR, else $FUSEINFER_SHARED/data/wikitext-2-raw, "
                                      "else datasets)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt and of random: weights")
    p.add_argument("--skip-ppl", action="store_true", help="no perplexity")
    p.add_argument("--skip-latency", action="store_true", help="no prefill / decode timing")
    p.add_argument("--output", help="write all results and settings as JSON here")
    p.add_argument("--markdown", help="write the table with settings and environment as Markdown here")
    p.add_argument("--plot", help="write a PNG of latency and memory per backend here")
    p.add_argument("--overwrite", action="store_true", help="replace existing --output / --markdown / --plot files")
    p.add_argument("--debug", action="store_true", help="raise a backend's error instead of reporting it")
    p.add_argument("--onnx-dir", help="ort / ort-plain / tensorrt: keep and reuse exports here (default: "
                                      "$FUSEINFER_ONNX_DIR, else a temporary export per run)")
    p.add_argument("--calibration-data", help="fuseinfer-w8a8(-static), fuseinfer-fp8-static: calibration text "
                                              "file, folder with wiki.valid.raw, or "
                                              "saved SmoothQuant statistics (.safetensors) (default: "
                                              "$FUSEINFER_CALIBRATION_DATA, else wiki.valid.raw found as for "
                                              "--data-dir)")
    p.add_argument("--calibration-samples", type=int, help="fuseinfer-w8a8(-static), fuseinfer-fp8-static: "
                                                           "calibration windows of 512 tokens "
                                                           "(default: $FUSEINFER_CALIBRATION_SAMPLES, else 128)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size: launch with torchrun --nproc-per-node N -m fuseinfer.eval ... --tp N "
                        "(fuseinfer backend only; rank 0 prints and writes)")
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
    backends = tuple(args.backends.split(",")) if args.backends else None
    return Settings(model=args.model, backends=backends, dtype=args.dtype, device=args.device,
                    batch_size=args.batch_size, prompt_len=args.prompt_len,
                    gen_len=args.gen_len, warmup=args.warmup, repeats=args.repeats, seq_len=args.seq_len,
                    stride=args.stride, max_windows=args.max_windows, data_dir=args.data_dir, seed=args.seed,
                    skip_ppl=args.skip_ppl, skip_latency=args.skip_latency, debug=args.debug, tp=args.tp,
                    onnx_dir=args.onnx_dir, calibration_data=args.calibration_data,
                    calibration_samples=args.calibration_samples)


def output_files(args: argparse.Namespace) -> list[tuple]:
    """(flag, path, writer) of each file asked for; raises :class:`EvalError` for one that cannot be written."""
    outputs = [(flag, path, write) for flag, path, write in (
        ("--output", args.output, write_json), ("--markdown", args.markdown, write_markdown),
        ("--plot", args.plot, write_plot)) if path]
    for flag, path, write in outputs:
        try:
            files.check_writable(path, overwrite=args.overwrite, flag=flag)
        except files.WriteError as exc:
            raise EvalError(str(exc)) from None
        problem = output_problem(path, plot=write is write_plot)
        if problem:
            raise EvalError(f"cannot write {flag} {path}: {problem}")
    return outputs


def check_knob_flags(args: argparse.Namespace) -> None:
    """Check the flags that stand for knobs (fuseinfer-w8a8's calibration, the ort exports, the data folder) as
    the knobs are checked; a flag beside a different environment value wins, and says so. The values travel in
    the settings, not the environment. Bad values raise :class:`EvalError` naming the flag or variable."""
    if args.calibration_samples is not None and args.calibration_samples < 1:
        raise EvalError(f"--calibration-samples must be >= 1, got {args.calibration_samples}")
    try:
        for name, flag, value in (("FUSEINFER_ONNX_DIR", "--onnx-dir", args.onnx_dir),
                                  ("FUSEINFER_DATA_DIR", "--data-dir", args.data_dir),
                                  ("FUSEINFER_CALIBRATION_DATA", "--calibration-data", args.calibration_data),
                                  ("FUSEINFER_CALIBRATION_SAMPLES", "--calibration-samples",
                                   args.calibration_samples)):
            knobs.from_flag(name, flag, value, set_knob=False)
    except FuseInferError as exc:
        raise EvalError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    from huggingface_hub.utils import logging as hub_logging
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress bars say what is loading
    hub_logging.set_verbosity_error()  # a failed download ends in one message, not one per retry
    try:
        args = build_parser().parse_args(argv)
        outputs = output_files(args)  # before the run: a bad path should not wait for the end of a long run
        check_knob_flags(args)
        lead = args.tp == 1 or os.environ.get("RANK", "0") == "0"  # under --tp, rank 0 prints and writes
        results = run(settings_from_args(args), ConsoleUI(None if lead else Console(quiet=True)))
        if not lead:
            return 0
        console = Console()
        print_table(results, console if console.is_terminal else Console(width=160))
        for flag, path, write in outputs:
            try:
                write(results, path, overwrite=args.overwrite)
            except files.WriteError as exc:  # what changed on disk during the run
                raise EvalError(str(exc)) from None
            except OSError as exc:
                raise EvalError(f"cannot write {flag} {path}: {exc.strerror or exc}; choose another path") from None
            print(f"wrote {path}", file=sys.stderr)
    except EvalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
