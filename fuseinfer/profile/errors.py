"""The error ``python -m fuseinfer.profile`` turns into one line on stderr and exit code 2."""
from fuseinfer.harness.errors import EvalError


class ProfileError(EvalError):
    """Unknown backend, a phase the backend lacks, an unwritable out dir, ``--ncu`` without ncu: the message says
    what to do instead. (An :class:`EvalError`, so the eval's own checks of model, device and sizes read the same.)"""
