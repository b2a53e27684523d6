"""Split the GPU test files into N shards of about equal test counts, one per GPU (tools/gpu_check.sh gputest on a
machine with several GPUs runs one pytest per shard, each on its own GPU, side by side).

    python -m pytest --collect-only -q -m gpu tests | python tools/gpu_shards.py N

reads pytest's collection (lines ``path::test[params]``) and prints N lines, each the space-separated files of one
shard (an empty line for a shard with nothing). Files stay whole (module fixtures run once); the largest files go
first, each to the shard with the fewest tests so far (greedy), ties to the lower shard, so the split is
deterministic.
"""
from __future__ import annotations

import sys
from collections import Counter


def counts(lines) -> Counter:
    """{test file: number of collected tests} from ``pytest --collect-only -q`` output lines."""
    found = Counter()
    for line in lines:
        line = line.strip()
        if "::" in line and not line.startswith(("=", "-")):
            found[line.split("::", 1)[0]] += 1
    return found


def shards(per_file: Counter, n: int) -> list[list[str]]:
    """The files in n shards: largest first, each to the currently smallest shard (lowest index on ties); every
    shard's files sorted, so each pytest collects them in its usual order."""
    if n < 1:
        raise ValueError(f"need at least one shard, got {n}")
    groups: list[list[str]] = [[] for _ in range(n)]
    sizes = [0] * n
    for path, count in sorted(per_file.items(), key=lambda item: (-item[1], item[0])):
        i = min(range(n), key=lambda j: (sizes[j], j))
        groups[i].append(path)
        sizes[i] += count
    return [sorted(g) for g in groups]


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit() or int(argv[0]) < 1:
        print("usage: python -m pytest --collect-only -q -m gpu tests | python tools/gpu_shards.py N (N >= 1)",
              file=sys.stderr)
        return 2
    for group in shards(counts(sys.stdin), int(argv[0])):
        print(" ".join(group))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
