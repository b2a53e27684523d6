"""The benchmark scripts' CPU tests: ``bench``, the script a test module names in ``SCRIPT`` (e.g. "bench_splitkv"),
imported with bench/ on sys.path while the module's tests run."""
from __future__ import annotations

import importlib
import sys

import pytest
from helpers import BENCH_DIR


@pytest.fixture(scope="module")
def bench(request):
    sys.path.insert(0, str(BENCH_DIR))
    try:
        yield importlib.import_module(request.module.SCRIPT)
    finally:
        sys.path.remove(str(BENCH_DIR))
