"""fuseinfer.core.data, the one WikiText-2 resolver: --data-dir, $FUSEINFER_DATA_DIR, the shared folder, then datasets;
used by the eval with any model, SmoothQuant's default calibration (the validation split) and the profiler."""
from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuseinfer import FuseInferError
from fuseinfer.core import data

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("FUSEINFER_SHARED", REPO.parent / "shared"))
WIKI = SHARED / "data" / "wikitext-2-raw"
needs_data = pytest.mark.skipif(not (WIKI / "wiki.valid.raw").is_file(), reason="shared WikiText-2 not found")


def _folder(root: Path, name: str, text: str) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    for split in data.SPLITS:
        (folder / data.split_file(split)).write_text(f"{text} {split}\n", encoding="utf-8")
    return folder


def test_order_flag_then_env_then_shared_then_datasets(tmp_path, monkeypatch):
    flag, env = _folder(tmp_path, "flag", "from the flag"), _folder(tmp_path, "env", "from the env")
    shared = tmp_path / "shared"
    _folder(shared / "data", "wikitext-2-raw", "from shared")
    monkeypatch.setenv("FUSEINFER_SHARED", str(shared))
    monkeypatch.setenv("FUSEINFER_DATA_DIR", str(env))
    asked = []
    monkeypatch.setattr(data, "_rows_from_datasets", lambda split: asked.append(split) or [" from datasets \n"])
    assert data.load_text("test", str(flag)).text == "from the flag test\n"
    assert data.load_text("valid").text == "from the env valid\n"
    monkeypatch.delenv("FUSEINFER_DATA_DIR")
    found = data.load_text("valid")
    assert found.text == "from shared valid\n" and found.source.endswith("wiki.valid.raw")
    monkeypatch.setenv("FUSEINFER_SHARED", str(tmp_path / "elsewhere"))
    assert data.load_text("valid").source == "datasets: wikitext/wikitext-2-raw-v1 validation"
    assert asked == ["valid"]  # the validation split, never the test one, for calibration


def test_a_named_folder_without_the_file_does_not_fall_back(tmp_path, monkeypatch):
    """An explicit --data-dir / $FUSEINFER_DATA_DIR without the file is an error, not a silent switch to shared."""
    monkeypatch.delenv("FUSEINFER_DATA_DIR", raising=False)
    with pytest.raises(FuseInferError, match="wiki.test.raw not found.*--data-dir or FUSEINFER_DATA_DIR"):
        data.load_text("test", str(tmp_path))
    (tmp_path / "f").write_text("x")
    with pytest.raises(FuseInferError, match="not a folder"):
        data.load_text("test", str(tmp_path / "f"))


def test_nothing_found_is_one_line_naming_the_flag_and_variable(no_wikitext):
    with pytest.raises(FuseInferError) as exc:
        data.load_text("test")
    message = str(exc.value)
    assert "\n" not in message and "--data-dir" in message and "FUSEINFER_DATA_DIR" in message


def test_relative_shared_is_taken_from_the_repository_root(monkeypatch):
    monkeypatch.setenv("FUSEINFER_SHARED", "../shared")
    assert data.shared_dir().resolve() == (REPO.parent / "shared").resolve()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(["", " ", " = Title = ", " some text , with @-@ marks", "\t"]), max_size=12))
def test_rows_rebuild_the_dataset_rows(tmp_path_factory, lines):
    """Each line is a row keeping its newline; blank lines are empty rows; the text is the rows joined by \\n\\n."""
    folder = tmp_path_factory.mktemp("wiki")
    (folder / "wiki.test.raw").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    got = data.load_text("test", str(folder))
    rows = [line + "\n" if line.strip() else "" for line in lines]
    assert got.rows == len(rows) and got.text == "\n\n".join(rows)


def test_the_resolver_is_a_low_layer():
    """fuseinfer/core/data.py imports only fuseinfer's errors and knobs; quant/ and profile/ reach the data without
    importing fuseinfer.eval for it."""
    tree = ast.parse((REPO / "fuseinfer" / "core" / "data.py").read_text())
    local = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level}
    assert local <= {None, "errors", "knobs"}, local
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level for a in n.names}
    assert names <= {"errors", "knobs", "FuseInferError"}
    sq = (REPO / "fuseinfer" / "quant" / "smoothquant.py").read_text()
    assert "..eval" not in sq and "fuseinfer.eval" not in sq


@needs_data
def test_calibration_finds_the_shared_validation_split(monkeypatch):
    """SmoothQuantW8A8's default calibration (no calibration=, no data dir) reads the shared wiki.valid.raw."""
    from fuseinfer.quant import smoothquant as sq

    monkeypatch.delenv("FUSEINFER_DATA_DIR", raising=False)
    monkeypatch.setenv("FUSEINFER_SHARED", str(SHARED))
    text, source = sq.calibration_text()
    assert source == str((WIKI / "wiki.valid.raw").resolve()) and text.startswith("\n\n = Homarus gammarus")


@needs_data
def test_eval_with_a_model_folder_finds_the_shared_data(tiny_model_path, tmp_path, monkeypatch):
    """`eval --model <dir>` (no --data-dir, no FUSEINFER_DATA_DIR) scores the shared wiki.test.raw."""
    from fuseinfer.eval.cli import main

    monkeypatch.delenv("FUSEINFER_DATA_DIR", raising=False)
    monkeypatch.setenv("FUSEINFER_SHARED", str(SHARED))
    out = tmp_path / "r.json"
    assert main(["--model", str(tiny_model_path), "--device", "cpu", "--backends", "eager", "--skip-latency",
                 "--max-windows", "1", "--output", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["data"]["source"] == str((WIKI / "wiki.test.raw").resolve())
    assert results["backends"]["eager"]["ppl"] > 1


@needs_data
def test_profile_w8a8_calibrates_on_the_shared_validation_split(tiny_model_path, monkeypatch, set_knob):
    """The profiler's `fuseinfer-w8a8` backend, loaded with no data flag, finds wiki.valid.raw as the eval does."""
    import torch

    from fuseinfer.harness.models import load_config, resolve_model
    from fuseinfer.profile.backends import resolve_backend

    monkeypatch.delenv("FUSEINFER_DATA_DIR", raising=False)
    monkeypatch.delenv("FUSEINFER_CALIBRATION_DATA", raising=False)
    set_knob("FUSEINFER_SHARED", str(SHARED))
    set_knob("FUSEINFER_CALIBRATION_SAMPLES", "1")
    source = resolve_model(str(tiny_model_path))
    backend = resolve_backend("fuseinfer-w8a8")(source, load_config(source), torch.float32, torch.device("cpu"), 0)
    try:
        backend.load()
        assert backend.details()["calibration_source"] == str((WIKI / "wiki.valid.raw").resolve())
    finally:
        backend.close()
