"""Issue 38's target: the profiler's step time (unprofiled, and the profiled table's) against the eval's figure for
the same settings. Usage: check_profile_vs_eval.py PROFILE_JSON EVAL_JSON PHASE [--tolerance 0.10]; prints one line
per backend and exits 1 when an unprofiled step is off by more than the tolerance."""
from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("profile_json")
    ap.add_argument("eval_json")
    ap.add_argument("phase", choices=["prefill", "decode"])
    ap.add_argument("--tolerance", type=float, default=0.10)
    args = ap.parse_args()
    prof = json.load(open(args.profile_json))
    ev = json.load(open(args.eval_json))
    key = "prefill_ms" if args.phase == "prefill" else "decode_ms_per_token"
    ok = True
    for p in prof["profiles"]:
        row = ev["backends"].get(p["name"]) or {}
        ref = (row.get(key) or {}).get("median")
        if ref is None:
            print(f"{p['name']}: no eval figure ({row.get('error') or 'not run'})")
            ok = False
            continue
        mine, profiled = p["unprofiled_ms"]["median"], p["profiled_ms"]
        off = mine / ref - 1
        good = abs(off) <= args.tolerance
        ok &= good
        print(f"{p['name']} {args.phase}: profile step {mine:.3f} ms (profiled {profiled:.3f} ms, overhead "
              f"{p['overhead']:+.1%}) vs eval {ref:.3f} ms: {off:+.1%} {'OK' if good else 'OFF'} "
              f"(target within {args.tolerance:.0%})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
