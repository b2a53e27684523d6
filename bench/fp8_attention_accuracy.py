"""What FP8 attention (QKᵀ and PV in e4m3) would cost in accuracy, emulated on the CPU: WikiText-2 test perplexity
of the tiny trained OPT with its attention replaced by an emulation of an e4m3 attention kernel, against the same
model's fp32 attention (a question to answer before building such a kernel: the FP8 scheme's bound is 0.5% of the
unquantized perplexity for the whole model).

The emulation quantizes the way a FlashAttention-3-style FP8 kernel can: q and k per (token, head) to e4m3 (scale =
amax over the head dim / 448, applied to the fp32 scores row- and column-wise, so the products of e4m3 values are
exact and summed in fp32), the softmax in fp32, then P in e4m3 (as it is, values in [0, 1], or times 256 to use
e4m3's range, a power of two so the scale is exact), V per (head, channel) over the window's keys, and the
normalisation by the fp32 row sum last. Variants:

  fp32         the model's own attention math in fp32 (the reference);
  qk           QKᵀ in e4m3, PV in fp32;
  qk+pv        QKᵀ and PV in e4m3, P as it is;
  qk+pv p256   QKᵀ and PV in e4m3, P times 256 before its e4m3 rounding.

The rest of the model stays fp32 (the emulation isolates the attention's own error).

Usage: python bench/fp8_attention_accuracy.py --out DIR [--model PATH] [--data-dir DIR] [--max-windows N]
  -> DIR/fp8_attention_accuracy.{json,md}; PATH defaults to <shared>/models/opt-wt2-tiny and DIR to
  <shared>/data/wikitext-2-raw, <shared> being $FUSEINFER_SHARED (default ../shared).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
VARIANTS = {"fp32": (False, False, 1.0), "qk": (True, False, 1.0), "qk+pv": (True, True, 1.0),
            "qk+pv p256": (True, True, 256.0)}  # name -> (QKᵀ in e4m3, PV in e4m3, P's scale)
NAME = "fuseinfer_fp8_emulation"


def e4m3(x: torch.Tensor, dim) -> torch.Tensor:
    """x rounded to e4m3 with a scale of amax / 448 over ``dim`` (kept), back in fp32 with the scale multiplied in:
    the values whose products a kernel sums (it applies the scales to its fp32 sums instead; the same up to fp32
    rounding)."""
    scale = (x.abs().amax(dim=dim, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale


def emulated_attention(q, k, v, mask, qk8: bool, pv8: bool, p_scale: float) -> torch.Tensor:
    """q (B, H, S, D) (already scaled: no 1 / sqrt(D) here), k, v (B, H, Skv, D), mask (B, 1|H, S, Skv) bool or
    None (causal) -> (B, S, H, D) fp32."""
    q, k, v = q.float(), k.float(), v.float()
    if qk8:
        q, k = e4m3(q, -1), e4m3(k, -1)  # per (token, head)
    scores = q @ k.transpose(-1, -2)  # (B, H, S, Skv)
    if mask is None:
        s, skv = scores.shape[-2:]
        mask = torch.ones(s, skv, dtype=torch.bool).tril(skv - s)
    scores = scores.masked_fill(~mask, float("-inf"))
    p = torch.exp(scores - scores.amax(-1, keepdim=True))  # (B, H, S, Skv) in [0, 1]
    row_sum = p.sum(-1, keepdim=True)  # fp32, before P's rounding (as the kernel sums its fp32 P)
    if pv8:
        p = (p * p_scale).to(FP8).float() / p_scale
        v = e4m3(v, -2)  # per (head, channel) over the keys
    return (p @ v / row_sum).transpose(1, 2).contiguous()


def run(model_path: str, data_dir: str, max_windows: int | None, seq_len: int) -> list[dict]:
    from transformers import AttentionInterface, AutoTokenizer, OPTForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from fuseinfer.harness.data import load_eval_text, tokenize
    from fuseinfer.harness.perplexity import gptq_windows, perplexity

    variant = {"now": VARIANTS["fp32"]}

    def attention(module, query, key, value, attention_mask, scaling=1.0, dropout=0.0, **kwargs):
        mask = attention_mask if isinstance(attention_mask, torch.Tensor) else None
        out = emulated_attention(query * scaling, key, value, mask, *variant["now"])
        return out.to(query.dtype), None

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    tok = AutoTokenizer.from_pretrained(model_path)
    model = OPTForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    model.config._attn_implementation = NAME
    windows = gptq_windows(tokenize(tok, load_eval_text(data_dir).text), seq_len, max_windows)
    rows, base = [], None
    for name, settings in VARIANTS.items():
        variant["now"] = settings
        t0 = time.perf_counter()
        with torch.no_grad():
            ppl = perplexity(lambda i, l: model(input_ids=i, labels=l).loss, windows, torch.device("cpu")).ppl
        base = ppl if base is None else base
        rows.append({"variant": name, "ppl": ppl, "vs fp32 %": 100 * (ppl / base - 1), "windows": len(windows),
                     "seconds": round(time.perf_counter() - t0, 1)})
        print(rows[-1], flush=True)
    return rows


def write(out: Path, rows: list[dict], settings: dict) -> Path:
    """out/fp8_attention_accuracy.{json,md}."""
    from fuseinfer.harness.environment import environment

    out.mkdir(parents=True, exist_ok=True)
    env = environment(torch.device("cpu"))
    (out / "fp8_attention_accuracy.json").write_text(json.dumps(
        {"name": "fp8_attention_accuracy", "environment": env, "settings": settings, "rows": rows}, indent=2))
    lines = ["# fp8_attention_accuracy", "", f"CPU emulation, torch {env.get('torch')}, transformers "
             f"{env.get('transformers')}. Settings: {json.dumps(settings)}", "",
             "| variant | ppl | vs fp32 % | windows |", "|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['ppl']:.3f} | {r['vs fp32 %']:+.3f} | {r['windows']} |" for r in rows]
    (out / "fp8_attention_accuracy.md").write_text("\n".join(lines) + "\n")
    return out / "fp8_attention_accuracy.json"


def main() -> None:
    shared = Path(os.environ.get("FUSEINFER_SHARED", Path(__file__).resolve().parents[2] / "shared"))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for fp8_attention_accuracy.{json,md}")
    parser.add_argument("--model", default=str(shared / "models" / "opt-wt2-tiny"), help="an OPT model folder")
    parser.add_argument("--data-dir", default=str(shared / "data" / "wikitext-2-raw"),
                        help="the folder holding wiki.test.raw")
    parser.add_argument("--max-windows", type=int, default=None, help="the first N windows only (default all)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per window (default 2048)")
    args = parser.parse_args()
    if args.max_windows is not None and args.max_windows < 1 or args.seq_len < 2:
        parser.error("--max-windows takes a positive integer and --seq-len one of at least 2")
    for what, path in (("--model", args.model), ("--data-dir", args.data_dir)):
        if not Path(path).is_dir():
            parser.error(f"{what} {path} is not a folder (set FUSEINFER_SHARED or pass {what})")
    torch.manual_seed(0)
    rows = run(args.model, args.data_dir, args.max_windows, args.seq_len)
    settings = {"model": Path(args.model).name, "seq_len": args.seq_len, "max_windows": args.max_windows}
    print(f"wrote {write(args.out, rows, settings)}")


if __name__ == "__main__":
    main()
