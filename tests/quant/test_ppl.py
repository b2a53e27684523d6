"""Accuracy of W8A16 on the small trained OPT (opt-wt2-tiny), WikiText-2 test, GPTQ protocol (fuseinfer.eval's
perplexity: non-overlapping windows of the model's max_position_embeddings, 2048), CPU fp32 reference path,
through the eval CLI's runner and the fuseinfer-w8a16 backend: PPL within 0.5% of the unquantized model's."""
from __future__ import annotations

import pytest

from fuseinfer.eval.runner import Settings, run
from tests.conftest import WIKITEXT
from tests.eval.test_cli import quiet_ui


WINDOWS = 24  # of 2048 tokens (~49k of the test split's ~287k, to keep CI short; the GPU stage runs them all)


def test_w8a16_ppl_within_half_a_percent_of_fp(tiny_model_path):
    if not (WIKITEXT / "wiki.test.raw").exists():
        pytest.skip(f"WikiText-2 not found at {WIKITEXT}")
    settings = Settings(model=str(tiny_model_path), backends=("fuseinfer", "fuseinfer-w8a16"), device="cpu",
                        dtype="fp32", data_dir=str(WIKITEXT), skip_latency=True, max_windows=WINDOWS)
    rows = run(settings, quiet_ui())["backends"]
    fp, w8 = rows["fuseinfer"]["ppl"], rows["fuseinfer-w8a16"]["ppl"]
    print(f"opt-wt2-tiny WikiText-2 test PPL: fp32 {fp:.4f}, W8A16 {w8:.4f} ({100 * (w8 / fp - 1):+.3f}%), "
          f"{rows['fuseinfer']['ppl_windows']} windows")
    assert rows["fuseinfer-w8a16"]["quantized_weights"] == 16
    assert abs(w8 / fp - 1) < 0.005
