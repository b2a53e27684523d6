"""Does compiling and running an unpatched model in the same process slow a patched model's prefill afterwards?

Times a patched random OPT-1.3b fp16 prefill (1 x 2048, use_cache=False) with CUDA events and its host time per
call, then compiles and runs the unpatched model (torch.compile default mode), calls torch._dynamo.reset(), and
times the patched prefill again; for both, the profiler's device-time sum of the kernels. Prints one JSON line.
"""
from __future__ import annotations

import json
import statistics
import time

import torch

import fuseinfer
from fuseinfer.harness.models import load_config, load_model, resolve_model


def timed(fn, n=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dev, host = [], []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t) * 1e3)
        b.record()
        torch.cuda.synchronize()
        dev.append(a.elapsed_time(b))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = sum(e.device_time_total for e in prof.key_averages() if e.device_time_total) / 1e3
    return {"ms": statistics.median(dev), "host_ms": statistics.median(host), "kernel_ms": kernels}


def main():
    src = resolve_model("random:opt-1.3b")
    cfg = load_config(src)
    ids = torch.randint(3, 50000, (1, 2048), device="cuda")
    patched = load_model(src, cfg, torch.float16, torch.device("cuda"), 0)
    fuseinfer.patch(patched)
    run = lambda: patched(input_ids=ids, use_cache=False)  # noqa: E731
    with torch.no_grad():
        before = timed(run)
        plain = load_model(src, cfg, torch.float16, torch.device("cuda"), 1)
        compiled = torch.compile(plain)
        for _ in range(3):
            compiled(input_ids=ids, use_cache=False)
        torch.cuda.synchronize()
        torch._dynamo.reset()
        after_reset = timed(run)
        del compiled, plain
        torch.cuda.empty_cache()
        after_free = timed(run)
        # the eval's own sequence: its compile backend (compiled prefill, StaticCache + reduce-overhead decode with
        # CUDA graphs) runs a generation, closes (torch._dynamo.reset()), then the patched model prefills
        from fuseinfer.harness.backends import CompileBackend

        backend = CompileBackend(src, cfg, torch.float16, torch.device("cuda"), 2)
        backend.load()
        backend.start(1, 2048 + 8)
        tok = backend.prefill(ids[:, :2040])
        for _ in range(6):
            tok = backend.decode_step(tok)
        torch.cuda.synchronize()
        backend.close()
        torch.cuda.empty_cache()
        after_eval_compile = timed(run)
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "before": before, "after_compile_and_reset": after_reset,
                      "after_freeing_the_compiled_model": after_free,
                      "after_the_eval_compile_backend": after_eval_compile,
                      "allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                      "fp16_reduced": torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction}))


if __name__ == "__main__":
    main()
