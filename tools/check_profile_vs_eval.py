"""The profiler's targets, read back from a ``python -m fuseinfer.profile`` profile.json and an eval JSON of the same
settings; prints one line per figure, each marked OK or MISS:

* step time: the table's step (unprofiled, timed before any profiler session, no hooks) against the eval's figure
  for the same backend and phase (prefill_ms / decode_ms_per_token medians): target within ``--tolerance``; the
  device busy time of the un-hooked profiled pass likewise (a host-bound step is said so), and the profiler's
  wall-clock overhead on its own;
* compare (when the profile has one): the per-module-kind busy-time savings (attribution passes) over the device
  busy-time difference (un-hooked passes): target 90-110%; the host/idle part of the step difference is its own
  line;
* the verdict table by op class of each backend (printed for the closing note), and what is expected of it
  (prefill: GEMMs compute-bound; decode: GEMVs and attention memory-bound), marked OK / MISS.

Usage: check_profile_vs_eval.py PROFILE_JSON EVAL_JSON PHASE [--tolerance 0.10] [--strict]. Exit 0 unless the files
are missing or unreadable (a missed target is reported, not an error), or with --strict when a target is missed.
"""
from __future__ import annotations

import argparse
import json
import sys

EXPECTED = {"prefill": {"gemm": "compute-bound"}, "decode": {"gemv": "memory-bound", "attention": "memory-bound"}}


def _mark(ok: bool) -> str:
    return "OK" if ok else "MISS"


def step_times(prof: dict, ev: dict, phase: str, tolerance: float) -> bool:
    """The table's step (unprofiled, timed before any profiler ran) against the eval: the target. The device busy
    time of the un-hooked pass against the eval too (OK within the tolerance; below it the step is host-bound, which
    the busy share says), and the wall-clock overhead of profiling on its own."""
    key = "prefill_ms" if phase == "prefill" else "decode_ms_per_token"
    ok = True
    for p in prof["profiles"]:
        row = ev["backends"].get(p["name"]) or {}
        ref = (row.get(key) or {}).get("median")
        if ref is None:
            print(f"step {p['name']} {phase}: no eval figure ({row.get('error') or 'not run'}) MISS")
            ok = False
            continue
        step = p["unprofiled_ms"]["median"]
        busy = p.get("busy_ms", p["analysis"]["busy_ms"])
        off, off_busy = step / ref - 1, busy / ref - 1
        good = abs(off) <= tolerance
        ok &= good
        busy_mark = "OK" if abs(off_busy) <= tolerance else f"host-bound: busy {busy / step:.0%} of the step"
        print(f"step {p['name']} {phase}: the table's step (un-hooked, unprofiled) {step:.3f} ms vs eval {ref:.3f} ms: "
              f"{off:+.1%} {_mark(good)} (target within {tolerance:.0%}); device busy {busy:.3f} ms ({off_busy:+.1%} vs "
              f"eval, {busy_mark}); profiled wall {p['profiled_ms']:.3f} ms, profiler overhead (wall clock) "
              f"{p['overhead']:+.1%}")
    return ok


def compare(prof: dict) -> bool:
    c = prof.get("compare")
    if not c:
        return True
    if "busy_difference_ms" not in c:
        print("compare: profile.json predates the busy-time accounting (rerun python -m fuseinfer.profile) MISS")
        return False
    busy = c["busy_difference_ms"]
    kinds = c["saved_by_kind_ms"]
    share = kinds / busy if abs(busy) > 1e-9 else float("nan")
    good = 0.90 <= share <= 1.10  # (short of the difference, or overshooting it: the kinds do not explain it)
    print(f"compare {c['main']} vs {c['base']}: {c['step_ms']['base']:.3f} -> {c['step_ms']['main']:.3f} ms "
          f"({c['speedup']:.2f}x), step difference {c['measured_difference_ms']:.3f} ms = device busy {busy:.3f} ms "
          f"+ host/idle {c['host_idle_difference_ms']:.3f} ms")
    print(f"  saved by module kind (busy) {kinds:.3f} ms = {share:.0%} of the busy difference {_mark(good)} "
          f"(target 90-110%)")
    for who in ("main", "base"):
        print(f"  attribution of {c[who]}: {c['attribution'][who]}")
    for r in c["by_kind"]:
        print(f"  {r['kind']:<17} {r['base_ms']:9.3f} -> {r['main_ms']:9.3f} ms  saved {r['saved_ms']:+.3f}")
    print(f"  host/idle         {c['host_idle_difference_ms']:+.3f} ms (not a module kind)")
    print(f"  {len(c['disappeared'])} kernels / ops disappeared ({c['disappeared_ms']:.3f} ms), {len(c['new'])} new")
    return good


def verdicts(prof: dict, phase: str) -> bool:
    ok = True
    for p in prof["profiles"]:
        print(f"verdicts {p['name']} {phase} (op class, verdict, ms/step, share, % of roofline):")
        main = {}
        for v in p["verdicts"]:
            pct = v.get("pct_roofline")
            print(f"  {v['op_class']:<12} {v['verdict']:<21} {v['device_ms']:9.3f} {v['share']:6.1%} "
                  f"{'-' if pct is None else f'{pct:.0%}'}")
            if v["op_class"] not in main or v["device_ms"] > main[v["op_class"]][1]:
                main[v["op_class"]] = (v["verdict"], v["device_ms"])  # the class's dominant verdict
        for cls, want in EXPECTED[phase].items():
            if cls not in main:
                print(f"  expected {cls} {want}: no {cls} op here")
                continue
            good = main[cls][0] == want
            ok &= good
            print(f"  expected {cls} {want}: {main[cls][0]} {_mark(good)}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("profile_json")
    ap.add_argument("eval_json")
    ap.add_argument("phase", choices=["prefill", "decode"])
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = ap.parse_args()
    try:
        prof = json.load(open(args.profile_json))
        ev = json.load(open(args.eval_json))
    except (OSError, ValueError) as exc:
        print(f"cannot read the inputs: {exc}")
        return 1
    ok = step_times(prof, ev, args.phase, args.tolerance)
    ok &= compare(prof)
    ok &= verdicts(prof, args.phase)
    print(f"{args.phase}: {'all targets met' if ok else 'a target was missed (MISS above)'}")
    return 1 if args.strict and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
