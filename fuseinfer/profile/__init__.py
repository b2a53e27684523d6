"""``python -m fuseinfer.profile``: where a step's time goes, what bounds it, and what to do about it.

For one phase (prefill, one decode step, or a whole generate) of a model on a backend (eager, compile, fuseinfer,
...): torch.profiler over warmed-up steps, aggregated by op and by kernel and by module kind / decoder layer (module
ranges, also as NVTX ranges for nsys / ncu), each op classified against ceilings measured in the same run (compute-,
memory- or launch/latency-bound, % of roofline), hints, an optional comparison with a second backend, and files:
Chrome trace, TensorBoard log, CSV / JSON / Markdown tables, plots, ``summary.md``. Library use::

    from fuseinfer.profile import profile
    result = profile("random:opt-125m", backend="fuseinfer", phase="decode", compare="eager", out="prof/")
    result.main.analysis["kinds"], result.hints
"""
from fuseinfer.profile.api import BackendProfile, ProfileResult, ProfileSettings, profile
from fuseinfer.profile.costs import Cost, register_cost
from fuseinfer.profile.errors import ProfileError

__all__ = ["BackendProfile", "Cost", "ProfileError", "ProfileResult", "ProfileSettings", "main", "profile",
           "register_cost"]


def main(argv=None) -> int:
    from fuseinfer.profile.cli import main as cli_main

    return cli_main(argv)
