"""The one exception type fuseinfer raises for bad input; its message always names the fix."""


class FuseInferError(ValueError):
    """Unsupported model, wrong device or dtype, unknown option, missing file: the message says what to do."""
