"""Unit tests of the profile's parts: cost formulas, verdicts, the trace analysis on a synthetic CUDA trace
(kernels linked to ops and module ranges, graph replays), op ranges, and ncu's CSV."""
from __future__ import annotations

import os
import stat
from types import SimpleNamespace

import pytest

from fuseinfer.profile import costs, ncu
from fuseinfer.profile.modules import op_range_name, parse_op_range
from fuseinfer.profile.trace import GRAPH, analyze, classify
from fuseinfer.profile.verdict import add_verdicts, verdict

CEILINGS = {"copy_gbps": 3000.0, "gemm_tflops": {"float16": 600.0, "int8": 1200.0}, "launch_floor_us": 2.0,
            "model_precision": "float16", "device": "cuda"}


def test_linear_cost_by_hand():
    c = costs.cost_of("aten::linear", [[1, 2048, 2048], [8192, 2048], [8192]], ["c10::Half"] * 3)
    m, n, k = 2048, 8192, 2048
    assert c.flops == 2 * m * n * k + m * n
    assert c.bytes == 2 * (m * k + n * k + n + m * n)
    assert c.op_class == "gemm" and c.precision == "float16"
    gemv = costs.cost_of("fuseinfer::linear_epilogue", [[1, 1, 2048], [2048, 2048], [2048], [1, 1, 2048], []],
                         ["torch.float16"] * 4 + ["none"])
    assert gemv.op_class == "gemv" and gemv.flops == 2 * 2048 * 2048 + 2 * 2048


def test_folded_norm_gemvs_cost_as_their_linear():
    """The RMSNorm-prologue GEMVs (the Llama family's decode) and the q/k/v GEMV with the rotary epilogue: the
    linear's FLOPs and bytes (every output written once, to q or the cache)."""
    lin = costs.cost_of("fuseinfer::linear_epilogue", [[1, 1, 2048], [6144, 2048], [], [], []],
                        ["torch.float16"] * 4 + ["none"])
    norm = costs.cost_of("fuseinfer::rms_norm_linear", [[1, 1, 2048], [2048], [], [6144, 2048], [], [], []],
                         ["torch.float16", "torch.float16", "", "torch.float16", "", "", "silu_mul"])
    rope = costs.cost_of("fuseinfer::rms_norm_linear_rope_append",
                         [[1, 1, 2048], [2048], [], [6144, 2048], [], [1, 1, 64], [1, 1, 64]],
                         ["torch.float16", "torch.float16", "", "torch.float16", "", "torch.float16", "torch.float16"])
    plain = costs.cost_of("fuseinfer::linear_rope_append", [[1, 1, 2048], [6144, 2048], [], [], [1, 1, 64]],
                          ["torch.float16", "torch.float16", "", "", "torch.float16"])
    for c in (norm, rope, plain):
        assert c.op_class == "gemv" and (c.flops, c.bytes) == (lin.flops, lin.bytes)


def test_layer_norm_gemvs_cost_as_their_linear():
    """The LayerNorm-prologue GEMVs (OPT's folded decode): fc1's (ReLU; fp16 or int8 weights, whose bytes count 1
    each) and the q/k/v GEMV with the cache write, the linear's FLOPs and bytes."""
    f16 = "torch.float16"
    lin = costs.cost_of("fuseinfer::linear_epilogue", [[1, 1, 2048], [8192, 2048], [8192], [], []],
                        [f16] * 3 + ["", "relu"])
    fc1 = costs.cost_of("fuseinfer::layer_norm_linear",
                        [[1, 1, 2048], [2048], [2048], [], [8192, 2048], [], [8192], [], []],
                        [f16, f16, f16, "", f16, "", f16, "", "relu"])
    assert fc1.op_class == "gemv" and (fc1.flops, fc1.bytes) == (lin.flops, lin.bytes)
    int8 = costs.cost_of("fuseinfer::layer_norm_linear",
                         [[1, 1, 2048], [2048], [2048], [], [8192, 2048], [8192], [8192], [], []],
                         [f16, f16, f16, "", "torch.int8", "torch.float32", f16, "", "relu"])
    assert int8.flops == lin.flops and lin.bytes - int8.bytes == 8192 * 2048
    qkv = costs.cost_of("fuseinfer::layer_norm_linear_append",
                        [[1, 1, 2048], [2048], [2048], [], [6144, 2048], [], [6144]],
                        [f16, f16, f16, "", f16, "", f16])
    plain = costs.cost_of("fuseinfer::linear_rope_append", [[1, 1, 2048], [6144, 2048], [], [6144]],
                          [f16, f16, "", f16])
    assert qkv.op_class == "gemv" and (qkv.flops, qkv.bytes) == (plain.flops, plain.bytes)


def test_attention_costs_count_causal_pairs():
    sq = 128
    full = costs.cost_of("aten::scaled_dot_product_attention", [[1, 2, sq, 64]] * 3 + [[]], ["c10::Half"] * 3,
                         ["", "", "", "", "0.", "False"])
    assert full.flops == 4 * 2 * (sq * (sq + 1) // 2) * 64  # square and unmasked: OPT's causal prefill
    decode = costs.cost_of("fuseinfer::attention", [[1, 2, 1, 64], [1, 2, 100, 64], [1, 2, 100, 64], [1, 100], [1]],
                           ["c10::Half"] * 3 + ["bool", "int"])
    assert decode.flops == 4 * 2 * 100 * 64


def test_elementwise_cost_of_empty_tensors_is_no_cost_model():
    """An elementwise op on empty tensors (a fill_ of a 0-length slice) moves nothing: no cost rather than 0 FLOPs
    and 0 bytes, whose verdict would flip between launch-bound and "no cost model" with the host's speed."""
    assert costs.cost_of("aten::fill_", [[1, 0], []], ["float", "Scalar"]) is None
    assert costs.cost_of("aten::fill_", [[2, 3], []], ["float", "Scalar"]).bytes == 2 * 2 * 3 * 4


def test_register_cost_for_a_new_op():
    costs.register_cost("fuseinfer::int8_test_linear", costs.linear_cost(0, 1, 2))
    try:
        c = costs.cost_of("fuseinfer::int8_test_linear", [[4, 64], [32, 64], [32]],
                          ["signed char", "signed char", "float"])
        assert c.precision == "int8" and c.flops == 2 * 4 * 32 * 64 + 4 * 32
        assert costs.cost_of("fuseinfer::unknown", [[1]], ["float"]) is None
    finally:
        costs.COSTS.pop("fuseinfer::int8_test_linear")


def _row(flops, nbytes, mean_us, precision="float16"):
    return {"flops_per_call": flops, "bytes_per_call": nbytes, "mean_us": mean_us, "precision": precision}


def test_verdicts_against_the_ridge():
    ridge = 600e12 / 3000e9  # 200 FLOP/B
    big_gemm = verdict(_row(2 * 4096**3, 3 * 4096**2 * 2, 300.0), CEILINGS)
    assert big_gemm["verdict"] == "compute-bound" and big_gemm["ridge"] == pytest.approx(ridge)
    assert big_gemm["pct_roofline"] == pytest.approx(2 * 4096**3 / 300e-6 / 600e12)
    gemv = verdict(_row(2 * 8192 * 2048, 8192 * 2048 * 2, 14.0), CEILINGS)  # 33.5 MB in 14 us = 2.4 TB/s
    assert gemv["verdict"] == "memory-bound" and gemv["pct_roofline"] == pytest.approx(
        8192 * 2048 * 2 / 14e-6 / 3000e9)
    tiny = verdict(_row(1000, 4000, 3.0), CEILINGS)  # 3 us for 4 kB: short and far from both ceilings
    assert tiny["verdict"] == "launch/latency-bound"
    assert verdict(_row(None, None, 100.0), CEILINGS)["verdict"] == "no cost model"


def test_classify_fused_ops_by_shape():
    seen = set()
    attn = ("attention", "model.decoder.layers.0.self_attn", object())
    layer = ("layer", "model.decoder.layers.0", object())
    path = [layer[:2] + (layer[2],), attn]
    lin = "fuseinfer::linear_epilogue"
    assert classify(path, lin, [[1, 8, 64], [192, 64]], 64, 256, seen) == "qkv"
    assert classify(path, "fuseinfer::attention", [], 64, 256, seen) == "attn_core"
    assert classify(path, lin, [[1, 8, 64], [64, 64]], 64, 256, seen) == "attn_out"
    assert classify([path[0]], lin, [[1, 8, 64], [256, 64]], 64, 256, seen) == "mlp_in"
    assert classify([path[0]], lin, [[1, 8, 256], [64, 256]], 64, 256, seen) == "mlp_out"
    assert classify([path[0]], "aten::add", [[1, 8, 64]] * 2, 64, 256, seen) == "residual"
    assert classify([], GRAPH, [], 64, 256, seen) == GRAPH


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1 if cat not in ("kernel",) else 0, "tid": tid, "ts": ts,
            "dur": dur, "args": args}


def synthetic_cuda_trace():
    """Two steps: a module range with one linear launching one GEMM kernel, an elementwise op outside modules, and a
    graph launch whose two kernels link to it by correlation."""
    events = []
    for i, t0 in enumerate((0.0, 1000.0)):
        events += [
            _x("user_annotation", f"ProfilerStep#{i}", t0, 900.0),
            _x("user_annotation", "fi:layer:model.decoder.layers.0", t0 + 10, 300),
            _x("user_annotation", "fi:mlp_in:model.decoder.layers.0.fc1", t0 + 20, 200),
            _x("cpu_op", "aten::linear", t0 + 30, 100, **{"Input Dims": [[1, 512, 64], [256, 64], [256]],
                                                          "Input type": ["c10::Half"] * 3}),
            _x("cuda_runtime", "cudaLaunchKernel", t0 + 50, 5, correlation=10 + i * 10),
            _x("kernel", "sm90_gemm", t0 + 60, 400, tid=7, correlation=10 + i * 10),
            _x("cpu_op", "aten::add", t0 + 400, 20, **{"Input Dims": [[1, 512, 64], [1, 512, 64]],
                                                       "Input type": ["c10::Half"] * 2}),
            _x("cuda_runtime", "cudaLaunchKernel", t0 + 405, 5, correlation=11 + i * 10),
            _x("kernel", "elementwise_add", t0 + 470, 10, tid=7, correlation=11 + i * 10),
            _x("cuda_runtime", "cudaGraphLaunch", t0 + 500, 20, correlation=12 + i * 10),
            _x("kernel", "graph_k1", t0 + 520, 100, tid=7, correlation=12 + i * 10),
            _x("kernel", "graph_k2", t0 + 630, 50, tid=7, correlation=12 + i * 10),
        ]
    return events


def test_analysis_of_a_cuda_trace():
    a = analyze(synthetic_cuda_trace(), 64, 256)
    assert a["unit"] == "kernel" and a["steps"] == 2 and a["step_ms"] == pytest.approx(0.9)
    kinds = {r["kind"]: r["device_ms"] for r in a["kinds"]}
    assert kinds == pytest.approx({"mlp_in": 0.4, "other": 0.01, GRAPH: 0.15})
    assert a["busy_ms"] == pytest.approx(0.56) and a["idle_ms"] == pytest.approx(0.34)
    assert a["launches_per_step"] == 3 and a["graph_launches_without_kernels"] == 0
    kernels = {k["kernel"]: k for k in a["kernels"]}
    assert kernels["sm90_gemm"]["op"] == "aten::linear" and kernels["graph_k1"]["op"] == GRAPH
    linear = next(r for r in a["ops"] if r["op"] == "aten::linear")
    assert linear["calls"] == 1 and linear["mean_us"] == pytest.approx(400) and linear["host_ms"] == pytest.approx(0.1)
    add_verdicts(a, CEILINGS)
    assert kernels["sm90_gemm"]["verdict"] == linear["verdict"] != "no cost model"
    assert [r["layer"] for r in a["layers"]] == [0]


def test_op_range_names_round_trip():
    import torch

    name = op_range_name("fuseinfer::linear_epilogue", (torch.zeros(2, 3), torch.zeros(4, 3), None, None, "relu"))
    assert '"' not in name  # torch's trace writer does not escape quotes in range names
    assert parse_op_range(name) == ("fuseinfer::linear_epilogue", [[2, 3], [4, 3], [], [], []],
                                    ["torch.float32", "torch.float32", "", "", "relu"])
    assert parse_op_range("fi:layer:x") is None


NCU_CSV = '''==PROF== Connected to process 1
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","python","h","sm90_gemm","1","7","(128, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes.sum","Mbyte","33.55"
"0","1","python","h","sm90_gemm","1","7","(128, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","12.50"
"0","1","python","h","sm90_gemm","1","7","(128, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","dram__throughput.avg.pct_of_peak_sustained_elapsed","%","80.1"
"0","1","python","h","sm90_gemm","1","7","(128, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","sm__throughput.avg.pct_of_peak_sustained_elapsed","%","20.5"
'''


def test_ncu_csv_and_run_with_a_stand_in_ncu(tmp_path, monkeypatch):
    figures = ncu.parse_csv(NCU_CSV)
    assert figures["duration_us"] == 12.5 and figures["dram_bytes"] == pytest.approx(33.55e6)
    assert figures["dram_gbps"] == pytest.approx(33.55e6 / 12.5e-6 / 1e9)
    assert ncu.name_regex("void f<(int)1>(x)") == "^void f<\\(int\\)1>\\(x\\)"
    fake = tmp_path / "ncu"  # prints the CSV above and records its arguments
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/args\ncat <<'EOF'\n{NCU_CSV}EOF\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    kernel = {"kernel": "sm90_gemm", "device_ms": 1.0}
    prof = SimpleNamespace(name="fuseinfer", analysis={"kernels": [kernel]})
    settings = dict(model="random:opt-125m", phase="decode", device="cuda", dtype="float16", batch_size=1,
                    prompt_len=16, gen_len=4, seed=0)
    notes = ncu.run_ncu(SimpleNamespace(profiles=[prof], settings=settings), top=1)
    assert notes == [] and kernel["ncu_dram_pct"] == 80.1 and kernel["ncu_sm_pct"] == 20.5
    args = (tmp_path / "args").read_text()
    assert "regex:^sm90_gemm" in args and "fuseinfer.profile.ncu_target" in args and "--dtype fp16" in args
    # the target's parser takes exactly what run_ncu passes (no --out: it writes nothing)
    from fuseinfer.profile.cli import build_parser

    argv = ncu.target_args(settings, "fuseinfer")
    parsed = build_parser(out_required=False).parse_args(argv[argv.index("fuseinfer.profile.ncu_target") + 1:])
    assert parsed.out is None and parsed.phase == "decode" and parsed.prompt_len == 16 and parsed.dtype == "fp16"


def test_op_ranges_wrap_the_direct_cuda_calls_and_restore_them():
    import importlib

    from fuseinfer.profile.modules import OpRanges

    linear, attention = (importlib.import_module(f"fuseinfer.ops.{m}") for m in ("linear", "attention"))

    before = linear._linear_epilogue_cuda, attention._attention_cuda
    with OpRanges() as ranges:
        wrapped = {(m.__name__, attr) for m, attr, _ in ranges.patched}
        assert ("fuseinfer.ops.linear", "_linear_epilogue_cuda") in wrapped
        assert ("fuseinfer.ops.attention", "_attention_cuda") in wrapped
        assert linear._linear_epilogue_cuda is not before[0]
    assert (linear._linear_epilogue_cuda, attention._attention_cuda) == before


def test_decode_step_cost_counts_int8_weights_at_one_byte():
    """fuseinfer::opt_decode_step of one layer (E = 64, F = 128, V = 100): fp16 weights at 2 bytes; with weight scales
    (argument 15, an int8 weight-only model) the layer's matrices at 1 byte plus 4 bytes per scale."""
    e, f, v = 64, 128, 100
    layer = [[e], [e], [3 * e, e], [3 * e], [e, e], [e], [e], [e], [f, e], [f], [e, f], [e]]
    dims = [[1, 1], [1, 1], [1], [1, 16], [v, e], [18, e], layer, [[1, 1, 16, e]], [[1, 1, 16, e]], [e], [e], [v, e],
            [8], [], []]
    types = ["torch.int64"] * 3 + ["torch.bool"] + ["torch.float16"] * 2 + [""] * 3 + ["torch.float16"] * 3 + \
        ["torch.uint8", "float", "float"]
    matrices = 3 * e * e + e * e + 2 * f * e
    fp16 = costs.cost_of("fuseinfer::opt_decode_step", dims, types)
    int8 = costs.cost_of("fuseinfer::opt_decode_step", dims + [[[3 * e], [e], [f], [e]]], types + [""])
    assert fp16.flops == int8.flops == 2 * (matrices + v * e)
    assert fp16.bytes - int8.bytes == matrices - 4 * (3 * e + e + f + e)
    # FP8 caches (KV scales, argument 16): the two (1, 1, 16, E) caches at 1 byte
    kv8 = costs.cost_of("fuseinfer::opt_decode_step", dims + [[], [[2, 1]]], types + ["", ""])
    assert kv8.flops == fp16.flops and fp16.bytes - kv8.bytes == 2 * 16 * e


def test_llama_decode_step_cost():
    """fuseinfer::llama_decode_step of one layer (E = 64, 4 heads, 2 KV heads of 16, F = 96, V = 100, a q/k/v bias):
    2 flops per weight per row, fp16 weights, norms, bias and caches at 2 bytes, fp32 logits."""
    e, f, v, kvd, rows, cap = 64, 96, 100, 32, 2, 16
    layer = [[e], [e + 2 * kvd, e], [e, e], [e], [2 * f, e], [e, f]]
    dims = [[rows], [rows, 16], [rows, 16], [rows], [rows, cap], [v, e], layer, [[e + 2 * kvd]],
            [[rows, 2, cap, 16]], [[rows, 2, cap, 16]], [e], [v, e], [8], [], []]
    types = ["torch.int64", "torch.float16", "torch.float16", "torch.int32", "torch.bool", "torch.float16", "", "",
             "", "", "torch.float16", "torch.float16", "torch.uint8", "float", "float"]
    matrices = (e + 2 * kvd) * e + e * e + 2 * f * e + e * f
    cost = costs.cost_of("fuseinfer::llama_decode_step", dims, types)
    assert cost.flops == 2 * rows * (matrices + v * e)
    assert cost.bytes == 2 * (matrices + v * e + 2 * e + e + 2 * kvd + 2 * rows * 2 * cap * 16) + rows * v * 4
    # FP8 caches (KV scales, argument 15): the caches at 1 byte
    kv8 = costs.cost_of("fuseinfer::llama_decode_step", dims + [[[2, 2]]], types + [""])
    assert kv8.flops == cost.flops and cost.bytes - kv8.bytes == 2 * rows * 2 * cap * 16
