"""bench/bench_decode.py's '-foldnorm' backends: the switches they hold while a backend is patched, captured and timed
(both families' FOLD_NORMS on or off inside, restored after, also on an error)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_decode  # noqa: E402

from fuseinfer.models.llama import modules as llama_modules  # noqa: E402
from fuseinfer.models.opt import modules as opt_modules  # noqa: E402


@pytest.mark.parametrize("family", [llama_modules, opt_modules], ids=["llama", "opt"])
def test_fold_norms_holds_the_switch_and_restores_it(family):
    before = family.FOLD_NORMS
    with bench_decode.fold_norms():
        assert family.FOLD_NORMS is True
    assert family.FOLD_NORMS is before
    with bench_decode.fold_norms(False):
        assert family.FOLD_NORMS is False
    assert family.FOLD_NORMS is before
    with pytest.raises(RuntimeError), bench_decode.fold_norms():
        raise RuntimeError("a failing backend")
    assert family.FOLD_NORMS is before
