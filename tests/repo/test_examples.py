"""The examples run and check what they claim (on the CPU here, on the shared tiny OPT)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quickstart_checks_and_passes(tiny_model_path):
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "quickstart.py"), str(tiny_model_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "quickstart: OK" in proc.stdout


def _one_error_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    return lines[0]


def test_quickstart_without_the_shared_folder_fails_in_one_line(tmp_path):
    env = {**os.environ, "FUSEINFER_SHARED": str(tmp_path / "missing")}
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "quickstart.py")], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert "FUSEINFER_SHARED" in _one_error_line(proc)


def test_quickstart_with_a_model_that_does_not_load_fails_in_one_line(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "quickstart.py"), str(tmp_path / "no-model")],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert "cannot load" in _one_error_line(proc)


def test_eval_tiny_without_the_shared_folder_fails_in_one_line(tmp_path):
    env = {**os.environ, "FUSEINFER_SHARED": str(tmp_path / "missing")}
    proc = subprocess.run(["bash", str(REPO / "examples" / "eval_tiny.sh")], capture_output=True, text=True,
                          timeout=60, env=env, cwd=tmp_path)
    assert "FUSEINFER_SHARED" in _one_error_line(proc)
