"""``python -m fuseinfer.export onnx|tensorrt ...``: export a model of a family fuseinfer patches, one line on stderr
for bad input.

    python -m fuseinfer.export onnx --model opt-1.3b --dtype fp16 --device cuda --out opt13b-onnx [--plain]
    python -m fuseinfer.export tensorrt --onnx opt13b-onnx-plain --out opt13b.plan --fp16

Exit codes: 0 done, 2 bad input (unknown model, a model of another family, existing --out without --overwrite, an --out that
holds anything but an earlier export, unwritable --out, missing package), always as one ``error:`` line.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from fuseinfer.core.errors import FuseInferError
from fuseinfer.harness.errors import EvalError
from fuseinfer.harness.models import SHORT_NAMES, load_config, load_model, resolve_model
from fuseinfer.export.errors import ExportError

DTYPES = {"fp16": torch.float16, "fp32": torch.float32}


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ExportError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m fuseinfer.export",
                description="Export OPT and Llama-architecture models to ONNX and TensorRT.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    o = sub.add_parser("onnx", help="ONNX graph with a KV cache (+ fuseinfer_onnx.json)")
    o.add_argument("--model", required=True, help=f"short name ({', '.join(SHORT_NAMES)}), hub id, local "
                                                  "directory, or random:<name>")
    o.add_argument("--out", required=True, help="output directory: new or empty; with --overwrite also an earlier "
                                                "export (a folder holding anything else is never replaced)")
    o.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: fp16 on cuda, fp32 on cpu")
    o.add_argument("--device", default=None, help="cuda or cpu (default: cuda when visible)")
    flavour = o.add_mutually_exclusive_group()
    flavour.add_argument("--fused", dest="flavour", action="store_const", const="fused",
                         help="onnxruntime contrib ops (default)")
    flavour.add_argument("--plain", dest="flavour", action="store_const", const="plain",
                         help="standard ONNX ops only")
    o.add_argument("--int8", action="store_true", help="not supported yet (refused with a message)")
    o.add_argument("--seed", type=int, default=0, help="seed of random: weights (as in fuseinfer.eval)")
    o.add_argument("--overwrite", action="store_true")
    t = sub.add_parser("tensorrt", help="TensorRT engine from a --plain ONNX export (not yet run: written against TensorRT's documented API)")
    t.add_argument("--onnx", required=True, help="directory written by 'onnx --plain'")
    t.add_argument("--out", required=True, help="engine file, e.g. model.plan")
    t.add_argument("--fp16", action="store_true")
    t.add_argument("--int8", action="store_true")
    t.add_argument("--max-batch", type=int, default=8)
    t.add_argument("--overwrite", action="store_true")
    return p


def _onnx(args) -> dict:
    from fuseinfer.export.onnx_export import check_out_dir, to_onnx

    if args.int8:
        raise ExportError("--int8 export is not implemented yet: export fp16 or fp32")
    check_out_dir(Path(args.out).expanduser().absolute(), args.overwrite)  # before minutes of loading
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ExportError(f"--device {args.device} but no CUDA GPU is visible; use --device cpu")
    dtype = DTYPES[args.dtype or ("fp16" if device.type == "cuda" else "fp32")]
    source = resolve_model(args.model)
    config = load_config(source, quantized="the ONNX graph is exported from fp16 / fp32 weights, which it does "
                                           "not hold")
    start = time.perf_counter()
    model = load_model(source, config, dtype, device, args.seed)
    load_s = time.perf_counter() - start
    manifest = to_onnx(model, args.out, args.flavour or "fused", dtype=dtype, device=device,
                       overwrite=args.overwrite, source=source.spec)
    return {"out": str(Path(args.out).absolute()), "load_s": round(load_s, 2),
            "export_s": manifest["export_seconds"], "flavour": manifest["flavour"], "dtype": manifest["dtype"],
            "contrib_ops": manifest["contrib_ops"]}


def _tensorrt(args) -> dict:
    from fuseinfer.export.tensorrt import build_engine

    start = time.perf_counter()
    out = build_engine(args.onnx, args.out, fp16=args.fp16, int8=args.int8, max_batch=args.max_batch,
                       overwrite=args.overwrite)
    return {"out": str(out), "build_s": round(time.perf_counter() - start, 2)}


def main(argv: list[str] | None = None) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        args = build_parser().parse_args(argv)
        result = _onnx(args) if args.command == "onnx" else _tensorrt(args)
    except (ExportError, EvalError, FuseInferError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0
