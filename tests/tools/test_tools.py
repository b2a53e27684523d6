"""The racecheck gate of tools/gpu_check.sh (tools/racecheck_tma.py) on synthetic racecheck logs."""
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
