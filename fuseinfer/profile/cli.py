"""Command line of ``python -m fuseinfer.profile``.

Exit codes: 0 success; 2 bad input (unknown backend or one not installed, a phase the backend lacks, an unwritable
out dir, ``--ncu`` without ncu, unknown model, bad sizes, a ``--data-dir`` that does not exist), always one line on
stderr, never a traceback.
"""
from __future__ import annotations

import argparse
import sys

from rich.console import Console

from fuseinfer.core import knobs
from fuseinfer.core.errors import FuseInferError
from fuseinfer.harness.devices import DTYPES
from fuseinfer.harness.models import SHORT_NAMES
from fuseinfer.profile.api import DEFAULTS
from fuseinfer.profile.backends import PHASES, available_backends
from fuseinfer.profile.errors import ProfileError

EXAMPLE = ("python -m fuseinfer.profile --model random:opt-1.3b --backend fuseinfer --compare eager --phase prefill "
           "--prompt-len 2048 --out prof/")


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ProfileError(f"{message} (see --help)")


def build_parser(out_required: bool = True) -> argparse.ArgumentParser:
    """The CLI's flags; ``out_required=False`` for ``ncu_target``, which writes nothing."""
    p = _Parser(prog="python -m fuseinfer.profile",
                description="Where a step's time goes (ops, kernels, module kinds, layers), what bounds it (roofline "
                            "against ceilings measured in the same run) and what to do about it (hints).",
                epilog=f"example: {EXAMPLE}")
    p.add_argument("--model", required=True,
                   help=f"short name ({', '.join(SHORT_NAMES)}), hub id, local directory, or random:<name>")
    p.add_argument("--backend", default="fuseinfer", help=f"one of {', '.join(available_backends())} "
                                                          "(default: %(default)s)")
    p.add_argument("--phase", default="prefill", choices=None, help=f"{' | '.join(PHASES)} (default: %(default)s)")
    p.add_argument("--compare", help="a second backend profiled on the same inputs, side by side")
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when a GPU is visible)")
    p.add_argument("--dtype", choices=list(DTYPES), help="default: fp16 on cuda, fp32 on cpu")
    p.add_argument("--batch-size", type=int, default=1)
    gpu, cpu = DEFAULTS["cuda"], DEFAULTS["cpu"]
    p.add_argument("--prompt-len", type=int, help=f"prompt tokens (default {gpu['prompt_len']} cuda, "
                                                  f"{cpu['prompt_len']} cpu)")
    p.add_argument("--gen-len", type=int, help=f"decode steps of a generate step (default {gpu['gen_len']} cuda, "
                                               f"{cpu['gen_len']} cpu)")
    p.add_argument("--steps", type=int, dest="active", help=f"profiled (active) steps (default {gpu['active']} cuda, "
                                                            f"{cpu['active']} cpu)")
    p.add_argument("--wait", type=int, default=1, help="profiler schedule: steps skipped first (default 1)")
    p.add_argument("--warmup", type=int, default=1, help="profiler schedule: warm-up steps traced and dropped "
                                                         "(default 1)")
    p.add_argument("--repeats", type=int, help=f"steps timed without the profiler (default {gpu['repeats']} cuda, "
                                               f"{cpu['repeats']} cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", help="folder with wiki.valid.raw, the calibration text of fuseinfer-w8a8 (sets "
                                      "$FUSEINFER_DATA_DIR; default: $FUSEINFER_DATA_DIR, else "
                                      "$FUSEINFER_SHARED/data/wikitext-2-raw, else datasets)")
    p.add_argument("--out", required=out_required, help="folder for the trace, tables, plots and summary.md (new or "
                                                        "empty; with --overwrite also an earlier profile)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier profile in --out")
    p.add_argument("--top", type=int, default=12, help="rows of the printed op / kernel tables")
    p.add_argument("--no-tensorboard", action="store_true", help="skip the TensorBoard log dir")
    p.add_argument("--no-nvtx", action="store_true", help="no NVTX ranges on CUDA")
    p.add_argument("--ncu", action="store_true", help="re-run the top kernels under Nsight Compute (ncu on PATH)")
    p.add_argument("--ncu-top", type=int, default=5, help="kernels per backend for --ncu (default 5)")
    p.add_argument("--debug", action="store_true", help="raise a backend's error with its traceback")
    return p


def main(argv: list[str] | None = None) -> int:
    from huggingface_hub.utils import logging as hub_logging
    from transformers.utils import logging as hf_logging

    from fuseinfer.harness.ui import ConsoleUI
    from fuseinfer.profile import report
    from fuseinfer.profile.api import check_out_dir, profile

    hf_logging.disable_progress_bar()
    hub_logging.set_verbosity_error()
    try:
        args = build_parser().parse_args(argv)
        if args.ncu:
            from fuseinfer.profile.ncu import ncu_path

            ncu_path()  # before the run: one clear line when ncu is missing
        try:  # (read by the fuseinfer-w8a8 backend's calibration, through fuseinfer.core.data)
            knobs.from_flag("FUSEINFER_DATA_DIR", "--data-dir", args.data_dir)
        except FuseInferError as exc:
            raise ProfileError(str(exc)) from None
        check_out_dir(args.out, args.overwrite)  # creates nothing: the folder appears when the profile is done
        ui = ConsoleUI()
        result = profile(args.model, args.backend, args.phase, compare=args.compare, out=args.out,
                         overwrite=args.overwrite, ui=ui,
                         device=args.device, dtype=args.dtype, batch_size=args.batch_size,
                         prompt_len=args.prompt_len, gen_len=args.gen_len, active=args.active, wait=args.wait,
                         warmup=args.warmup, repeats=args.repeats, seed=args.seed,
                         tensorboard=not args.no_tensorboard, nvtx=not args.no_nvtx, debug=args.debug)
        if args.ncu:
            from pathlib import Path

            from fuseinfer.profile.ncu import run_ncu

            for note in run_ncu(result, args.ncu_top, ui=ui):
                ui.warn(note)
            report.rewrite_all(result, Path(args.out))  # again, with the ncu columns
        console = Console()
        report.print_result(result, console if console.is_terminal else Console(width=180), top=args.top)
    except FuseInferError as exc:  # ours, the eval's (unknown model, device) and the writer's (e.g. a race on --out)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
