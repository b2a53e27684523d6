"""The quantized backends' eval figures, one table: reads ``python -m fuseinfer.eval --output`` JSON files and
derives, per backend row, the decode floor and what the W8A16 / W8A8 targets compare against.

Per row (all from the eval JSON; nothing here is measured):
  weight bytes/token   the bytes of the model's tensors one decode step reads (int8 rows: the quantized model's, as
                       ``fuseinfer.quant.backends.weight_bytes_per_token`` counts them: int8 linears + fp32
                       scales + fp16 embeddings / LayerNorms / biases)
  decode GB/s, % copy  the eval's (weights + KV cache per step / decode ms; over the copy bandwidth of that run)
  floor ms             weight bytes/token / copy bandwidth measured in that run (the KV cache left out, as in
                       docs/results.md's floor); "x floor" = decode ms/token / floor ms (W8A16 target: <= 1.25)
  peak / fp16          this row's max allocated MiB / the fp16 ``fuseinfer`` row's in the same file (target <= 0.55)
  prefill / fp16       this row's prefill ms / the fp16 ``fuseinfer`` row's (W8A16 target <= 1.10 at 1x2048; W8A8:
                       <= 0.6 at OPT-6.7b); / eager likewise
  PPL / fp16 - 1       this row's perplexity over the fp16 ``fuseinfer`` row's (W8A16 target <= 0.5%, W8A8 <= 2%)
Usage: python bench/quant_eval_summary.py NAME EVAL_JSON... -> $FUSEINFER_BENCH_DIR/NAME.md and .json (printed too)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import RESULTS_DIR  # noqa: E402

COLUMNS = ["file", "model", "backend", "B", "P", "G", "status", "prefill ms", "prefill / fp16", "prefill / eager",
           "decode ms/tok", "weight bytes/token", "decode GB/s", "% copy", "floor ms", "x floor", "peak MiB",
           "peak / fp16", "PPL", "PPL / fp16 - 1", "calibration s", "decode path"]


def _median(row: dict, key: str):
    return (row.get(key) or {}).get("median")


def rows_of(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    s, copy = data["settings"], data.get("copy_gbps")
    backends = data["backends"]
    fp16, eager = backends.get("fuseinfer") or {}, backends.get("eager") or {}
    fp16_peak = (fp16.get("peak_memory") or {}).get("max_allocated_mib")
    out = []
    for name, row in backends.items():
        wbytes = row.get("weight_bytes_per_token") or data["model"].get("weight_bytes_per_token")
        decode, prefill = _median(row, "decode_ms_per_token"), _median(row, "prefill_ms")
        floor = wbytes / (copy * 1e9) * 1e3 if wbytes and copy else None  # ms
        peak = (row.get("peak_memory") or {}).get("max_allocated_mib")
        ratio = lambda a, b: a / b if a and b else None  # noqa: E731
        out.append({
            "file": path.name, "model": data["model"].get("spec"), "backend": name, "B": s["batch_size"],
            "P": s["prompt_len"], "G": s["gen_len"], "status": row.get("status") if not row.get("error") else
            f"{row.get('status')}: {row['error']}", "prefill ms": prefill,
            "prefill / fp16": ratio(prefill, _median(fp16, "prefill_ms")) if name != "fuseinfer" else None,
            "prefill / eager": ratio(prefill, _median(eager, "prefill_ms")) if name != "eager" else None,
            "decode ms/tok": decode, "weight bytes/token": wbytes, "decode GB/s": row.get("decode_gbps"),
            "% copy": 100 * row["decode_bw_fraction"] if row.get("decode_bw_fraction") else None,
            "floor ms": floor, "x floor": ratio(decode, floor), "peak MiB": peak,
            "peak / fp16": ratio(peak, fp16_peak) if name != "fuseinfer" else None, "PPL": row.get("ppl"),
            "PPL / fp16 - 1": ratio(row.get("ppl"), fp16.get("ppl")) - 1
            if name != "fuseinfer" and ratio(row.get("ppl"), fp16.get("ppl")) else None,
            "calibration s": row.get("calibration_seconds"), "decode path": row.get("decode"),
        })
    return out


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v).replace("|", "/")


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    name, paths = sys.argv[1], [Path(p) for p in sys.argv[2:]]
    rows, missing = [], []
    for p in paths:
        if p.is_file():
            rows += rows_of(p)
        else:
            missing.append(str(p))
    lines = [f"# {name}", "", "Derived from the eval JSON files (see bench/quant_eval_summary.py for the formulas).",
             *(f"Missing (that eval did not write its file): {m}" for m in missing), "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r[c]) for c in COLUMNS) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"{name}.md").write_text(text)
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps({"rows": rows, "missing": missing}, indent=1))
    print(f"wrote {RESULTS_DIR / (name + '.md')}")
    return 1 if missing or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
