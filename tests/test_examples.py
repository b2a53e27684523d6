"""The examples run and check what they claim (on the CPU here, on the shared tiny OPT)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_quickstart_checks_and_passes(tiny_model_path):
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "quickstart.py"), str(tiny_model_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "quickstart: OK" in proc.stdout
