"""Compare eval JSONs pairwise (base, new, base, new, ...): a Markdown table of every fuseinfer backend's prefill and
decode medians, the new/base ratio, and a flag where new is more than --tolerance slower. Exit 1 if any is."""
import argparse
import json
import sys


def rows(base: dict, new: dict, tol: float):
    s = new["settings"]
    for name, b in base["backends"].items():
        n = new["backends"].get(name)
        if n is None or b.get("status") != "ok" or n.get("status") != "ok":
            yield name, s, "-", None, None, None, "not run in both"
            continue
        for metric in ("prefill_ms", "decode_ms_per_token"):
            bm, nm = b[metric]["median"], n[metric]["median"]
            ratio = nm / bm
            yield name, s, metric, bm, nm, ratio, ("SLOWER" if ratio > 1 + tol else "ok")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("files", nargs="+")
    p.add_argument("--tolerance", type=float, default=0.02)
    a = p.parse_args(argv)
    if len(a.files) % 2:
        p.error("give the files in base/new pairs")
    bad = 0
    print("| backend | batch x prompt | metric | base | new | new/base | verdict |")
    print("|---|---|---|---|---|---|---|")
    for i in range(0, len(a.files), 2):
        base, new = (json.load(open(f)) for f in a.files[i:i + 2])
        for name, s, metric, bm, nm, ratio, verdict in rows(base, new, a.tolerance):
            shape = f"{s['batch_size']}x{s['prompt_len']}"
            if ratio is None:
                print(f"| {name} | {shape} | - | - | - | - | {verdict} |")
                continue
            bad += verdict != "ok"
            print(f"| {name} | {shape} | {metric} | {bm:.3f} | {nm:.3f} | {ratio:.3f} | {verdict} |")
    env = json.load(open(a.files[1])).get("environment", {})
    print(f"\nGPU: {env.get('gpu', env.get('device_name', '?'))}; torch {env.get('torch', '?')}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
