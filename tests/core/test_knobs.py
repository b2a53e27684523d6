"""fuseinfer.core.knobs: a flag and the variable it stands for never disagree silently; a path knob naming nothing is an
error naming the knob; misspelt FUSEINFER_* names are reported once, with the closest known name."""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuseinfer import FuseInferError
from fuseinfer.core import knobs

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("FUSEINFER_SHARED", REPO.parent / "shared"))
TINY = SHARED / "models" / "opt-wt2-tiny"
needs_tiny = pytest.mark.skipif(not (TINY / "config.json").is_file(), reason="shared tiny model not found")


def _unknown_warnings(monkeypatch) -> list[str]:
    monkeypatch.setattr(knobs, "_unknown_checked", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        knobs.get("FUSEINFER_PREFILL")
        knobs.get("FUSEINFER_PREFILL")  # (once per process, not once per read)
    return [str(w.message) for w in caught if "unknown fuseinfer environment" in str(w.message)]


def test_misspelt_names_are_reported_once_with_the_closest(monkeypatch):
    for name in [n for n in os.environ if n.startswith("FUSEINFER_") and n not in knobs.KNOBS]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("FUSEINFER_DATA_DRI", "x")
    monkeypatch.setenv("FUSEINFER_CUDA_GRAPH", "0")
    monkeypatch.setenv("FUSEINFER_ZZZZZZ", "1")
    caught = _unknown_warnings(monkeypatch)
    assert len(caught) == 1
    assert "FUSEINFER_DATA_DRI (did you mean FUSEINFER_DATA_DIR?)" in caught[0]
    assert "FUSEINFER_CUDA_GRAPH (did you mean FUSEINFER_CUDA_GRAPHS?)" in caught[0]
    assert "FUSEINFER_ZZZZZZ" in caught[0]


def test_build_and_tool_knobs_are_known(monkeypatch):
    for name in [n for n in os.environ if n.startswith("FUSEINFER_") and n not in knobs.KNOBS]:
        monkeypatch.delenv(name)
    for name in ("FUSEINFER_BUILD_CUDA", "FUSEINFER_CUDA_ARCH", "FUSEINFER_CUTLASS_DIR", "FUSEINFER_SHARED",
                 "FUSEINFER_BENCH_DIR", "FUSEINFER_NVCC", "FUSEINFER_GPU_TRANSFORMERS"):
        monkeypatch.setenv(name, "1")
    assert _unknown_warnings(monkeypatch) == []


def test_a_path_knob_naming_nothing_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv("FUSEINFER_CALIBRATION_DATA", str(tmp_path / "nonexistent"))
    with pytest.raises(FuseInferError, match="FUSEINFER_CALIBRATION_DATA .*nonexistent does not exist"):
        knobs.get("FUSEINFER_CALIBRATION_DATA")
    with pytest.raises(FuseInferError, match="--calibration-data .*does not exist"):
        knobs.from_flag("FUSEINFER_CALIBRATION_DATA", "--calibration-data", str(tmp_path / "nope"))
    monkeypatch.setenv("FUSEINFER_CALIBRATION_DATA", str(tmp_path))
    assert knobs.get("FUSEINFER_CALIBRATION_DATA") == str(tmp_path)


@settings(max_examples=60, deadline=None)
@given(env=st.one_of(st.none(), st.sampled_from(["a", "b", "results/x"])),
       flag=st.one_of(st.none(), st.sampled_from(["a", "b", "results/x"])))
def test_flag_wins_and_says_so(env, flag):
    """The flag's value when given (set as the knob), else the environment's, else the default; a note exactly
    when both are given and differ."""
    name = "FUSEINFER_ONNX_DIR"
    saved = os.environ.get(name)
    notes = []
    try:
        os.environ.pop(name, None)
        if env is not None:
            os.environ[name] = env
        got = knobs.from_flag(name, "--onnx-dir", flag, note=notes.append)
        assert got == (flag if flag is not None else env if env is not None else knobs.KNOBS[name].default)
        if flag is not None:
            assert os.environ[name] == flag
        assert len(notes) == (flag is not None and env is not None and flag != env)
        if notes:
            assert notes[0] == f"--onnx-dir {flag} overrides {name}={env}"
    finally:
        os.environ.pop(name, None)
        if saved is not None:
            os.environ[name] = saved


def _one_line_error(capsys, rc: int, *words: str) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), err
    for word in words:
        assert word in err[0]


QUICK = ["--device", "cpu", "--backends", "eager", "--skip-ppl", "--repeats", "1", "--warmup", "0", "--gen-len", "1",
         "--prompt-len", "4"]


@needs_tiny
def test_eval_data_dir_does_not_replace_the_calibration_variable(monkeypatch, tmp_path, capsys):
    """--data-dir is the data folder; FUSEINFER_CALIBRATION_DATA (the user's calibration text) stays as it was, and
    the flag travels in the settings: the environment is left as it was."""
    from fuseinfer.eval.cli import main

    text, folder = tmp_path / "cal.txt", tmp_path / "wiki"
    text.write_text("calibration text\n")
    folder.mkdir()
    monkeypatch.setenv("FUSEINFER_CALIBRATION_DATA", str(text))
    monkeypatch.delenv("FUSEINFER_DATA_DIR", raising=False)
    assert main(["--model", str(TINY), *QUICK, "--data-dir", str(folder)]) == 0
    assert os.environ["FUSEINFER_CALIBRATION_DATA"] == str(text)
    assert "FUSEINFER_DATA_DIR" not in os.environ
    assert "overrides" not in capsys.readouterr().err


@needs_tiny
def test_eval_calibration_flag_beside_the_variable_says_so(monkeypatch, tmp_path, capsys):
    from fuseinfer.eval.cli import main

    env, flag = tmp_path / "env.txt", tmp_path / "flag.txt"
    env.write_text("x\n")
    flag.write_text("y\n")
    monkeypatch.setenv("FUSEINFER_CALIBRATION_DATA", str(env))
    assert main(["--model", str(TINY), *QUICK, "--calibration-data", str(flag)]) == 0
    assert os.environ["FUSEINFER_CALIBRATION_DATA"] == str(env)  # (the flag travels in the settings)
    assert f"--calibration-data {flag} overrides FUSEINFER_CALIBRATION_DATA={env}" in capsys.readouterr().err


@pytest.mark.parametrize("how", ["env", "flag"])
def test_eval_calibration_path_to_nothing_is_an_error(monkeypatch, tmp_path, capsys, how):
    from fuseinfer.eval.cli import main

    missing = str(tmp_path / "nonexistent")
    if how == "env":
        monkeypatch.setenv("FUSEINFER_CALIBRATION_DATA", missing)
        rc = main(["--model", "random:opt-125m", *QUICK])
        _one_line_error(capsys, rc, "FUSEINFER_CALIBRATION_DATA", "does not exist")
    else:
        rc = main(["--model", "random:opt-125m", *QUICK, "--calibration-data", missing])
        _one_line_error(capsys, rc, "--calibration-data", "does not exist")


def test_eval_data_dir_to_nothing_is_an_error(tmp_path, capsys):
    from fuseinfer.eval.cli import main

    rc = main(["--model", "random:opt-125m", *QUICK, "--data-dir", str(tmp_path / "nonexistent")])
    _one_line_error(capsys, rc, "--data-dir", "does not exist")


def test_profile_takes_data_dir(tmp_path, capsys):
    from fuseinfer.profile.cli import build_parser, main

    assert build_parser().parse_args(["--model", "m", "--out", "o", "--data-dir", str(tmp_path)]).data_dir == \
        str(tmp_path)
    rc = main(["--model", "random:opt-125m", "--device", "cpu", "--out", str(tmp_path / "out"), "--data-dir",
               str(tmp_path / "nonexistent")])
    _one_line_error(capsys, rc, "--data-dir", "does not exist")
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_a_number_knob_for_the_extension_is_checked(monkeypatch):
    """FUSEINFER_SPLITKV_SPLITS (a number, no choices) reaches the extension as that integer; anything else is one
    error naming the knob."""
    monkeypatch.setenv("FUSEINFER_SPLITKV_SPLITS", "5")
    assert knobs.extension_values()["FUSEINFER_SPLITKV_SPLITS"] == 5
    monkeypatch.delenv("FUSEINFER_SPLITKV_SPLITS")
    assert knobs.extension_values()["FUSEINFER_SPLITKV_SPLITS"] == 0
    for bad in ("auto", "-1", "2.5"):
        monkeypatch.setenv("FUSEINFER_SPLITKV_SPLITS", bad)
        with pytest.raises(FuseInferError, match="FUSEINFER_SPLITKV_SPLITS"):
            knobs.extension_values()


def test_switches_off_their_defaults_are_named_in_the_eval_record(monkeypatch):
    """A switch that changes which kernels run (FUSEINFER_ATTN_FP8=1) is listed by changed_switches, the eval's
    environment record and its report line; one at its default (set or not) is not."""
    import torch

    from fuseinfer.eval.report import settings_lines
    from fuseinfer.harness.environment import environment

    monkeypatch.setenv("FUSEINFER_ATTN_SM90", "1")  # the default, set explicitly
    monkeypatch.delenv("FUSEINFER_ATTN_FP8", raising=False)
    assert "FUSEINFER_ATTN_SM90" not in knobs.changed_switches()
    assert "FUSEINFER_ATTN_FP8" not in knobs.changed_switches()
    monkeypatch.setenv("FUSEINFER_ATTN_FP8", "1")
    assert knobs.changed_switches()["FUSEINFER_ATTN_FP8"] == "1"
    env = environment(torch.device("cpu"))
    assert env["switches"]["FUSEINFER_ATTN_FP8"] == "1"
    lines = settings_lines({"environment": env, "settings": {}, "data": None, "ppl_note": "skipped", "copy_gbps": None})
    assert any(line.startswith("environment:") and line.endswith("FUSEINFER_ATTN_FP8=1") for line in lines)
