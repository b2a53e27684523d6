"""The ``eager`` backend: the Hugging Face model as loaded (:class:`fuseinfer.harness.backends.EagerBackend`)."""
from fuseinfer.eval.backends import register
from fuseinfer.harness.backends import EagerBackend

register(EagerBackend)
