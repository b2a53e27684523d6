"""``python -m fuseinfer.eval``: what patching buys on a model and GPU, with numbers to trust.

For each backend (``eager``, ``compile``, ``fuseinfer``, ...; see :data:`BACKENDS`, ``fuseinfer/eval/backends/``) on the same model: WikiText-2
perplexity (GPTQ protocol, or sliding window with ``--stride``), prefill latency, decode ms/token and tokens/s,
peak GPU memory, and derived figures (prefill TFLOP/s, decode GB/s against the measured copy bandwidth,
speedups over eager). Library use::

    from fuseinfer.eval import ConsoleUI, Settings, run
    results = run(Settings(model="opt-125m"), ConsoleUI())
"""
from fuseinfer.eval.backends import BACKENDS, register
from fuseinfer.eval.cli import main
from fuseinfer.eval.runner import Settings, run
from fuseinfer.harness.backends import Backend
from fuseinfer.harness.errors import EvalError
from fuseinfer.harness.ui import ConsoleUI

__all__ = ["BACKENDS", "Backend", "ConsoleUI", "EvalError", "Settings", "main", "register", "run"]
