"""The eval's CPU timing hygiene: one torch thread while timing (a loaded 2-core machine swung the ratios between
identical runs from 0.01x to 27.9x at the default thread count), and a warning for a timing whose spread is wide."""
from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from fuseinfer.harness.timing import WIDE_SPREAD, cpu_threads, spread_warnings, summarize

times = st.lists(st.floats(0.01, 1e4, allow_nan=False), min_size=1, max_size=30)


@given(times, times)
def test_spread_warning_exactly_for_wide_series(prefill, decode):
    rows = {"fuseinfer": {"prefill_ms": summarize(prefill), "decode_ms_per_token": summarize(decode)},
            "broken": {"error": "x", "prefill_ms": None}}
    warned = spread_warnings(rows)
    expected = [k for k, series in (("prefill_ms", prefill), ("decode_ms_per_token", decode))
                if (lambda s: (s["p90"] - s["p10"]) / s["median"] > WIDE_SPREAD)(summarize(series))]
    assert [w.split()[1].rstrip(":") for w in warned] == expected
    assert all(w.startswith("fuseinfer ") and "unreliable" in w for w in warned)


def test_cpu_timing_runs_at_one_thread_and_restores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with cpu_threads(torch.device("cpu")) as line:
            assert torch.get_num_threads() == 1 and "1 torch thread" in line
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        with cpu_threads(torch.device("cpu")) as line:
            assert torch.get_num_threads() == 2 and "OMP_NUM_THREADS" in line
        with cpu_threads(torch.device("cuda")) as line:
            assert line is None
    finally:
        torch.set_num_threads(before)
