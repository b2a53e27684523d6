"""The error ``python -m fuseinfer.eval`` turns into one line on stderr and exit code 2."""
from fuseinfer.core.errors import FuseInferError


class EvalError(FuseInferError):
    """Bad option, unknown model, missing data or device: the message says what to do instead."""
