"""Where ONNX Runtime's time goes, fused vs plain export: batch 1, one prefill of P tokens + N decode steps.

One session per flavour (loaded in this fresh process: the load time is reported), three passes:
1. warm-up;
2. timed by wall clock with a synchronisation at the end of each phase: prefill ms and decode ms/step, and the
   host time spent building the IO bindings (OrtDecoder.host_bind_s); ORT's own profiler (SessionOptions.
   enable_profiling) records this pass: host time per node, summed per op type and execution provider
   ("_kernel_time" events; on the CUDA EP that is the launch plus any synchronous work, kernels run async);
3. under torch.profiler (CUPTI): GPU time per CUDA kernel, prefill and decode apart (ORT's kernels run in this
   process). GPU busy time per decode step vs the step's wall time says whether decode is GPU- or host-bound.
Writes Markdown (argv[3]) and JSON next to it.

    python bench/ort_profile.py FUSED_DIR PLAIN_DIR OUT.md [prompt=512] [steps=32]
"""
from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch  # before onnxruntime: loads the CUDA libraries onnxruntime-gpu links against

from fuseinfer.export import OrtDecoder


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run of this script (CI), no GPU figures


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def run(dec, prompt, steps):
    """(prefill s, decode s per step), each phase timed to its end on the GPU."""
    dec.start(1, prompt.shape[1] + steps + 1)
    sync()
    t0 = time.perf_counter()
    tok = dec.prefill(prompt)[:, -1].argmax(-1, keepdim=True)
    sync()
    t1 = time.perf_counter()
    for _ in range(steps):
        tok = dec.step(tok)[:, -1].argmax(-1, keepdim=True)
    sync()
    t2 = time.perf_counter()
    dec.end()
    return t1 - t0, (t2 - t1) / steps


def ort_summary(trace_file, first_run, runs_per_pass):
    """Host us per op type (and provider) of the pass whose runs are [first_run, first_run + runs_per_pass): run 0
    of the pass is the prefill, the others decode steps."""
    events = json.loads(Path(trace_file).read_text())
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    runs = runs[first_run:first_run + runs_per_pass]
    out = {"prefill": defaultdict(float), "decode": defaultdict(float), "providers": defaultdict(set)}
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        op = e["args"].get("op_name", "?")
        for i, r in enumerate(runs):
            if r["ts"] <= e["ts"] <= r["ts"] + r["dur"]:
                phase = "prefill" if i == 0 else "decode"
                out[phase][op] += e["dur"] / (1 if i == 0 else len(runs) - 1)
                out["providers"][op].add(e["args"].get("provider", "?").replace("ExecutionProvider", ""))
                break
    out["run_us"] = {"prefill": runs[0]["dur"], "decode": sum(r["dur"] for r in runs[1:]) / (len(runs) - 1)}
    return out


def gpu_kernels(fn):
    """[(kernel, GPU us, calls)] of what ``fn`` ran, by CUPTI, longest first."""
    activity = torch.profiler.ProfilerActivity.CUDA if DEVICE == "cuda" else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        fn()
        sync()
    rows = [(e.key, e.device_time_total, e.count) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda k: -k[1])


def main():
    fused_dir, plain_dir, out_md = sys.argv[1:4]
    prompt_len = int(sys.argv[4]) if len(sys.argv) > 4 else 512
    steps = int(sys.argv[5]) if len(sys.argv) > 5 else 32
    vocab = json.loads((Path(fused_dir) / "fuseinfer_onnx.json").read_text())["model"]["vocab"]
    prompt = torch.randint(3, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    lines = [f"# ONNX Runtime profile: batch 1, prefill {prompt_len} tokens + {steps} decode steps",
             f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else 'CPU'}, torch {torch.__version__}, onnxruntime "
             f"{__import__('onnxruntime').__version__}", ""]
    result = {}
    for flavour, directory in (("fused", fused_dir), ("plain", plain_dir)):
        dec = OrtDecoder(directory, DEVICE, profile_prefix=f"/tmp/ort_prof_{flavour}")
        logits = dec.logits(prompt[:, :16]).float()
        finite = bool(torch.isfinite(logits).all())
        run(dec, prompt, steps)  # pass 1: warm-up
        bind0, runs0 = dec.host_bind_s, dec.runs
        prefill_s, step_s = run(dec, prompt, steps)  # pass 2: timed, ORT-profiled
        bind_us = 1e6 * (dec.host_bind_s - bind0) / (dec.runs - runs0)
        dec.start(1, prompt_len + 1)
        pre = gpu_kernels(lambda dec=dec: dec.prefill(prompt))  # pass 3: CUPTI
        dec.start(1, prompt_len + steps + 1)
        tok = dec.prefill(prompt)[:, -1].argmax(-1, keepdim=True)

        def decode(tok=tok, dec=dec):
            for _ in range(steps):
                tok = dec.step(tok)[:, -1].argmax(-1, keepdim=True)

        dec_k = gpu_kernels(decode)
        dec.end()
        summary = ort_summary(dec.end_profiling(), 1 + steps + 1, steps + 1)  # pass 2: after logits() and pass 1
        gpu_pre_ms = sum(k[1] for k in pre) / 1e3
        gpu_step_ms = sum(k[1] for k in dec_k) / 1e3 / steps
        result[flavour] = {"session_load_s": dec.load_s, "logits_finite": finite, "prefill_ms": 1e3 * prefill_s,
                           "decode_ms_per_step": 1e3 * step_s, "host_bind_us_per_run": bind_us,
                           "gpu_prefill_ms": gpu_pre_ms, "gpu_decode_ms_per_step": gpu_step_ms,
                           "ort_run_us": summary["run_us"],
                           "ort_host_us": {p: dict(summary[p]) for p in ("prefill", "decode")},
                           "providers": {k: sorted(v) for k, v in summary["providers"].items()},
                           "top_kernels_prefill": pre[:12], "top_kernels_decode": dec_k[:12]}
        r = result[flavour]
        on_cpu = sorted(op for op, p in r["providers"].items() if "CPU" in p)
        lines += [f"## {flavour}",
                  f"- fresh-process session load {r['session_load_s']:.1f} s; logits finite: {finite}",
                  f"- wall: prefill {r['prefill_ms']:.2f} ms, decode {r['decode_ms_per_step']:.3f} ms/step; GPU busy "
                  f"(CUPTI kernel sum): prefill {gpu_pre_ms:.2f} ms, decode {gpu_step_ms:.3f} ms/step "
                  f"({100 * gpu_step_ms / max(r['decode_ms_per_step'], 1e-9):.0f}% of the step's wall time)",
                  f"- host per run: IO binding {bind_us:.0f} us; ORT model_run prefill "
                  f"{summary['run_us']['prefill']:.0f} us, decode {summary['run_us']['decode']:.0f} us",
                  f"- ops on the CPU provider: {', '.join(on_cpu) or 'none'}", "",
                  "| op type | provider | ORT host us prefill | us/decode step |", "|---|---|---|---|"]
        ops = sorted(set(summary["prefill"]) | set(summary["decode"]), key=lambda o: -summary["decode"].get(o, 0))
        lines += [f"| {o} | {'/'.join(r['providers'].get(o, []))} | {summary['prefill'].get(o, 0):.0f} | "
                  f"{summary['decode'].get(o, 0):.1f} |" for o in ops[:14]]
        for phase, kernels, total, per in (("prefill", pre, gpu_pre_ms, 1), ("decode", dec_k, gpu_step_ms, steps)):
            lines += ["", f"GPU kernels, {phase} ({'per step' if per > 1 else 'one prefill'}): {total:.3f} ms", "",
                      "| kernel | GPU us | calls | % |", "|---|---|---|---|"]
            whole = sum(k[1] for k in kernels) or 1
            lines += [f"| {k[:80]} | {t / per:.1f} | {c // per} | {100 * t / whole:.1f} |" for k, t, c in kernels[:8]]
        lines.append("")
        dec = None  # frees this session before the next one loads
    if "fused" in result and "plain" in result:
        f, p = result["fused"], result["plain"]
        lines.append(f"fused / plain: prefill {f['prefill_ms'] / p['prefill_ms']:.2f}x, decode "
                     f"{f['decode_ms_per_step'] / p['decode_ms_per_step']:.2f}x the time (below 1: fused is faster)")
    Path(out_md).write_text("\n".join(lines) + "\n")
    Path(out_md).with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
