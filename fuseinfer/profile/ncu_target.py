"""What ``--ncu`` runs under Nsight Compute: the profiled model, backend, phase and inputs, a few steps, no
torch.profiler (``python -m fuseinfer.profile.ncu_target`` with the CLI's model flags)."""
from __future__ import annotations

import sys

import torch

from fuseinfer.profile.api import ProfileSettings, _backend_cls, _context
from fuseinfer.profile.backends import step_function
from fuseinfer.profile.cli import build_parser

STEPS = 4  # ncu skips the first two launches of each kernel (warm-up)


def main(argv=None) -> int:
    args = build_parser(out_required=False).parse_args(argv)  # (run_ncu passes the model flags, no --out)
    s = ProfileSettings(model=args.model, backend=args.backend, phase=args.phase, device=args.device,
                        dtype=args.dtype, batch_size=args.batch_size, prompt_len=args.prompt_len,
                        gen_len=args.gen_len, seed=args.seed, repeats=1)
    ctx = _context(args.model, s)
    cls = _backend_cls(args.backend, args.phase, ctx.device, None)
    backend = cls(ctx.source, ctx.config, ctx.dtype, ctx.device, ctx.settings.seed)
    with torch.no_grad():
        backend.load()
        backend.start(s.batch_size, ctx.settings.prompt_len + STEPS + 40 + (ctx.settings.gen_len or 0))
        prepare, step = step_function(backend, args.phase, ctx.prompt.to(ctx.device), ctx.settings.gen_len)
        prepare()
        for _ in range(STEPS):
            step()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
