"""bench/common.py's paired timing: the closures alternate round by round, and the ratio pairs rounds."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import common  # noqa: E402


def test_paired_ms_alternates_and_summarises(monkeypatch):
    calls, clock = [], iter([3.0, 1.0, 5.0, 2.0, 4.0, 9.0])  # a, b, a, b, a, b

    def fake_bench_ms(fn, rep_ms):
        fn()
        return {"median_ms": next(clock)}

    monkeypatch.setattr(common, "bench_ms", fake_bench_ms)
    out = common.paired_ms({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3)
    assert calls == ["a", "b"] * 3
    assert out["a"] == {"median_ms": 4.0, "min_ms": 3.0, "max_ms": 5.0, "rounds_ms": [3.0, 5.0, 4.0]}
    assert out["b"]["rounds_ms"] == [1.0, 2.0, 9.0] and out["b"]["median_ms"] == 2.0
    # per-round ratios 3, 2.5, 0.444: their median, not the ratio of the medians (4 / 2 = 2)
    assert common.paired_ratio(out["a"], out["b"]) == 2.5


def test_paired_ms_enters_each_closures_context_around_its_timing(monkeypatch):
    """(bench_silu_gemm: a knob override selects the implementation while it is timed, and only then)"""
    import contextlib
    events = []

    @contextlib.contextmanager
    def ctx(name):
        events.append(f"enter {name}")
        yield
        events.append(f"exit {name}")

    monkeypatch.setattr(common, "bench_ms", lambda fn, rep_ms: (fn(), {"median_ms": 1.0})[1])
    common.paired_ms({"a": lambda: events.append("a"), "b": lambda: events.append("b")}, rounds=2,
                     contexts={"a": lambda: ctx("a")})
    assert events == ["enter a", "a", "exit a", "b"] * 2


def test_ratio_to_the_fastest_of_several_per_round():
    """bench_attention's speedup: each round's fastest baseline over this round's time, median over rounds."""
    b1, b2, ours = [2.0, 4.0, 3.0], [3.0, 1.0, 6.0], [1.0, 2.0, 4.0]
    best = common.round_stats([min(x, y) for x, y in zip(b1, b2)])
    assert best == {"median_ms": 2.0, "min_ms": 1.0, "max_ms": 3.0, "rounds_ms": [2.0, 1.0, 3.0]}
    # per round 2 / 1, 1 / 2, 3 / 4
    assert common.paired_ratio(best, common.round_stats(ours)) == 0.75


def test_percentile_stats_interpolates_like_the_eval():
    """p10 / p90 of five rounds are interpolated (as fuseinfer.harness.timing.summarize does), not the min and max."""
    import pytest

    out = common.percentile_stats([10.0, 1.0, 2.0, 3.0, 4.0])
    assert out == pytest.approx({"median_ms": 3.0, "p10_ms": 1.4, "p90_ms": 7.6, "n": 5}, abs=1e-12)


def test_fused_pair_gemm_row_sets_each_knob_and_derives_the_figures(monkeypatch):
    """(bench_silu_gemm, bench_qkv_gemm) each closure is timed with its knob value set, and only then; TFLOP/s and
    the ratios come from the paired rounds."""
    from fuseinfer.core import knobs

    seen, clock = [], iter([2.0, 4.0, 1.0] * 5)  # fused, pair, gemm per round

    def fake_bench_ms(fn, rep_ms):
        fn()
        return {"median_ms": next(clock)}

    monkeypatch.setattr(common, "bench_ms", fake_bench_ms)
    fns = {name: (lambda name=name: seen.append((name, knobs.get("FUSEINFER_QKV_GEMM"))))
           for name in ("fused", "pair", "gemm")}
    row = common.fused_pair_gemm_row(fns, "QKV_GEMM", {"fused": "1", "pair": "0", "gemm": "0"}, flops=4e9)
    assert seen == [("fused", "1"), ("pair", "0"), ("gemm", "0")] * 5
    assert (row["fused_ms"], row["pair_ms"], row["gemm_ms"]) == (2.0, 4.0, 1.0)
    assert row["fused_over_pair"] == 0.5 and row["fused_over_gemm"] == 2.0
    assert abs(row["fused_TFLOPs"] - 2.0) < 1e-9 and abs(row["gemm_TFLOPs"] - 4.0) < 1e-9
    assert set(common.FUSED_PAIR_GEMM_COLUMNS) - {"fused_kernel", "max_abs_diff_vs_pair"} <= set(row)
