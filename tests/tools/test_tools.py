"""Tools of tools/gpu_check.sh: the racecheck gate (tools/racecheck_tma.py) on synthetic racecheck logs, and the
GPU test shards (tools/gpu_shards.py) on a synthetic collection, and the failure log of a cut GPU test run
(tests/conftest.py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

GATE = Path(__file__).resolve().parents[2] / "tools" / "racecheck_tma.py"
TMA = """========= Error: Race reported between Write access at fuseinfer::bulk_copy(void *)+0x10 in decode_step.cu:142
=========     and Read access at void fuseinfer::consume<__half>(Ring &)+0x20 in decode_step.cu:348 [12 hazards]
=========     and Read access at void fuseinfer::attention_partial<__half, 64>()+0x30 in decode_step.cu:607 [4 hazards]
"""
OTHER = """========= Warning: Race reported between Write access at void fuseinfer::layer_norm_rows()+0x40 in ln.cu:450
=========     and Read access at void fuseinfer::consume<__half>(Ring &)+0x50 in decode_step.cu:352 [2 hazards]
"""


CAPPED = """========= Warning: Maximum number of hazards reached. Environment variable NV_COMPUTE_SANITIZER_MAX_RACECHECK_HAZARDS can be used to increase this count.
"""


def summary(n):
    return f"========= RACECHECK SUMMARY: {n} hazards displayed ({n} errors, 0 warnings)\n"


@pytest.mark.parametrize("log, passes", [
    (summary(0), True),
    (TMA + summary(1), True),
    (TMA + OTHER + summary(2), False),  # a hazard between two ordinary accesses
    (TMA, False),  # no summary: racecheck did not finish
    (CAPPED + TMA + summary(1), True),  # racecheck stopped recording at its cap: passes, with a note
], ids=["clean", "tma_only", "other_hazard", "no_summary", "capped"])
def test_racecheck_gate(tmp_path, log, passes):
    path = tmp_path / "racecheck.log"
    path.write_text(log)
    run = subprocess.run([sys.executable, str(GATE), str(path)], capture_output=True, text=True)
    assert (run.returncode == 0) == passes, run.stdout
    assert ("1 others" in run.stdout) == (OTHER in log)
    assert ("hazard cap" in run.stdout) == (CAPPED in log)


# ---- tools/gpu_shards.py: the GPU test files split over GPUs ----

SHARDS = Path(__file__).resolve().parents[2] / "tools" / "gpu_shards.py"
COLLECTED = """tests/ops/test_a.py::test_x[1]
tests/ops/test_a.py::test_x[2]
tests/ops/test_a.py::test_y
tests/ops/test_b.py::test_z
tests/quant/test_c.py::test_w[cuda-1]
tests/quant/test_c.py::test_w[cuda-2]
tests/d.py::test_v

1968/3372 tests collected (1404 deselected) in 8.52s
"""


def _shards(n, text=COLLECTED):
    run = subprocess.run([sys.executable, str(SHARDS), str(n)], input=text, capture_output=True, text=True)
    return run.returncode, [line.split() for line in run.stdout.splitlines()]


def test_gpu_shards_keep_files_whole_and_balance_counts():
    rc, groups = _shards(2)
    assert rc == 0 and len(groups) == 2
    # largest first, each to the smaller shard: a (3) -> 0, c (2) -> 1, d (1, before b by name) -> 1, b -> 0 (a tie)
    assert groups == [["tests/ops/test_a.py", "tests/ops/test_b.py"], ["tests/d.py", "tests/quant/test_c.py"]]
    assert sorted(f for g in groups for f in g) == sorted({line.split("::")[0] for line in COLLECTED.splitlines()
                                                           if "::" in line})


def test_gpu_shards_one_shard_and_more_shards_than_files():
    assert _shards(1)[1] == [["tests/d.py", "tests/ops/test_a.py", "tests/ops/test_b.py", "tests/quant/test_c.py"]]
    rc, groups = _shards(6)
    assert rc == 0 and len(groups) == 6 and sum(len(g) for g in groups) == 4 and groups[4:] == [[], []]


@pytest.mark.parametrize("arg", ["0", "x", ""])
def test_gpu_shards_bad_count_is_one_usage_line(arg):
    run = subprocess.run([sys.executable, str(SHARDS), *([arg] if arg else [])], input=COLLECTED,
                         capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.startswith("usage:") and not run.stdout


def test_failures_are_logged_as_they_happen(tmp_path):
    """FUSEINFER_TEST_FAILURES (tests/conftest.py's hook): a failing test's report lands in the file when it ends,
    a passing one writes nothing."""
    tests = Path(__file__).resolve().parents[1]
    (tmp_path / "test_planted.py").write_text("def test_fails():\n    assert 1 == 2, 'planted'\n\n"
                                              "def test_passes():\n    pass\n")
    log = tmp_path / "failures.log"
    env = {**os.environ, "FUSEINFER_TEST_FAILURES": str(log), "PYTHONPATH": str(tests)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                          str(tmp_path / "test_planted.py")], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 1, run.stdout + run.stderr
    text = log.read_text()
    assert "test_planted.py::test_fails (call)" in text and "planted" in text and "test_passes" not in text
