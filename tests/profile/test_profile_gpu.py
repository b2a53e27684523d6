"""GPU tests of ``fuseinfer.profile`` (run on the device by tools/gpu_check.sh gputest / gpu_stage_profile.sh):
kernels linked to ops and module kinds, the tables adding up to the step, verdicts on GEMMs, graph replays."""
from __future__ import annotations

import pytest

from fuseinfer.profile import profile
from fuseinfer.profile.trace import GRAPH

pytestmark = pytest.mark.gpu


def _sums_to_step(a: dict) -> None:
    kinds = sum(r["device_ms"] for r in a["kinds"]) + a["idle_ms"]
    assert kinds == pytest.approx(a["step_ms"], rel=0.05)


def test_prefill_kernels_by_module_kind_and_verdicts(tmp_path):
    r = profile("random:opt-125m", "fuseinfer", "prefill", compare="eager", device="cuda", prompt_len=1024,
                repeats=5, out=tmp_path)
    for p in r.profiles:
        a = p.analysis
        assert a["unit"] == "kernel" and a["kernels"] and a["launches_per_step"] > 0
        _sums_to_step(a)
        # (fuseinfer's prefill replays a CUDA graph at this shape: kinds and op costs come from its op-by-op pass)
        kinds = {k["kind"] for k in p.kinds["kinds"] if k["device_ms"] > 0}
        assert {"qkv", "attn_out", "attn_core", "mlp_in", "mlp_out", "layernorm", "lm_head"} <= kinds, (p.name, kinds)
        gemms = [o for o in p.cost_analysis["ops"] if o.get("op_class") == "gemm" and o["device_ms"] > 0]
        assert gemms and all(o["verdict"] in ("compute-bound", "memory-bound") for o in gemms)
        assert all(k["verdict"] for k in a["kernels"])
        assert a["memory"]["cuda_stats"]["max_allocated_mib"] > a["memory"]["cuda_stats"]["allocated_before_mib"]
    # fuseinfer's direct extension calls are costed like recorded ops (modules.OpRanges)
    ops = {o["op"] for o in r.profiles[0].cost_analysis["ops"]}
    assert {"fuseinfer::linear_epilogue", "fuseinfer::attention", "fuseinfer::add_layer_norm"} <= ops
    assert r.compare["speedup"] > 0 and r.compare["disappeared"]
    assert (tmp_path / "fuseinfer" / "trace.json").is_file() and (tmp_path / "summary.md").is_file()


def test_decode_graph_replay_is_reported(tmp_path):
    r = profile("random:opt-125m", "fuseinfer", "decode", compare="eager", device="cuda", prompt_len=256,
                repeats=10, out=tmp_path)
    fused, eager = r.profiles
    _sums_to_step(fused.analysis)
    _sums_to_step(eager.analysis)
    assert any("CUDA graphs" in n for n in fused.notes)
    graph = [k for k in fused.analysis["kinds"] if k["kind"] == GRAPH]
    if fused.analysis["graph_launches_without_kernels"]:
        pytest.skip("CUPTI did not report the kernels of graph replays here (their time shows as idle)")
    assert graph and graph[0]["device_ms"] > 0
    gemv = [o for o in eager.analysis["ops"] if o.get("op_class") == "gemv" and o["device_ms"] > 0]
    assert gemv and {o["verdict"] for o in gemv} <= {"memory-bound", "launch/latency-bound"}
    assert r.compare["speedup"] > 1  # fast decode beats eager's host-bound step
