"""The ``fuseinfer`` backend: the model patched by ``fuseinfer.patch``, decoding through fuseinfer's runtime
(:class:`fuseinfer.harness.backends.FuseInferBackend`)."""
from fuseinfer.eval.backends import register
from fuseinfer.harness.backends import FuseInferBackend

register(FuseInferBackend)
