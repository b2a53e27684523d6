"""CPU tests of ``fuseinfer.profile`` on the shared tiny OPT and on random OPTs: files produced and parsed back,
the tables add up to the step, verdicts, hints, compare, and the CLI's bad-input messages."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fuseinfer.profile import ProfileError, profile
from fuseinfer.profile.trace import analyze, load_events

from conftest import random_opt

REPO = Path(__file__).resolve().parents[2]
FAST = dict(device="cpu", prompt_len=16, repeats=2, active=2)
KIND_SUM_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def tiny_run(tiny_model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    result = profile(str(tiny_model_path), "fuseinfer", "prefill", compare="eager", out=out, **FAST)
    return result, out


def test_files_are_written_and_parse_back(tiny_run):
    result, out = tiny_run
    for name in ("summary.md", "profile.json", "compare.csv", "time_by_kind.png", "roofline.png"):
        assert (out / name).is_file(), name
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for backend in ("fuseinfer", "eager"):
        folder = out / backend
        events = load_events(folder / "trace.json")
        steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
        assert len(steps) == FAST["active"]
        assert sum(e.get("cat") == "cpu_op" for e in events) > 50
        assert list((folder / "tensorboard").glob("*.pt.trace.json.gz"))
        with open(folder / "ops.csv") as f:
            rows = list(csv.DictReader(f))
        assert rows and {"op", "device_ms", "verdict", "pct_roofline"} <= set(rows[0])
        assert json.loads((folder / "memory.json").read_text())["cpu"]["peak_mib"] > 0
        # the analysis read back from the file equals the one in the result
        again = analyze(events, 256, 1024)
        prof = next(p for p in result.profiles if p.name == backend)
        assert again["step_ms"] == pytest.approx(prof.analysis["step_ms"])
    data = json.loads((out / "profile.json").read_text())
    assert data["schema"] == "fuseinfer.profile/1" and len(data["profiles"]) == 2
    summary = (out / "summary.md").read_text()
    for heading in ("## Ceilings", "## Step time", "### Time by module kind", "### Verdicts by op class",
                    "## Compare: fuseinfer vs eager", "## Hints", "![roofline]"):
        assert heading in summary


@pytest.mark.parametrize("backend", ["fuseinfer", "eager"])
def test_tables_sum_to_the_step(tiny_run, backend):
    result, _ = tiny_run
    prof = next(p for p in result.profiles if p.name == backend)
    a = prof.analysis  # the un-hooked pass: ops, kernels, busy time, the step
    step = a["step_ms"]
    ops = sum(r["device_ms"] for r in a["ops"]) + a["idle_ms"]
    assert ops == pytest.approx(step, rel=KIND_SUM_TOLERANCE)
    assert a["busy_ms"] > 0.5 * step  # most of a CPU step is inside ops
    assert prof.busy_ms == a["busy_ms"] and prof.step_ms == prof.unprofiled_ms["median"]
    assert a["layers"] == []  # no module ranges in the un-hooked pass
    k = prof.attribution  # the second pass, with module ranges
    assert k is not None and "module ranges" in k["label"] and k is prof.kinds
    kinds = sum(r["device_ms"] for r in k["kinds"]) + k["idle_ms"]
    assert kinds == pytest.approx(k["step_ms"], rel=KIND_SUM_TOLERANCE)
    assert sum(r["device_ms"] for r in k["layers"]) < k["step_ms"]
    assert [r["layer"] for r in k["layers"]] == [0, 1, 2, 3]
    files = prof.files
    assert Path(files["trace"]).name == "trace.json" and Path(files["trace_modules"]).name == "trace_modules.json"


def test_module_kinds_eager_and_fused(tiny_run):
    result, _ = tiny_run
    kinds = {p.name: {r["kind"] for r in p.kinds["kinds"] if r["device_ms"] > 0} for p in result.profiles}
    # eager: modules are called, so their ranges name them; fused: the ops are sorted by shape inside the ranges
    assert {"qkv", "attn_out", "attn_core", "mlp_in", "mlp_out", "activation", "layernorm", "lm_head", "residual"} \
        <= kinds["eager"]
    assert {"qkv", "attn_out", "attn_core", "mlp_in", "mlp_out", "layernorm", "lm_head"} <= kinds["fuseinfer"]
    assert "residual" not in kinds["fuseinfer"]  # the residual adds ride in the fused ops
    fused = {(r["op"], r["kind"]) for r in result.profiles[0].kinds["ops"]}  # (the hooked pass: the module path)
    assert ("fuseinfer::linear_epilogue", "mlp_in") in fused and ("fuseinfer::attention", "attn_core") in fused


def test_verdicts_computed(tiny_run):
    result, _ = tiny_run
    allowed = {"compute-bound", "memory-bound", "launch/latency-bound", "no cost model"}
    for p in result.profiles:
        rows = p.analysis["ops"]
        assert {r["verdict"] for r in rows} <= allowed
        costed = [r for r in rows if r["flops_per_call"] is not None and r["device_ms"] > 0]
        assert costed and all(r["ai"] is not None and r["pct_roofline"] > 0 for r in costed
                              if r["verdict"] != "launch/latency-bound")
        assert p.verdicts and abs(sum(v["share"] for v in p.verdicts) - sum(r["share"] for r in rows
                                                                              if r["device_ms"] > 0)) < 1e-6
    ln = [r for r in result.profiles[1].analysis["ops"] if r["op"] == "aten::layer_norm"]
    assert ln and all(r["op_class"] == "norm" and r["ai"] < 2 for r in ln)


def test_hints_present_with_figures(tiny_run):
    result, _ = tiny_run
    assert result.hints
    rules = {h["rule"] for h in result.hints}
    assert {"cpu", "top", "compare"} <= rules
    assert all(any(ch.isdigit() for ch in h["figure"]) for h in result.hints)


def test_compare(tiny_run):
    result, _ = tiny_run
    c = result.compare
    assert c["main"] == "fuseinfer" and c["base"] == "eager"
    assert c["speedup"] == pytest.approx(c["step_ms"]["base"] / c["step_ms"]["main"])
    gone = {d["name"] for d in c["disappeared"]}
    new = {d["name"] for d in c["new"]}
    assert "aten::layer_norm" in gone and "fuseinfer::add_layer_norm" in new
    by_kind = {r["kind"]: r for r in c["by_kind"]}
    assert {"attention", "mlp", "layernorm"} <= set(by_kind) and "idle" not in by_kind  # idle: its own line
    assert by_kind["residual"]["main_ms"] == 0 and by_kind["residual"]["base_ms"] > 0
    total = sum(r["saved_ms"] for r in c["by_kind"])
    main, base = result.profiles
    # the per-kind savings are busy time of the attribution passes; the check is against the un-hooked passes'
    # (the kinds' times and the busy total are summed separately from the trace's events: equal up to rounding)
    assert total == pytest.approx(base.kinds["busy_ms"] - main.kinds["busy_ms"], rel=1e-6, abs=1e-5)
    assert c["busy_difference_ms"] == pytest.approx(base.busy_ms - main.busy_ms)
    assert c["host_idle_difference_ms"] == pytest.approx(c["measured_difference_ms"] - c["busy_difference_ms"])
    assert c["accounted"] == pytest.approx(total / c["busy_difference_ms"])
    assert "module ranges" in c["attribution"]["main"] and "module ranges" in c["attribution"]["base"]


@pytest.mark.parametrize("phase", ["decode", "generate"])
def test_api_with_a_module_decode_and_generate(phase):
    model = random_opt()
    result = profile(model, phase=phase, device="cpu", prompt_len=8, gen_len=2, repeats=2, active=1)
    a = result.main.analysis
    assert a["unit"] == "op" and a["steps"] == 1 and result.main.unprofiled_ms["n"] == 2
    assert {"qkv", "mlp_in", "lm_head"} <= {r["kind"] for r in result.main.kinds["kinds"]}
    lm = [r for r in a["ops"] if r["kind"] == "lm_head"]
    assert lm and lm[0]["op_class"] == "gemv"
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())  # hooks removed
    assert result.out_dir is None and result.main.files == {}


def test_api_with_a_patched_module_and_compare_module():
    import fuseinfer

    fused, plain = random_opt(), random_opt()
    fuseinfer.patch(fused)
    result = profile(fused, phase="decode", compare=plain, device="cpu", prompt_len=8, repeats=2, active=1)
    assert [p.name for p in result.profiles] == ["fuseinfer", "compare"]
    assert fuseinfer.patch_state(fused) is not None  # a given model is left as it was
    assert any(r["op"] == "fuseinfer::linear_epilogue" for r in result.main.analysis["ops"])
    with pytest.raises(ProfileError, match="another nn.Module"):
        profile(fused, compare="eager", device="cpu")


# ---- CLI ----

def run_cli(*args, timeout=120):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "fuseinfer.profile", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


def test_cli_tiny_model_under_a_minute(tiny_model_path, tmp_path):
    start = time.perf_counter()
    done = run_cli("--model", str(tiny_model_path), "--device", "cpu", "--backend", "fuseinfer", "--out",
                   str(tmp_path / "p"))
    elapsed = time.perf_counter() - start
    assert done.returncode == 0, done.stderr[-2000:]
    assert elapsed < 60, f"the CPU CLI run took {elapsed:.1f} s"
    assert (tmp_path / "p" / "summary.md").is_file() and "hints" in done.stdout


def _cli_error(capsys, *args) -> str:
    from fuseinfer.profile.cli import main

    assert main(list(args)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_cli_unknown_backend(capsys, tmp_path):
    err = _cli_error(capsys, "--model", "random:opt-125m", "--device", "cpu", "--backend", "vllm", "--out",
                     str(tmp_path))
    assert "unknown backend 'vllm'" in err and "eager" in err


def test_cli_backend_not_installed(capsys, tmp_path):
    import fuseinfer

    if hasattr(fuseinfer, "Int8WeightOnly"):
        pytest.skip("fuseinfer has the int8 config here")
    err = _cli_error(capsys, "--model", "random:opt-125m", "--device", "cpu", "--backend", "fuseinfer-w8a16",
                     "--out", str(tmp_path))
    assert "not installed" in err and "Int8WeightOnly" in err


def test_cli_phase_the_backend_lacks(capsys, tmp_path, monkeypatch):
    from fuseinfer.harness.backends import Backend
    from fuseinfer.profile import backends

    class PerplexityOnly(Backend):
        name = "ppl-only"

    monkeypatch.setitem(backends.BACKENDS, "ppl-only", PerplexityOnly)
    err = _cli_error(capsys, "--model", "random:opt-125m", "--device", "cpu", "--backend", "ppl-only", "--phase",
                     "decode", "--out", str(tmp_path))
    assert "has no decode step" in err


def test_cli_unknown_phase(capsys, tmp_path):
    err = _cli_error(capsys, "--model", "random:opt-125m", "--device", "cpu", "--phase", "train", "--out",
                     str(tmp_path))
    assert "unknown phase 'train'" in err


def test_cli_unwritable_out_dir(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    err = _cli_error(capsys, "--model", "random:opt-125m", "--device", "cpu", "--out", str(blocker / "sub"))
    assert "cannot write --out" in err
    err = _cli_error(capsys, "--model", "random:opt-125m", "--device", "cpu", "--out", str(blocker))
    assert "is a file" in err


def test_cli_ncu_without_ncu(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    err = _cli_error(capsys, "--model", "random:opt-125m", "--device", "cpu", "--ncu", "--out", str(tmp_path))
    assert "--ncu needs Nsight Compute's `ncu` on PATH" in err


def test_cli_error_subprocess_has_no_traceback(tmp_path):
    done = run_cli("--model", "random:opt-125m", "--device", "cpu", "--backend", "nope", "--out", str(tmp_path))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: unknown backend")


def test_prompt_beyond_the_positions_is_refused(capsys, tmp_path):
    err = _cli_error(capsys, "--model", "random:opt-125m", "--device", "cpu", "--phase", "decode", "--prompt-len",
                     "2048", "--out", str(tmp_path))
    assert "exceed the model's 2048 positions" in err


# --- the output folder: written whole at the end, never over what fuseinfer did not write

def test_recorded_paths_name_the_final_folder(tiny_run):
    result, out = tiny_run
    assert [n for n in os.listdir(out.parent) if n.startswith(".fuseinfer-")] == []  # no temporary left
    recorded = json.loads((out / "profile.json").read_text())
    paths = [v for v in recorded["files"].values()] + [v for p in result.profiles for v in p.files.values()]
    assert paths and all(Path(p).parent in (out, out / "fuseinfer", out / "eager") or Path(p).parent.parent == out
                         for p in paths)
    assert all(Path(p).exists() for p in paths)


def test_cli_earlier_profile_needs_overwrite(capsys, tmp_path):
    out = tmp_path / "prof"
    out.mkdir()
    (out / "profile.json").write_text('{"schema": "fuseinfer.profile/1"}')
    err = _cli_error(capsys, "--model", "opt-7b", "--device", "cpu", "--out", str(out))
    assert "earlier results; pass --overwrite" in err
    assert os.listdir(out) == ["profile.json"]


def test_cli_foreign_folder_is_never_replaced(capsys, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    err = _cli_error(capsys, "--model", "opt-7b", "--device", "cpu", "--out", str(tmp_path), "--overwrite")
    assert "did not write" in err and "choose another --out" in err
    assert os.listdir(tmp_path) == ["notes.txt"]


def test_cli_bad_model_creates_no_folder(capsys, tmp_path):
    err = _cli_error(capsys, "--model", "opt-7b", "--device", "cpu", "--out", str(tmp_path / "new" / "prof"))
    assert "opt-7b" in err
    assert os.listdir(tmp_path) == []


def test_overwrite_replaces_an_earlier_profile_whole(tiny_model_path, tmp_path):
    out = tmp_path / "prof"
    profile(str(tiny_model_path), "eager", "prefill", out=out, **FAST)
    (out / "stale.csv").write_text("from the earlier run")
    with pytest.raises(ProfileError, match="pass --overwrite"):
        profile(str(tiny_model_path), "eager", "prefill", out=out, **FAST)
    profile(str(tiny_model_path), "eager", "prefill", out=out, overwrite=True, **FAST)
    assert not (out / "stale.csv").exists() and (out / "profile.json").is_file()
    assert os.listdir(tmp_path) == ["prof"]
