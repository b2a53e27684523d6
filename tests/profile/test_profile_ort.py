"""The profiler on the ONNX Runtime backends (``ort``, ``ort-plain``): every phase runs, and the op, kind and layer
tables come from ORT's own per-node profile (there are no torch modules to hook)."""
from __future__ import annotations

import json

import pytest

from fuseinfer.profile import profile
from fuseinfer.profile.ort_nodes import analyze_ort

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

FAST = dict(device="cpu", prompt_len=16, repeats=2, active=2, gen_len=2)


@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory):
    """One export per flavour for the module's runs (FUSEINFER_ONNX_DIR: the ort backends reuse a matching one)."""
    return tmp_path_factory.mktemp("onnx")


@pytest.mark.parametrize("backend,phase", [("ort", "prefill"), ("ort", "decode"), ("ort", "generate"),
                                           ("ort-plain", "prefill")])
def test_ort_backends_profile_every_phase(tiny_model_path, tmp_path, onnx_dir, set_knob, backend, phase):
    set_knob("FUSEINFER_ONNX_DIR", str(onnx_dir))
    result = profile(str(tiny_model_path), backend, phase, out=tmp_path, **FAST)
    prof = result.main
    a = prof.analysis
    assert prof.step_ms > 0 and a["unit"] == "ORT node"
    assert a["ops"] and all(r["op"].startswith("ort::") for r in a["ops"])
    kinds = {r["kind"] for r in a["kinds"]}
    assert {"mlp_in", "mlp_out", "lm_head", "layernorm"} <= kinds
    assert len(a["layers"]) == 4  # the tiny OPT's decoder layers
    assert 0 < a["busy_ms"] <= a["step_ms"] * 1.05
    assert any(r.get("flops_per_call") for r in a["ops"])  # the matrix products have a cost, so a verdict
    assert any("ONNX Runtime" in n for n in prof.notes)
    assert json.loads((tmp_path / backend / "ort_profile.json").read_text())
    assert prof.attribution is None  # no module pass: no torch modules


def _node(name, op, ts, dur, inputs, outputs):
    return {"cat": "Node", "name": f"{name}_kernel_time", "ts": ts, "dur": dur,
            "args": {"op_name": op, "provider": "CPUExecutionProvider",
                     "input_type_shape": [{"float": s} for s in inputs],
                     "output_type_shape": [{"float": s} for s in outputs]}}


def test_ort_profile_kinds_layers_and_runs(tmp_path):
    """Kinds from op types and shapes in run order; only the last ``runs`` runs count; per-step figures."""
    h, f, v = 8, 32, 50

    def layer(t):
        return [_node("q", "MatMul", t, 1, [[1, 2, h]], [[1, 2, h]]),
                _node("mha", "MultiHeadAttention", t + 1, 2, [[1, 2, h]], [[1, 2, h]]),
                _node("o", "MatMul", t + 3, 1, [[1, 2, h]], [[1, 2, h]]),
                _node("ln", "LayerNormalization", t + 4, 1, [[1, 2, h]], [[1, 2, h]]),
                _node("mlp_in", "MatMul", t + 5, 4, [[1, 2, h]], [[1, 2, f]]),
                _node("relu", "Relu", t + 9, 1, [[1, 2, f]], [[1, 2, f]]),
                _node("mlp_out", "MatMul", t + 10, 4, [[1, 2, f]], [[1, 2, h]])]

    def run(t0):
        return ([{"cat": "Session", "name": "model_run", "ts": t0, "dur": 100}] + layer(t0 + 1) + layer(t0 + 20)
                + [_node("final_ln", "LayerNormalization", t0 + 39, 1, [[1, 1, h]], [[1, 1, h]]),
                   _node("head", "MatMul", t0 + 40, 10, [[1, 1, h]], [[1, 1, v]])])

    events = run(0) + run(200) + run(400)  # a warm-up run, then two profiled steps
    events[1]["dur"] = 10_000  # (the warm-up's first node: must not count)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(events))
    out = analyze_ort(path, runs=2, steps=2, hidden=h, ffn=f, vocab=v, layers=2, model_type="opt")
    kinds = {r["kind"]: r["device_ms"] for r in out["kinds"]}
    assert kinds == pytest.approx({"qkv": 0.002, "attn_core": 0.004, "attn_out": 0.002, "layernorm": 0.003,
                                   "mlp_in": 0.008, "activation": 0.002, "mlp_out": 0.008, "lm_head": 0.010})
    assert [r["layer"] for r in out["layers"]] == [0, 1]
    assert out["busy_ms"] == pytest.approx(0.039) and out["run_ms"] == pytest.approx(0.1)
    mlp_in = next(r for r in out["ops"] if r["kind"] == "mlp_in")
    assert mlp_in["calls"] == 2 and mlp_in["flops_per_call"] == 2 * 2 * h * f


def test_ort_profile_names_grouped_query_and_gated_products(tmp_path):
    """A Llama-architecture graph: the fused q/k/v product is (H + 2 Hkv) D wide, not 3 E, and gate/up is one 2F
    product; both are named by kind (not "other")."""
    h, f, v, qkv = 8, 32, 50, 16  # e.g. 4 heads of 2 and 2 key/value heads: (4 + 2 * 2) * 2

    def layer(t):
        return [_node("qkv", "MatMul", t, 1, [[1, 2, h]], [[1, 2, qkv]]),
                _node("gqa", "GroupQueryAttention", t + 1, 2, [[1, 2, h]], [[1, 2, h]]),
                _node("o", "MatMul", t + 3, 1, [[1, 2, h]], [[1, 2, h]]),
                _node("gate_up", "MatMul", t + 5, 4, [[1, 2, h]], [[1, 2, 2 * f]]),
                _node("down", "MatMul", t + 10, 4, [[1, 2, f]], [[1, 2, h]])]

    events = [{"cat": "Session", "name": "model_run", "ts": 0, "dur": 100}] + layer(1) + \
        [_node("head", "MatMul", 40, 10, [[1, 1, h]], [[1, 1, v]])]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(events))
    out = analyze_ort(path, runs=1, steps=1, hidden=h, ffn=f, vocab=v, layers=1, model_type="llama", qkv_width=qkv)
    kinds = {r["kind"] for r in out["kinds"]}
    assert {"qkv", "mlp_in", "mlp_out", "lm_head"} <= kinds and "other" not in kinds
