"""Where ONNX Runtime's time goes, fused vs plain export: one prefill + decode steps per flavour, profiled twice.

1. ORT's own profiler (SessionOptions.enable_profiling): per op type, the time each node took on the host
   ("kernel_time" events; on the CUDA EP that is launch + any synchronous work, since kernels run async).
2. torch.profiler (CUPTI) over the same runs: GPU time per CUDA kernel (ORT's kernels run in this process).
Writes a Markdown summary (argv[3]). Usage: python bench/ort_profile.py FUSED_DIR PLAIN_DIR OUT.md [prompt] [steps]
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict

import torch  # before onnxruntime: loads the CUDA libraries onnxruntime-gpu links against

from fuseinfer.export import OrtDecoder


def run(dec, prompt, steps):
    dec.start(1, prompt.shape[1] + steps + 1)
    tok = dec.prefill(prompt)[:, -1].argmax(-1, keepdim=True)
    for _ in range(steps):
        tok = dec.step(tok)[:, -1].argmax(-1, keepdim=True)
    torch.cuda.synchronize()


def ort_summary(trace_file, runs_per_pass):
    """{phase: {op_type: us per run}} from ORT's trace; runs are numbered: 0 prefill, then decode steps."""
    events = json.load(open(trace_file))
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    runs = runs[-runs_per_pass:]  # the last pass (the earlier one warmed up)
    out = {"prefill": defaultdict(float), "decode": defaultdict(float)}
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        for i, r in enumerate(runs):
            if r["ts"] <= e["ts"] <= r["ts"] + r["dur"]:
                phase = "prefill" if i == 0 else "decode"
                out[phase][e["args"].get("op_name", "?")] += e["dur"] / (1 if i == 0 else runs_per_pass - 1)
    out["run_us"] = {"prefill": runs[0]["dur"], "decode": sum(r["dur"] for r in runs[1:]) / (len(runs) - 1)}
    return out


def main():
    fused_dir, plain_dir, out_md = sys.argv[1:4]
    prompt_len = int(sys.argv[4]) if len(sys.argv) > 4 else 512
    steps = int(sys.argv[5]) if len(sys.argv) > 5 else 32
    prompt = torch.randint(3, 50000, (1, prompt_len), device="cuda")
    lines = [f"# ONNX Runtime profile: prefill {prompt_len} tokens + {steps} decode steps, batch 1",
             f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}", ""]
    for flavour, directory in (("fused", fused_dir), ("plain", plain_dir)):
        dec = OrtDecoder(directory, "cuda", profile_prefix=f"/tmp/ort_prof_{flavour}")
        run(dec, prompt, steps)  # warm-up pass
        run(dec, prompt, steps)
        summary = ort_summary(dec.end_profiling(), steps + 1)
        lines += [f"## {flavour}: ORT profiler (host time per node, us per run)",
                  f"model_run: prefill {summary['run_us']['prefill']:.0f} us, decode {summary['run_us']['decode']:.0f}"
                  " us per step", "", "| op type | prefill us | decode us/step |", "|---|---|---|"]
        ops = sorted(set(summary["prefill"]) | set(summary["decode"]), key=lambda o: -summary["prefill"].get(o, 0))
        lines += [f"| {o} | {summary['prefill'].get(o, 0):.0f} | {summary['decode'].get(o, 0):.1f} |" for o in ops]
        dec2 = OrtDecoder(directory, "cuda")
        run(dec2, prompt, steps)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run(dec2, prompt, steps)
        kernels = sorted(((e.key, e.device_time_total, e.count) for e in prof.key_averages()), key=lambda k: -k[1])
        total = sum(k[1] for k in kernels)
        lines += ["", f"## {flavour}: GPU kernels (torch.profiler/CUPTI), whole pass {total / 1e3:.2f} ms", "",
                  "| kernel | GPU ms | calls | % |", "|---|---|---|---|"]
        lines += [f"| {k[:90]} | {t / 1e3:.3f} | {c} | {100 * t / max(total, 1):.1f} |" for k, t, c in kernels[:15]]
        lines.append("")
        del dec, dec2
    open(out_md, "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
